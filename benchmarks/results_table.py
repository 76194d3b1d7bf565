#!/usr/bin/env python3
"""Turns Google Benchmark JSON of bench_gemm (--benchmark_out=F --benchmark_out_format=json)
into the sgemm tables of benchmarks/RESULTS.md. (bench_collectives writes its own tables:
--tables=FILE.)

usage: results_table.py gemm.json [gemm_skx.json ...]
"""
import json
import sys


def load(path):
    with open(path) as f:
        return json.load(f)["benchmarks"]


def params(name):
    # "sgemm/n:1024/threads:2/manual_time" -> {"n": 1024, "threads": 2}
    kv = {}
    for p in name.split("/")[1:]:
        if ":" in p:
            k, v = p.split(":", 1)
            kv[k] = int(v)
    return kv


def gemm(rows):
    print("\n#### sgemm (cblas_sgemm, square N, GFLOP/s = 2 N^3 / time / 1e9)\n")
    print("| N | BLAS threads | OpenBLAS kernels | time per call (ms) | GFLOP/s | wrong | iterations |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        kv = params(r["name"])
        print(f"| {kv['n']} | {kv['threads']} | {r.get('label', '')} | {r['real_time']:.2f} | {r['GFLOPs']:.1f} | {int(r['wrong'])} | "
              f"{r['iterations']} |")


if __name__ == "__main__":
    for path in sys.argv[1:]:
        gemm(load(path))
