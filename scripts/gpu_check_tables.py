#!/usr/bin/env python3
"""The Markdown tables of scripts/gpu-check.sh, from the Google Benchmark JSON of the CUDA
benchmarks (--benchmark_out=F --benchmark_out_format=json). A file that is missing or cut short
(its run failed or was killed at its time limit) gives a line saying so instead of its rows, and
a case that reported an error gives its message; the script never fails on them.

usage: gpu_check_tables.py gemm|attention|train FILE.json [FILE.json ...]
"""
import json
import sys


def runs(paths):
    """The benchmark runs of every file, in order, and a note for each file that has none."""
    rows, notes = [], []
    for path in paths:
        try:
            with open(path) as f:
                rows += json.load(f)["benchmarks"]
        except (OSError, ValueError, KeyError) as e:
            notes.append(f"No result from {path}: {e} (its run failed or ran out of time: see bench.log).")
    return rows, notes


def section(title, header, notes, rows):
    """Prints a section: its title, the notes, then a table of `rows` (lists of cells) if any."""
    print(f"\n## {title}\n")
    for n in notes:
        print(n + "\n")
    if not rows:
        return
    print("| " + " | ".join(header) + " |")
    print("| --- |" + " ---: |" * (len(header) - 1))
    for r in rows:
        print("| " + " | ".join(r) + " |")


def table(title, header, rows, notes, cells):
    """One row a run: its name, then cells(run), or its error message."""
    blank = [""] * (len(header) - 2)
    out = []
    for b in rows:
        if b.get("error_occurred"):
            body = [f"error: {b.get('error_message', '')}"] + blank
        else:
            try:
                body = cells(b)
            except KeyError as e:
                body = [f"missing counter {e}"] + blank
        out.append([b["name"]] + body)
    section(title, header, notes, out)


def gemm(paths):
    rows, notes = runs(paths)
    # gemm_bf16/<shape>/<impl>[/manual_time]: one row a shape, dsp and cublas side by side.
    shapes = {}
    for b in rows:
        _, shape, impl = b["name"].split("/")[:3]
        shapes.setdefault(shape, {})[impl] = b
    out = []
    for shape, r in shapes.items():
        d, c = r.get("dsp", {}), r.get("cublas", {})
        errors = sorted({x["error_message"] for x in (d, c) if x.get("error_occurred")})
        if errors or "TFLOPs" not in d or "TFLOPs" not in c:
            out.append([shape, f"error: {'; '.join(errors) or 'missing result'}", "", "", ""])
        else:
            out.append([shape, f"{d['TFLOPs']:.0f}", f"{c['TFLOPs']:.0f}", f"{d['TFLOPs'] / c['TFLOPs']:.3f}",
                        f"{int(d['wrong'] + c['wrong'])}"])
    section("bf16 GEMM (bench_gemm_cuda, TFLOP/s = 2mnk / time / 1e12)",
            ["shape", "dsp TFLOP/s", "cuBLAS TFLOP/s", "dsp / cuBLAS", "wrong"], notes, out)


def attention(paths):
    rows, notes = runs(paths)
    table("causal attention, fp32 and bf16 scope, batch 2, 12 heads, head_dim 128 (bench_attention_cuda; see its header)",
          ["case", "ms", "TFLOP/s", "max rel diff vs the other impl", "held for backward MB"], rows, notes,
          lambda b: [f"{b['real_time']:.2f}", f"{b['TFLOPs']:.1f}", f"{b['max_rel_diff']:.1e}", f"{b['held_MB']:.2f}"])


def train(paths):
    rows, notes = runs(paths)
    table("training step, 0.78B model, one GPU, fp32 and bf16 mixed precision (bench_train_step_cuda; see its header)",
          ["case", "ms/step", "tokens/s", "TFLOP/s", "MFU vs fp32 peak", "MFU vs bf16 peak", "peak GB", "ledger GB"],
          rows, notes,
          lambda b: [f"{b['real_time']:.0f}", f"{b['tokens/s']:.0f}", f"{b['TFLOPs']:.1f}", f"{b['MFU_fp32']:.3f}",
                     f"{b['MFU_bf16']:.3f}", f"{b['peak_GB']:.2f}", f"{b['ledger_GB']:.2f}"])


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("gemm", "attention", "train"):
        sys.exit(__doc__)
    {"gemm": gemm, "attention": attention, "train": train}[sys.argv[1]](sys.argv[2:])
