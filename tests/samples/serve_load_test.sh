#!/usr/bin/env bash
# dsp-serve under load (issue 32's load test), all on 127.0.0.1, every loop bounded:
#  1. references: 50 distinct prompts (cut from tiny Shakespeare), each served alone (concurrency
#     1, greedy) by bench_serving --write-outputs;
#  2. warm-up: 1,000 requests of the same mix as 3., checked; then the server's resident
#     memory (VmRSS);
#  3. 2,000 requests at concurrency 64 of which 10% malformed (not JSON, a wrong type, over
#     --max-model-len, an unknown model, an empty prompt) and 10% disconnecting after 1-3 chunks:
#     bench_serving exits 0 only when every valid request completed with its reference text,
#     every bad one got a 4xx with OpenAI's error JSON, and /metrics shows 0 KV blocks in use and
#     0 requests running at the end;
#  4. the server is still up, its resident memory within 5% of after the warm-up, and SIGTERM
#     ends it with exit code 0.
# Usage: serve_load_test.sh BIN_DIR BENCH_SERVING DATA_FILE
set -uo pipefail
bin=$1
bench=$2
data=$3
work=$(mktemp -d)
trap 'kill -9 $(jobs -p) 2>/dev/null; rm -rf "$work"' EXIT
source "$(dirname "$0")/lib.sh"

"$bin/dsp-train" --data-path "$data" --world-size 2 --tensor-model-parallel-size 2 --num-layers 2 --hidden-size 64 \
  --num-attention-heads 4 --num-query-groups 2 --ffn-hidden-size 192 --seq-length 128 --micro-batch-size 4 \
  --global-batch-size 8 --lr 1e-2 --train-iters 60 --eval-interval 1000 --log-interval 1000 --peak-flops 1e10 \
  --save "$work/ckpt" >"$work/train.out" 2>&1 || { echo "training failed: $(cat "$work/train.out")"; exit 1; }

"$bin/dsp-serve" --model "$work/ckpt" --served-model-name demo --tensor-parallel-size 1 --max-num-seqs 64 --port 0 \
  >"$work/serve.out" 2>"$work/serve.err" &
pid=$!
port=
for _ in $(seq 600); do
  port=$(grep -o 'listening on http://127.0.0.1:[0-9]*' "$work/serve.err" 2>/dev/null | sed 's/.*://')
  [ -n "$port" ] && [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/health")" = 200 ] && break
  kill -0 $pid 2>/dev/null || { echo "dsp-serve died: $(cat "$work/serve.err")"; exit 1; }
  sleep 0.1
done
rss() { awk '/^VmRSS:/ { print $2 }' /proc/$pid/status; }  # kB

common=(--port "$port" --model demo --dataset-name corpus --dataset-path "$data" --random-input-len 48
        --random-output-len 32 --random-range-ratio 0.5 --num-distinct-prompts 50 --seed 7 --request-timeout 120)
"$bench" "${common[@]}" --num-prompts 50 --max-concurrency 1 --write-outputs "$work/ref.json" >"$work/ref.out" 2>&1 \
  && ok || fail "references at concurrency 1: $(tail -20 "$work/ref.out")"
# The warm-up is the load's mix, long enough for the HTTP worker threads (more than 64: the
# pool holds --max-num-seqs + --max-queue) to have served requests and made their stacks and
# malloc arenas resident.
"$bench" "${common[@]}" --num-prompts 1000 --max-concurrency 64 --malformed-fraction 0.1 --disconnect-fraction 0.1 \
  --max-model-len 128 --expected-outputs "$work/ref.json" >"$work/warm.out" 2>&1 \
  && ok || fail "warm-up: $(tail -30 "$work/warm.out")"
rss_warm=$(rss)
"$bench" "${common[@]}" --num-prompts 2000 --max-concurrency 64 --malformed-fraction 0.1 --disconnect-fraction 0.1 \
  --max-model-len 128 --expected-outputs "$work/ref.json" --expect-metric dsp:kv_cache_used_blocks=0 \
  --expect-metric dsp:num_requests_running=0 >"$work/load.out" 2>&1 && ok || fail "load test: $(tail -40 "$work/load.out")"
grep -E "Successful requests|Failed requests|Malformed requests sent|answered 4xx|Disconnecting requests sent|Mismatches|Metric" "$work/load.out"
rss_end=$(rss)
echo "VmRSS after warm-up ${rss_warm} kB, after the load ${rss_end} kB"
[ -n "$rss_end" ] && [ "$rss_end" -le $((rss_warm * 105 / 100)) ] && ok \
  || fail "resident memory grew over 5%: ${rss_warm} kB -> ${rss_end:-none} kB"
[ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/health")" = 200 ] && ok || fail "the server is down after the load"
kill -TERM $pid
wait $pid && ok || fail "exit code after SIGTERM: $?"

echo "serve_load_test: $passed passed, $failed failed"
[ $failed -eq 0 ]
