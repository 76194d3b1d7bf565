#!/usr/bin/env bash
# End-to-end checks of the command-line programs, each in a new process:
#  - resume: a run stopped at step 3 and resumed gives exactly the uninterrupted losses;
#  - served at TP1/TP4 after dsp-reshard: consistent with the training layout (<= 1e-4);
#  - --profile-file: a Chrome trace with communication spans from every rank;
#  - --overlap-grad-reduce on/off: the same losses; --grad-reduce-dtype bf16 trains;
#  - bad input: a clear message, a non-zero exit and no partial output.
# Usage: cli_test.sh BIN_DIR DATA_FILE
set -uo pipefail
bin=$1
data=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
passed=0
failed=0
ok() { passed=$((passed + 1)); }
fail() { failed=$((failed + 1)); echo "FAILED: $*"; }

model=(--data-path "$data" --num-layers 2 --hidden-size 32 --num-attention-heads 4 --num-query-groups 2
       --ffn-hidden-size 64 --seq-length 64 --micro-batch-size 2 --global-batch-size 4 --lr 3e-3 --train-iters 6)

# expect_fail NAME EXPECTED_TEXT FORBIDDEN_PATH -- command...
expect_fail() {
  local name=$1 text=$2 forbidden=$3
  shift 4
  "$@" >"$work/out" 2>"$work/err"
  local rc=$?
  if [ "$rc" -eq 0 ]; then fail "$name: exit code 0"; return; fi
  if ! grep -qF -- "$text" "$work/err"; then fail "$name: stderr lacks '$text': $(cat "$work/err")"; return; fi
  if [ -n "$forbidden" ] && [ -e "$forbidden" ]; then fail "$name: partial output $forbidden"; return; fi
  ok
}

# step and loss of every line of a metrics file, as "step loss"
losses() { sed -E 's/.*"loss":([^,}]*).*"step":([0-9]+).*/\2 \1/' "$1"; }

# --- resume in a new process equals the uninterrupted run --------------------------------
"$bin/dsp-train" --world-size 2 --tensor-model-parallel-size 2 "${model[@]}" --metrics-file "$work/full.jsonl" \
  >/dev/null || fail "uninterrupted run"
"$bin/dsp-train" --world-size 2 --tensor-model-parallel-size 2 "${model[@]}" --metrics-file "$work/part.jsonl" \
  --exit-interval 3 --save "$work/ckpt" >/dev/null || fail "first half"
"$bin/dsp-train" --world-size 2 --tensor-model-parallel-size 2 "${model[@]}" --metrics-file "$work/part.jsonl" \
  --load "$work/ckpt" --save "$work/ckpt" >/dev/null || fail "resumed half"
if diff <(losses "$work/full.jsonl") <(losses "$work/part.jsonl") >/dev/null && [ "$(wc -l <"$work/part.jsonl")" -eq 6 ]; then
  ok
else
  fail "resumed losses differ: $(diff <(losses "$work/full.jsonl") <(losses "$work/part.jsonl"))"
fi

# --- reshard, generate, consistency ---------------------------------------------------------
for tp in 1 4; do
  "$bin/dsp-reshard" --load "$work/ckpt" --save "$work/ckpt_tp$tp" --tensor-model-parallel-size $tp >/dev/null \
    || fail "reshard to TP$tp"
  "$bin/dsp-generate" --load "$work/ckpt_tp$tp" --prompt "ROMEO:" --max-new-tokens 8 >"$work/gen$tp" \
    && grep -q "ROMEO:" "$work/gen$tp" && ok || fail "generate at TP$tp"
  "$bin/dsp-consistency-check" --load "$work/ckpt_tp$tp" --reference "$work/ckpt" --tensor-model-parallel-size $tp \
    >"$work/cc$tp" && grep -q '"consistent":true' "$work/cc$tp" && ok || fail "consistency at TP$tp: $(cat "$work/cc$tp")"
