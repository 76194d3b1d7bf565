#!/usr/bin/env bash
# serving_sweep.sh BASE_URL LABEL OUTDIR [bench_serving args...]
#
# Runs bench_serving against the server at BASE_URL (http://127.0.0.1:PORT) at max concurrency
# 1, 2, 4, 8, 16, 32, 64, with N = max(16, 4 x C) requests at each point (all sent at once,
# at most C in flight), and saves one result JSON per point: OUTDIR/LABEL-c<C>.json. The other
# arguments go to every run (--model, --random-input-len, --random-output-len, --ignore-eos,
# --seed, ...; not --num-prompts or --max-concurrency, which the sweep sets). Then
#   python3 tools/plot_serving_sweep.py -o sweep.png OUTDIR/*.json
# draws output tokens/s against concurrency and marks the knee.
#
# Environment: BENCH_SERVING (default build/default/benchmarks/bench_serving),
# SWEEP_CONCURRENCIES (default "1 2 4 8 16 32 64"), SWEEP_MIN_PROMPTS (16),
# SWEEP_PROMPTS_PER_CONCURRENCY (4).
# Every point runs even when one fails (its JSON says how); the exit status is 1 when any did.
set -euo pipefail

if [ $# -lt 3 ]; then
  echo "usage: $0 BASE_URL LABEL OUTDIR [bench_serving args...]" >&2
  exit 2
fi
base_url=$1 label=$2 outdir=$3
shift 3
for a in "$@"; do
  case $a in
    --num-prompts|--num-prompts=*|--max-concurrency|--max-concurrency=*|--result-filename|--result-filename=*|--label|--label=*)
      echo "$0: $a is set by the sweep; leave it out" >&2
      exit 2 ;;
  esac
done
bench=${BENCH_SERVING:-$(cd "$(dirname "$0")/.." && pwd)/build/default/benchmarks/bench_serving}
[ -x "$bench" ] || { echo "$0: $bench is not built (cmake --build --preset default --target bench_serving)" >&2; exit 2; }
concurrencies=${SWEEP_CONCURRENCIES:-1 2 4 8 16 32 64}
min_prompts=${SWEEP_MIN_PROMPTS:-16}
per_c=${SWEEP_PROMPTS_PER_CONCURRENCY:-4}
mkdir -p "$outdir"

failed=()
for c in $concurrencies; do
  n=$(( per_c * c > min_prompts ? per_c * c : min_prompts ))
  echo "== $label: max concurrency $c, $n requests =="
  if ! "$bench" --base-url "$base_url" --label "$label" --max-concurrency "$c" --num-prompts "$n" \
       --result-filename "$outdir/$label-c$c.json" "$@"; then
    failed+=("$c")
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "$0: the points at concurrency ${failed[*]} failed (see their JSON: errors)" >&2
  exit 1
fi
echo "sweep written to $outdir ($label-c*.json)"
