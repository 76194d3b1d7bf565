#!/usr/bin/env bash
# peer_sweep.sh CKPT GGUF OUTDIR [bench_serving args...]
#
# dsp-serve against llama.cpp's llama-server on the same model, cores and requests (issue 32's
# peer comparison): at each max concurrency C of 1, 2, 4, ..., 64, bench_serving sends the same
# N = max(64, 8 C) streamed requests (same --seed: same prompts) to dsp-serve serving CKPT and to
# llama-server serving GGUF (the same model: dsp-reshard --merge, then tools/llama_server.sh
# convert) with C slots (-np C, continuous batching), one after the other, ROUNDS times
# alternating, each server alone on the machine while it is measured. One JSON per run:
# OUTDIR/{dsp-serve,llama-server}-r<round>-c<C>.json; then
#   python3 tools/plot_serving_sweep.py -o OUTDIR/sweep.png OUTDIR/*-r1-*.json
# The other arguments go to every bench_serving run (e.g. --dataset-name corpus --dataset-path
# data/tinyshakespeare.txt --random-input-len 32 --random-output-len 64 --ignore-eos
# --prompt-token-ids --seed 11).
#
# Environment: DSP_SERVE (default build/default/samples/dsp-serve), DSP_SERVE_ARGS (extra
# dsp-serve flags, e.g. "--tensor-parallel-size 1"), BENCH_SERVING, SWEEP_CONCURRENCIES
# ("1 2 4 8 16 32 64"), ROUNDS (2), LLAMA_ARGS (extra llama-server flags).
set -euo pipefail
if [ $# -lt 3 ]; then
  echo "usage: $0 CKPT GGUF OUTDIR [bench_serving args...]" >&2
  exit 2
fi
ckpt=$1 gguf=$2 outdir=$3
shift 3
root=$(cd "$(dirname "$0")/.." && pwd)
serve=${DSP_SERVE:-$root/build/default/samples/dsp-serve}
bench=${BENCH_SERVING:-$root/build/default/benchmarks/bench_serving}
concurrencies=${SWEEP_CONCURRENCIES:-1 2 4 8 16 32 64}
rounds=${ROUNDS:-2}
mkdir -p "$outdir"
pids=()
trap 'kill ${pids[*]} 2>/dev/null' EXIT

# wait_ready PORT PID: until GET /health answers 200 (at most 120 s)
wait_ready() {
  for _ in $(seq 1200); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$1/health")" = 200 ] && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 0.1
  done
  return 1
}

# dsp-serve runs the whole sweep (--max-num-seqs 64 admits every concurrency), stopped
# (SIGSTOP) while llama-server is measured so that it takes no CPU; llama-server is restarted per
# concurrency with that many slots.
# shellcheck disable=SC2086
"$serve" --model "$ckpt" --served-model-name demo --port 8101 --max-num-seqs 64 ${DSP_SERVE_ARGS:-} \
  2>"$outdir/dsp-serve.log" &
dsp=$!
pids+=($dsp)
wait_ready 8101 $dsp || { echo "dsp-serve did not start: $(cat "$outdir/dsp-serve.log")" >&2; exit 1; }
for r in $(seq "$rounds"); do
  for c in $concurrencies; do
    n=$((8 * c > 64 ? 8 * c : 64))
    kill -CONT $dsp
    echo "== round $r, concurrency $c, $n requests: dsp-serve =="
    "$bench" --port 8101 --model demo --label dsp-serve --max-concurrency "$c" --num-prompts "$n" \
      --result-filename "$outdir/dsp-serve-r$r-c$c.json" "$@" | grep -E "Output token throughput|Median TTFT|Median ITL|P99 ITL|Failed"
    kill -STOP $dsp
    echo "== round $r, concurrency $c, $n requests: llama-server -np $c =="
    # shellcheck disable=SC2086
    DSP_PEER_SLOTS=$c "$root/tools/llama_server.sh" serve "$gguf" 8102 ${LLAMA_ARGS:-} >"$outdir/llama-server-c$c.log" 2>&1 &
    llama=$!
    pids+=($llama)
    wait_ready 8102 $llama || { echo "llama-server did not start: $(tail "$outdir/llama-server-c$c.log")" >&2; exit 1; }
    "$bench" --port 8102 --model demo --label llama-server --max-concurrency "$c" --num-prompts "$n" \
      --result-filename "$outdir/llama-server-r$r-c$c.json" "$@" | grep -E "Output token throughput|Median TTFT|Median ITL|P99 ITL|Failed"
    kill $llama
    wait $llama 2>/dev/null || true
  done
done
kill -CONT $dsp
echo "sweep written to $outdir"