done
# without --reference the check finds the training checkpoint through the manifest
"$bin/dsp-consistency-check" --load "$work/ckpt_tp4" --tensor-model-parallel-size 4 >"$work/cc" \
  && grep -q "\"reference\":\"$work/ckpt\"" "$work/cc" && grep -q '"consistent":true' "$work/cc" && ok \
  || fail "consistency against the recorded source: $(cat "$work/cc")"
diff <(tail -n +2 "$work/gen1") <(tail -n +2 "$work/gen4") >/dev/null && ok || fail "TP1 and TP4 greedy generations differ"
"$bin/dsp-reshard" --load "$work/ckpt" --save "$work/hf" --merge >/dev/null && [ -f "$work/hf/model.safetensors" ] \
  && [ -f "$work/hf/config.json" ] && ok || fail "merge"

# --- timeline: TP2 x DP2, steps 2 and 3 -----------------------------------------------------
"$bin/dsp-train" --world-size 4 --tensor-model-parallel-size 2 "${model[@]}" --profile-file "$work/trace.json" \
  >/dev/null || fail "profiled run"
if grep -q '"traceEvents"' "$work/trace.json" && grep -q '"name":"forward"' "$work/trace.json"; then
  grep -o '"cat":"comm"[^}]*}' "$work/trace.json" >"$work/comm_spans"  # keys sorted: args, cat, dur, name, ph, pid, ...
  for r in 0 1 2 3; do
    grep -q "\"pid\":$r," "$work/comm_spans" && ok || fail "trace: no comm span of rank $r"
  done
else
  fail "trace: no traceEvents or forward spans in $work/trace.json"
fi

# --- data-parallel buckets: overlap on == off (bitwise losses); bf16 transport trains ------
"$bin/dsp-train" --world-size 2 "${model[@]}" --ddp-bucket-size 4096 --metrics-file "$work/dp_off.jsonl" >/dev/null \
  || fail "DP2 run, overlap off"
"$bin/dsp-train" --world-size 2 "${model[@]}" --ddp-bucket-size 4096 --overlap-grad-reduce \
  --metrics-file "$work/dp_on.jsonl" >/dev/null || fail "DP2 run, overlap on"
diff <(losses "$work/dp_off.jsonl") <(losses "$work/dp_on.jsonl") >/dev/null && [ "$(wc -l <"$work/dp_on.jsonl")" -eq 6 ] \
  && ok || fail "--overlap-grad-reduce changed the losses: $(diff <(losses "$work/dp_off.jsonl") <(losses "$work/dp_on.jsonl"))"
"$bin/dsp-train" --world-size 2 "${model[@]}" --overlap-grad-reduce --grad-reduce-dtype bf16 \
  --metrics-file "$work/dp_bf16.jsonl" >/dev/null && [ "$(wc -l <"$work/dp_bf16.jsonl")" -eq 6 ] && ok \
  || fail "DP2 run with --grad-reduce-dtype bf16"

# --- bad input: clear message, non-zero exit, no partial output -----------------------------
expect_fail "unknown gradient dtype" "--grad-reduce-dtype" "$work/m9" -- \
  "$bin/dsp-train" "${model[@]}" --grad-reduce-dtype fp16 --metrics-file "$work/m9"
expect_fail "zero bucket size" "--ddp-bucket-size must be >= 1 byte, got 0" "$work/m10" -- \
  "$bin/dsp-train" --world-size 2 "${model[@]}" --ddp-bucket-size 0 --metrics-file "$work/m10"
expect_fail "layout does not divide" "world size 3 is not divisible by tensor-model-parallel-size" "$work/m1" -- \
  "$bin/dsp-train" --world-size 3 --tensor-model-parallel-size 2 "${model[@]}" --metrics-file "$work/m1" --save "$work/s1"
