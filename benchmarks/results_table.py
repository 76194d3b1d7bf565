#!/usr/bin/env python3
"""Turns Google Benchmark JSON (--benchmark_out=F --benchmark_out_format=json) of
bench_collectives / bench_gemm into the Markdown tables of benchmarks/RESULTS.md.

usage: results_table.py collectives.json [gemm.json ...]
"""
import json
import sys


def load(path):
    with open(path) as f:
        return json.load(f)["benchmarks"]


def params(name):
    # "all_reduce/ranks:2/bytes:1024/manual_time" -> ("all_reduce", {"ranks": 2, "bytes": 1024})
    parts = name.split("/")
    kv = {}
    for p in parts[1:]:
        if ":" in p:
            k, v = p.split(":", 1)
            kv[k] = int(v)
    return parts[0], kv


def human(nbytes):
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def collectives(rows):
    ops = ["all_reduce", "all_gather", "reduce_scatter"]
    for op in ops:
        for ranks in (2, 4):
            sel = [r for r in rows if params(r["name"])[0] == op and params(r["name"])[1].get("ranks") == ranks]
            if not sel:
                continue
            print(f"\n#### {op}, {ranks} ranks\n")
            print("| size (B) | size | count | time (us) | algbw (GB/s) | busbw (GB/s) | wrong | iterations |")
            print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
            for r in sel:
                if r.get("error_occurred"):
                    print(f"| {params(r['name'])[1].get('bytes')} | error: {r.get('error_message')} | | | | | | |")
                    continue
                size = int(r["size"])
                print(f"| {size} | {human(size)} | {int(r['count'])} | {r['time_us']:.1f} | {r['algbw']:.3f} | "
                      f"{r['busbw']:.3f} | {int(r['wrong'])} | {r['iterations']} |")
    sel = [r for r in rows if params(r["name"])[0] == "copy_bandwidth"]
    if sel:
        print("\n#### copy_bandwidth (memcpy of 256 MiB; GB/s = (read + written bytes) / time / 1e9)\n")
        print("| threads | time per copy (ms) | GB/s (read + write) | iterations |")
        print("| ---: | ---: | ---: | ---: |")
        for r in sel:
            t = r["real_time"]  # unit ms (manual time)
            print(f"| {params(r['name'])[1]['threads']} | {t:.2f} | {r['GBps']:.2f} | {r['iterations']} |")


def gemm(rows):
    print("\n#### sgemm (cblas_sgemm, square N, GFLOP/s = 2 N^3 / time / 1e9)\n")
    print("| N | BLAS threads | OpenBLAS kernels | time per call (ms) | GFLOP/s | wrong | iterations |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        _, kv = params(r["name"])
        print(f"| {kv['n']} | {kv['threads']} | {r.get('label', '')} | {r['real_time']:.2f} | {r['GFLOPs']:.1f} | {int(r['wrong'])} | "
              f"{r['iterations']} |")


if __name__ == "__main__":
    collectives(load(sys.argv[1]))
    for path in sys.argv[2:]:
        gemm(load(path))
