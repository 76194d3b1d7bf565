#!/usr/bin/env python3
"""Draws output tokens/s against max concurrency from bench_serving result JSON (one file per
point, e.g. from benchmarks/serving_sweep.sh), one line per label (dsp-serve, llama-server, ...),
on a log2 x-axis, and marks each line's knee. Prints the table it drew to stdout.

The knee: the smallest measured concurrency C from which on every doubling of the concurrency
adds less than --threshold (default 10%) output throughput. Throughput here is the envelope
B(C) = the best output tokens/s measured at any concurrency <= C, so that a dip (noise on a
shared machine, or a server slower past its best point) is not taken for a gain still to come
when the curve recovers; for a rising curve B = T. Between two measured points C1 < C2 the gain
per doubling is (B(C2) / B(C1)) ** (1 / log2(C2 / C1)) - 1 (for a sweep of doublings, simply
B(2C) / B(C) - 1). No knee when the last step still gains --threshold or more (the server
still scales at the largest concurrency measured).

usage: plot_serving_sweep.py [-o sweep.png] [--threshold 0.10] [--title T] RESULT.json|DIR ...
(matplotlib: pip install matplotlib)
"""
import argparse
import json
import math
import pathlib
import sys


def load(paths):
    """{label: [point, ...]} sorted by concurrency; a point: the fields the plot and table use."""
    files = []
    for p in map(pathlib.Path, paths):
        files += sorted(p.glob("*.json")) if p.is_dir() else [p]
    lines = {}
    for f in files:
        with open(f) as fh:
            j = json.load(fh)
        if "output_throughput" not in j:
            print(f"skipping {f}: not a bench_serving result", file=sys.stderr)
            continue
        c = j.get("max_concurrency") or j.get("max_concurrent_requests")
        if not c:
            print(f"skipping {f}: no max_concurrency", file=sys.stderr)
            continue
        label = j.get("label") or f.stem
        lines.setdefault(label, []).append({
            "concurrency": int(c), "throughput": float(j["output_throughput"]),
            "completed": j.get("completed", 0), "failed": j.get("failed", 0),
            "median_ttft_ms": j.get("median_ttft_ms", 0.0), "median_tpot_ms": j.get("median_tpot_ms", 0.0),
            "file": str(f)})
    for label, points in lines.items():
        points.sort(key=lambda p: p["concurrency"])
        seen = set()
        for p in points:
            if p["concurrency"] in seen:
                sys.exit(f"error: label {label!r} has two results at concurrency {p['concurrency']}")
            seen.add(p["concurrency"])
    return lines


def gains(points):
    """Gain per doubling of the envelope (best throughput so far) from each point to the next
    (None for the last)."""
    best, envelope = 0.0, []
    for p in points:
        best = max(best, p["throughput"])
        envelope.append(best)
    out = []
    for a, b, ta, tb in zip(points, points[1:], envelope, envelope[1:]):
        doublings = math.log2(b["concurrency"] / a["concurrency"])
        out.append((tb / ta) ** (1 / doublings) - 1 if ta > 0 else math.inf)
    return out + [None]


def knee(points, threshold):
    """The knee point (see the module's doc) or None."""
    g = gains(points)[:-1]
    if not g or g[-1] >= threshold:
        return None
    i = len(g) - 1
    while i > 0 and g[i - 1] < threshold:
        i -= 1
    return points[i]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="+", help="bench_serving result JSON files or folders of them")
    ap.add_argument("-o", "--output", default="serving_sweep.png", help="the PNG to write")
    ap.add_argument("--threshold", type=float, default=0.10, help="gain per doubling below which throughput has levelled off")
    ap.add_argument("--title", default="Output token throughput against concurrency")
    args = ap.parse_args()
    lines = load(args.inputs)
    if not lines:
        sys.exit("error: no bench_serving results among the inputs")

    print(f"knee: the smallest concurrency from which each doubling adds < {args.threshold:.0%} output tokens/s")
    print("| label | max concurrency | completed | failed | output tok/s | envelope gain to next point, per doubling | median TTFT (ms) | median TPOT (ms) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    knees = {}
    for label, points in lines.items():
        knees[label] = knee(points, args.threshold)
        for p, g in zip(points, gains(points)):
            mark = " (knee)" if knees[label] is p else ""
            gain = "" if g is None else f"{g:+.1%}"
            print(f"| {label} | {p['concurrency']}{mark} | {p['completed']} | {p['failed']} | {p['throughput']:.1f} | {gain} "
                  f"| {p['median_ttft_ms']:.1f} | {p['median_tpot_ms']:.2f} |")
    for label, k in knees.items():
        print(f"{label}: " + (f"knee at concurrency {k['concurrency']} ({k['throughput']:.1f} tok/s)" if k
                              else "no knee: throughput still rises at the largest concurrency measured"))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ticks = sorted({p["concurrency"] for points in lines.values() for p in points})
    for label, points in lines.items():
        xs = [p["concurrency"] for p in points]
        ys = [p["throughput"] for p in points]
        (line,) = ax.plot(xs, ys, marker="o", label=label)
        for p in points:
            if p["failed"]:
                ax.annotate(f"{p['failed']} failed", (p["concurrency"], p["throughput"]), textcoords="offset points",
                            xytext=(0, -14), ha="center", fontsize=7, color="red")
        k = knees[label]
        if k:
            ax.plot([k["concurrency"]], [k["throughput"]], marker="o", markersize=14, markerfacecolor="none",
                    markeredgewidth=2, color=line.get_color())
            ax.annotate(f"knee: {k['concurrency']}\n{k['throughput']:.0f} tok/s", (k["concurrency"], k["throughput"]),
                        textcoords="offset points", xytext=(-10, 12), ha="right", fontsize=8, color=line.get_color())
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(t) for t in ticks])
    ax.set_xlabel("max concurrency (requests in flight)")
    ax.set_ylabel("output tokens/s")
    top = max(p["throughput"] for points in lines.values() for p in points)
    ax.set_ylim(0, top * 1.2 if top > 0 else 1)  # room for the knee's label above the curve
    ax.set_title(args.title)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend()
    ax.text(0.99, 0.01, f"knee: smallest concurrency from which each doubling adds < {args.threshold:.0%}",
            transform=ax.transAxes, ha="right", va="bottom", fontsize=7, color="gray")
    fig.tight_layout()
    fig.savefig(args.output, dpi=120)
    print(f"plot written to {args.output}")


if __name__ == "__main__":
    main()