expect_fail "heads not divisible by TP" "number of attention heads (4) is not divisible by 8" "$work/m2" -- \
  "$bin/dsp-train" --world-size 8 --tensor-model-parallel-size 8 "${model[@]}" --hidden-size 64 --metrics-file "$work/m2"
expect_fail "hidden not divisible by heads" "hidden size (30) is not divisible by 4" "$work/m3" -- \
  "$bin/dsp-train" "${model[@]}" --hidden-size 30 --metrics-file "$work/m3"
expect_fail "kv heads vs TP" "number of query groups (3) and tensor-model-parallel-size (2) must divide one another" "$work/m4" -- \
  "$bin/dsp-train" --world-size 2 --tensor-model-parallel-size 2 "${model[@]}" --num-attention-heads 6 \
  --hidden-size 48 --num-query-groups 3 --metrics-file "$work/m4"
expect_fail "ffn not divisible by TP" "ffn hidden size (66) is not divisible by 4" "$work/m5" -- \
  "$bin/dsp-train" --world-size 4 --tensor-model-parallel-size 4 "${model[@]}" --ffn-hidden-size 66 --metrics-file "$work/m5"
expect_fail "unwritable trace file" "cannot write trace file '$work/nodir/t.json'" "$work/m8" -- \
  "$bin/dsp-train" "${model[@]}" --profile-file "$work/nodir/t.json" --metrics-file "$work/m8"
expect_fail "missing data file" "data file '$work/nope.txt' cannot be opened" "$work/m6" -- \
  "$bin/dsp-train" "${model[@]}" --data-path "$work/nope.txt" --metrics-file "$work/m6"
expect_fail "prompt longer than the sequence" "exceeds --seq-length 64" "" -- \
  "$bin/dsp-generate" --load "$work/ckpt" --prompt "$(printf 'x%.0s' {1..70})" --max-new-tokens 1
expect_fail "reshard to a TP that does not divide" "cannot reshard" "$work/bad_tp" -- \
  "$bin/dsp-reshard" --load "$work/ckpt" --save "$work/bad_tp" --tensor-model-parallel-size 3
expect_fail "another model config" "another model config" "" -- \
  "$bin/dsp-train" --world-size 2 --tensor-model-parallel-size 2 "${model[@]}" --hidden-size 64 --load "$work/ckpt" \
  --train-iters 8

mkdir -p "$work/notes" && echo keep >"$work/notes/keep.txt"
expect_fail "--save onto a directory of other files (refused before training)" "refusing to replace" "$work/m7" -- \
  "$bin/dsp-train" "${model[@]}" --save "$work/notes" --metrics-file "$work/m7"
[ -f "$work/notes/keep.txt" ] && ok || fail "--save destroyed a foreign directory"
expect_fail "reshard onto itself" "onto itself" "" -- \
  "$bin/dsp-reshard" --load "$work/ckpt" --save "$work/ckpt" --tensor-model-parallel-size 1
expect_fail "--load of a path that does not exist" "does not exist" "" -- \
  "$bin/dsp-generate" --load "$work/nowhere" --prompt "A"

cp -r "$work/ckpt" "$work/trunc"
f=$(ls "$work/trunc"/*.safetensors | head -n 1)
truncate -s -100 "$f"
expect_fail "truncated shard" "$(basename "$f")" "" -- "$bin/dsp-generate" --load "$work/trunc" --prompt "A" --max-new-tokens 1
cp -r "$work/ckpt" "$work/corrupt"
f=$(ls "$work/corrupt"/*.safetensors | tail -n 1)
printf '\x7f' | dd of="$f" bs=1 seek=200 conv=notrunc status=none
expect_fail "corrupted shard" "$(basename "$f")" "" -- "$bin/dsp-generate" --load "$work/corrupt" --prompt "A" --max-new-tokens 1
mkdir -p "$work/empty"
expect_fail "missing manifest" "manifest.json" "" -- "$bin/dsp-generate" --load "$work/empty" --prompt "A"

echo "cli: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
