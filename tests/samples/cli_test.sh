#!/usr/bin/env bash
# End-to-end checks of the command-line programs, each in a new process:
#  - resume: a run stopped at step 3 and resumed gives exactly the uninterrupted losses;
#  - served at TP1/TP4 after dsp-reshard: consistent with the training layout (<= 1e-4); training
#    resumes from the TP4 and TP1 reshards (at TP4, and at TP1 x DP2 ZeRO 3) with exactly the
#    losses of resuming from their source; a serving
#    checkpoint (--no-save-optim) has no optimizer files and generates the same text, and serving
#    needs no optimizer file (truncated ones are not read); training refuses to resume from either;
#  - --profile-file: a Chrome trace with communication spans from every rank;
#  - --overlap-grad-reduce on/off: the same losses; --grad-reduce-dtype bf16 trains;
#  - ZeRO: --zero-stage 1, 2 and 3 give exactly the --zero-stage 0 losses at DP4 and (stage 3)
#    at TP2 x DP2; a checkpoint saved at stage 3 on DP4 resumes at stage 0 on DP2 (1e-5 relative:
#    the DP sum's order changes); --zero-stage 4 is refused;
#  - loss scaling: fp16 gradient transport with --initial-loss-scale 2^40 skips the overflowing
#    steps (reported) and still trains its 6 steps; a loss-scale flag alone is refused;
#  - mixed precision: --bf16 at ZeRO 3 gives its ZeRO 0 losses exactly (DP4), a --bf16 run
#    stopped at step 3 resumes exactly and its checkpoint generates; --fp16 scales the loss
#    (loss_scale in the metrics); --bf16 with --fp16, or another --grad-reduce-dtype, is refused;
#  - pipeline parallelism (4 layers): PP2, TP2 x PP2, interleaved and GPipe give the world-1
#    losses (1e-5 relative); --print-pipeline-schedule prints a rank table; bubble_fraction > 0;
#    a PP2 run stopped at step 3 resumes at PP2 (exactly), PP4 and PP1 (1e-5); a TP2 x PP2
#    checkpoint resharded, merged in layer order, generated from, and consistent at TP4/PP1 and
#    TP1/PP1 with its training layout (the reference runs at TP2 x PP2);
#  - MoE (8 experts, top-2, a shared expert, the first layer dense, sigmoid router with the
#    expert bias, aux loss): EP2, EP2 x DP2 (world 4) and TP2 x EP2 give the world-1 losses
#    (1e-5 relative); the metrics carry per-layer routing and the run ends with its table; an
#    EP2 checkpoint resumes at EP1 and is served at TP1 consistent with its training layout;
#  - bad input: a clear message, a non-zero exit and no partial output; a checkpoint already at
#    --train-iters says so and trains nothing.
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

# dsp-generate's output without its timing lines ('--- N tokens (...) in S s: ...')
text_of() { grep -av '^--- ' "$1"; }

# step and loss of every line of a metrics file, as "step loss"
losses() { sed -E 's/.*"loss":([^,}]*).*"step":([0-9]+).*/\2 \1/' "$1"; }

# same_losses NAME EXPECTED.jsonl ACTUAL.jsonl: the same 6 steps, losses within 1e-5 relative
same_losses() {
  local name=$1 want=$2 got=$3 worst
  if [ "$(losses "$want" | wc -l)" -ne 6 ] || [ "$(losses "$got" 2>/dev/null | wc -l)" -ne 6 ]; then
    fail "$name: expected 6 losses in $want and $got"; return
  fi
  worst=$(paste -d' ' <(losses "$want") <(losses "$got") | awk '
    $1 != $3 { print "step mismatch"; exit }
    { d = $2 - $4; if (d < 0) d = -d; m = $2 < 0 ? -$2 : $2; r = d / m; if (r > worst) worst = r }
    END { if (worst == "") worst = 0; print worst }')
  awk -v w="$worst" 'BEGIN { exit !(w != "step mismatch" && w <= 1e-5) }' && ok \
    || fail "$name: losses differ from $(basename "$want") (max relative difference $worst)"
}

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

# --- the serving engine through dsp-generate ------------------------------------------------
# Prompts of 1-40 bytes served together: the same text whatever the batching, chunking, prefix
# caching and KV budget (preemptions); the text printed byte for byte (the generated bytes as they
# are: '=== ... ===' line, prompt + N bytes, '--- N tokens' line); the KV blocks dsp-plan predicts.
printf 'ROMEO:\nROMEO: What\nJULIET:\\nO Romeo, Romeo!\nR\nROMEO: Wh\n' >"$work/prompts"
"$bin/dsp-generate" --load "$work/ckpt" --prompts-file "$work/prompts" --max-new-tokens 20 --temperature 0.9 --seed 5 \
  >"$work/serve_default" 2>/dev/null || fail "dsp-generate --prompts-file"
for variant in "--max-num-seqs 2" "--max-num-batched-tokens 3" "--enable-prefix-caching --block-size 4 --max-num-seqs 1" \
  "--kv-cache-memory 10000 --block-size 4" "--max-num-seqs 1 --max-num-batched-tokens 2048"; do
  # shellcheck disable=SC2086
  "$bin/dsp-generate" --load "$work/ckpt" --prompts-file "$work/prompts" --max-new-tokens 20 --temperature 0.9 --seed 5 \
    $variant >"$work/serve_variant" 2>"$work/serve_err" && diff <(text_of "$work/serve_default") \
    <(text_of "$work/serve_variant") >/dev/null && ok || fail "dsp-generate $variant changed the text"
  case $variant in
    *kv-cache-memory*) grep -Eq ' [1-9][0-9]* preemptions' "$work/serve_err" && ok || fail "no preemption: $(cat "$work/serve_err")" ;;
    *prefix-caching*) grep -Eq 'hits [1-9][0-9]* of' "$work/serve_err" && ok || fail "no prefix cache hit: $(cat "$work/serve_err")" ;;
  esac
done
# Bytes printed = the header and stats lines + every prompt + 20 generated bytes each (NULs and
# newlines included): nothing generated is cut or added.
expected=0
while IFS= read -r line; do expected=$((expected + ${#line} + 1)); done \
  < <(grep -a -e '^=== prompt ' -e '^--- ' "$work/serve_default")
n=$(wc -l <"$work/prompts")
plen=$(sed 's/\\n/X/g' "$work/prompts" | awk '{ s += length($0) } END { print s }')
expected=$((expected + plen + 21 * n))  # 20 generated bytes and the newline before each '--- ' line
[ "$(wc -c <"$work/serve_default")" -eq "$expected" ] && [ "$(grep -c '^--- 20 tokens (length)' "$work/serve_default")" -eq "$n" ] \
  && ok || fail "dsp-generate does not print the generated bytes as they are ($(wc -c <"$work/serve_default") bytes, expected $expected)"
blocks=$("$bin/dsp-generate" --load "$work/ckpt" --prompt A --max-new-tokens 1 --kv-cache-memory 1048576 --kv-cache-dtype bf16 \
  2>&1 >/dev/null | sed -n 's/.*KV cache: \([0-9]*\) blocks.*/\1/p')
"$bin/dsp-plan" --num-layers 2 --hidden-size 32 --num-attention-heads 4 --num-query-groups 2 --ffn-hidden-size 64 \
  --seq-length 64 --tensor-model-parallel-size 2 --serving-kv-cache-memory 1048576 --serving-dtype bf16 >"$work/plan_kv" 2>&1 \
  && grep -qF "holds $blocks blocks" "$work/plan_kv" && [ -n "$blocks" ] && ok \
  || fail "dsp-plan's KV blocks differ from dsp-generate's $blocks: $(cat "$work/plan_kv")"

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
  && grep -q "\"reference\":\"$work/ckpt/iter_0000006\"" "$work/cc" && grep -q '"consistent":true' "$work/cc" && ok \
  || fail "consistency against the recorded source: $(cat "$work/cc")"
diff <(text_of "$work/gen1" | tail -n +2) <(text_of "$work/gen4" | tail -n +2) >/dev/null && ok || fail "TP1 and TP4 greedy generations differ"
"$bin/dsp-reshard" --load "$work/ckpt" --save "$work/hf" --merge >/dev/null && [ -f "$work/hf/model.safetensors" ] \
  && [ -f "$work/hf/config.json" ] && ok || fail "merge"
# training resumes from the TP4 and TP1 reshards (moments as whole shards in their partition files)
# exactly as from their source: at TP4, and at TP1 x DP2 with ZeRO 3 (each rank reads its slice)
for layout in "4 4 0 ckpt_tp4" "2 1 3 ckpt_tp1"; do
  read -r world tp stage resharded <<<"$layout"
  for src in ckpt "$resharded"; do
    "$bin/dsp-train" --world-size "$world" --tensor-model-parallel-size "$tp" --zero-stage "$stage" "${model[@]}" \
      --train-iters 8 --load "$work/$src" --metrics-file "$work/resume_$src.jsonl" >/dev/null 2>&1 \
      || fail "resume at TP$tp, ZeRO $stage from $src"
  done
  [ -s "$work/resume_ckpt.jsonl" ] && diff <(losses "$work/resume_ckpt.jsonl") <(losses "$work/resume_$resharded.jsonl") \
    >/dev/null && ok || fail "resuming from $resharded differs from resuming from its source (TP$tp, ZeRO $stage)"
  rm -f "$work/resume_ckpt.jsonl"
done
# a serving checkpoint (--no-save-optim): no optimizer files, the same model files and generations as
# the TP4 reshard; serving a checkpoint whose optimizer files are broken reads only the model files
"$bin/dsp-reshard" --load "$work/ckpt" --save "$work/serve_tp4" --tensor-model-parallel-size 4 --no-save-optim \
  >/dev/null && ls "$work/ckpt_tp4"/optim_* >/dev/null 2>&1 && ! ls "$work/serve_tp4"/optim_* >/dev/null 2>&1 \
  && cmp -s "$work/ckpt_tp4/model_tp03_pp000.safetensors" "$work/serve_tp4/model_tp03_pp000.safetensors" && ok \
  || fail "reshard --no-save-optim: optimizer files or model files not as expected: $(ls "$work/serve_tp4")"
"$bin/dsp-generate" --load "$work/serve_tp4" --prompt "ROMEO:" --max-new-tokens 8 >"$work/gen_serve" \
  && diff <(text_of "$work/gen4") <(text_of "$work/gen_serve") >/dev/null && ok \
  || fail "generation from the serving checkpoint differs from TP4's"
cp -r "$work/ckpt" "$work/ckpt_broken_optim"
for f in "$work/ckpt_broken_optim"/iter_0000006/optim_*; do truncate -s 100 "$f"; done
"$bin/dsp-generate" --load "$work/ckpt_broken_optim" --tensor-model-parallel-size 4 --prompt "ROMEO:" --max-new-tokens 8 \
  >"$work/gen_broken" && diff <(text_of "$work/gen4") <(text_of "$work/gen_broken") >/dev/null && ok \
  || fail "generation with truncated optimizer files: $(cat "$work/gen_broken")"

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

# --- ZeRO: stages 1-3 give stage 0's losses exactly; stage 3 / DP4 resumes at stage 0 / DP2 --
# exact_losses NAME EXPECTED.jsonl ACTUAL.jsonl: the same 6 steps and losses, digit for digit
exact_losses() {
  local name=$1 want=$2 got=$3
  if [ "$(losses "$want" | wc -l)" -eq 6 ] && diff <(losses "$want") <(losses "$got" 2>/dev/null) >/dev/null; then ok
  else fail "$name: losses differ from $(basename "$want"): $(diff <(losses "$want") <(losses "$got" 2>/dev/null))"; fi
}
zero=("${model[@]}" --micro-batch-size 1 --peak-flops 1e10)  # DP4: 4 sequences = 1 x DP4
"$bin/dsp-train" --world-size 4 "${zero[@]}" --metrics-file "$work/zero0.jsonl" >/dev/null || fail "DP4 run, ZeRO 0"
for stage in 1 2 3; do
  "$bin/dsp-train" --world-size 4 "${zero[@]}" --zero-stage $stage --metrics-file "$work/zero$stage.jsonl" \
    >"$work/zero$stage.out" || fail "DP4 run, ZeRO $stage: $(cat "$work/zero$stage.out")"
  exact_losses "ZeRO $stage at DP4" "$work/zero0.jsonl" "$work/zero$stage.jsonl"
done
grep -q "TP1/PP1/DP4, .*ZeRO stage 3," "$work/zero3.out" && ok || fail "ZeRO 3 run did not report its stage: $(cat "$work/zero3.out")"
"$bin/dsp-train" --world-size 4 --tensor-model-parallel-size 2 "${model[@]}" --peak-flops 1e10 \
  --metrics-file "$work/tp2dp2_zero0.jsonl" >/dev/null || fail "TP2 x DP2 run, ZeRO 0"
"$bin/dsp-train" --world-size 4 --tensor-model-parallel-size 2 "${model[@]}" --peak-flops 1e10 --zero-stage 3 \
  --metrics-file "$work/tp2dp2_zero3.jsonl" >/dev/null || fail "TP2 x DP2 run, ZeRO 3"
exact_losses "ZeRO 3 at TP2 x DP2" "$work/tp2dp2_zero0.jsonl" "$work/tp2dp2_zero3.jsonl"
"$bin/dsp-train" --world-size 4 "${zero[@]}" --zero-stage 3 --exit-interval 3 --save "$work/ckpt_zero3" \
  --metrics-file "$work/zero_resumed.jsonl" >/dev/null || fail "ZeRO 3 / DP4 first half"
"$bin/dsp-train" --world-size 2 "${zero[@]}" --zero-stage 0 --load "$work/ckpt_zero3" \
  --metrics-file "$work/zero_resumed.jsonl" >"$work/out" 2>&1 || fail "ZeRO 3 / DP4 checkpoint resumed at ZeRO 0 / DP2: $(cat "$work/out")"
same_losses "ZeRO 3 / DP4 checkpoint resumed at ZeRO 0 / DP2" "$work/zero0.jsonl" "$work/zero_resumed.jsonl"
expect_fail "ZeRO stage 4" "--zero-stage must be 0, 1, 2 or 3, got 4" "$work/m22" -- \
  "$bin/dsp-train" --world-size 2 "${model[@]}" --zero-stage 4 --metrics-file "$work/m22"

# --- dynamic loss scaling: fp16 gradient transport overflows at 2^40, steps are skipped -----
"$bin/dsp-train" --world-size 2 "${model[@]}" --grad-reduce-dtype fp16 --initial-loss-scale 1099511627776 \
  --max-loss-scale 1099511627776 --hysteresis 1 --metrics-file "$work/fp16.jsonl" >"$work/fp16.out" 2>&1 \
  || fail "fp16 transport with loss scaling: $(cat "$work/fp16.out")"
skipped=$(grep -c '"skipped":true' "$work/fp16.jsonl")
stepped=$(grep -c '"skipped":false' "$work/fp16.jsonl")
[ "$skipped" -ge 5 ] && [ "$stepped" -eq 6 ] && ok || fail "fp16 loss scaling: $skipped skipped, $stepped stepped (want >= 5 and 6)"
grep -q "skipped: overflow at loss scale" "$work/fp16.out" && ok || fail "skipped steps not reported: $(cat "$work/fp16.out")"
expect_fail "loss-scale flag without --initial-loss-scale" "--hysteresis needs --initial-loss-scale" "$work/m23" -- \
  "$bin/dsp-train" "${model[@]}" --hysteresis 3 --metrics-file "$work/m23"

# --- mixed precision: --bf16 / --fp16 ----------------------------------------------------------
"$bin/dsp-train" --world-size 4 "${zero[@]}" --bf16 --metrics-file "$work/bf16_0.jsonl" >"$work/bf16.out" \
  || fail "DP4 --bf16 run: $(cat "$work/bf16.out")"
grep -q "bf16 precision, ZeRO stage 0" "$work/bf16.out" && ok || fail "--bf16 run did not report it: $(cat "$work/bf16.out")"
"$bin/dsp-train" --world-size 4 "${zero[@]}" --bf16 --zero-stage 3 --metrics-file "$work/bf16_3.jsonl" >/dev/null \
  || fail "DP4 --bf16 --zero-stage 3 run"
exact_losses "--bf16 ZeRO 3 at DP4" "$work/bf16_0.jsonl" "$work/bf16_3.jsonl"
"$bin/dsp-train" --world-size 4 "${zero[@]}" --bf16 --exit-interval 3 --save "$work/ckpt_bf16" \
  --metrics-file "$work/bf16_resumed.jsonl" >/dev/null || fail "--bf16 first half"
"$bin/dsp-train" --world-size 4 "${zero[@]}" --bf16 --load "$work/ckpt_bf16" --metrics-file "$work/bf16_resumed.jsonl" \
  >"$work/out" 2>&1 || fail "--bf16 resumed: $(cat "$work/out")"
exact_losses "--bf16 stopped at step 3 and resumed" "$work/bf16_0.jsonl" "$work/bf16_resumed.jsonl"
"$bin/dsp-generate" --load "$work/ckpt_bf16" --prompt "ROMEO:" --max-new-tokens 8 >"$work/gen_bf16" 2>&1 \
  && [ -s "$work/gen_bf16" ] && ok || fail "generate from a --bf16 checkpoint: $(cat "$work/gen_bf16")"
"$bin/dsp-train" --world-size 2 "${model[@]}" --fp16 --metrics-file "$work/fp16_mixed.jsonl" >"$work/out" 2>&1 \
  && [ "$(grep -c '"loss_scale":65536' "$work/fp16_mixed.jsonl")" -ge 1 ] && [ "$(grep -c '"skipped":false' "$work/fp16_mixed.jsonl")" -eq 6 ] \
  && ok || fail "--fp16 run with default loss scaling: $(cat "$work/out")"
expect_fail "--bf16 with --fp16" "--bf16 excludes --fp16" "$work/m24" -- \
  "$bin/dsp-train" "${model[@]}" --bf16 --fp16 --metrics-file "$work/m24"
expect_fail "--bf16 with fp16 gradients" "--bf16 keeps gradients in bf16: --grad-reduce-dtype must be bf16, got fp16" "$work/m25" -- \
  "$bin/dsp-train" "${model[@]}" --bf16 --grad-reduce-dtype fp16 --metrics-file "$work/m25"
expect_fail "--fp16 with fp32 gradients" "--fp16 keeps gradients in fp16: --grad-reduce-dtype must be fp16, got fp32" "$work/m26" -- \
  "$bin/dsp-train" "${model[@]}" --fp16 --grad-reduce-dtype fp32 --metrics-file "$work/m26"

# --- pipeline parallelism: the same losses at any TP x PP and schedule ----------------------
pp=("${model[@]}" --num-layers 4 --peak-flops 1e10)
"$bin/dsp-train" "${pp[@]}" --metrics-file "$work/pp_ref.jsonl" >/dev/null || fail "world-1 run, 4 layers"
"$bin/dsp-train" --world-size 2 --pipeline-model-parallel-size 2 "${pp[@]}" --print-pipeline-schedule \
  --metrics-file "$work/pp2.jsonl" >"$work/pp2.out" || fail "PP2 run: $(cat "$work/pp2.out")"
same_losses "PP2" "$work/pp_ref.jsonl" "$work/pp2.jsonl"
"$bin/dsp-train" --world-size 4 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "${pp[@]}" \
  --metrics-file "$work/tp2pp2.jsonl" --save "$work/ckpt_pp" >"$work/tp2pp2.out" || fail "TP2 x PP2 run"
grep -q "TP2/PP2/DP1" "$work/tp2pp2.out" && ok || fail "TP2 x PP2 run did not report its layout: $(cat "$work/tp2pp2.out")"
same_losses "TP2 x PP2" "$work/pp_ref.jsonl" "$work/tp2pp2.jsonl"
"$bin/dsp-train" --world-size 2 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 "${pp[@]}" \
  --metrics-file "$work/pp_il.jsonl" --save "$work/ckpt_il" >/dev/null || fail "interleaved PP2 run"
same_losses "interleaved (PP2, 1 layer per virtual stage)" "$work/pp_ref.jsonl" "$work/pp_il.jsonl"
"$bin/dsp-train" --world-size 2 --pipeline-model-parallel-size 2 --pipeline-schedule gpipe "${pp[@]}" \
  --metrics-file "$work/pp_gpipe.jsonl" >/dev/null || fail "GPipe PP2 run"
same_losses "GPipe" "$work/pp_ref.jsonl" "$work/pp_gpipe.jsonl"
# the schedule table: a header, then one row per pipeline rank with forward (F) and backward (B) cells
grep -q "^1f1b: p=2" "$work/pp2.out" && grep -q "^rank 0 | F0.0" "$work/pp2.out" && grep -q "^rank 1 | .*B1.1" "$work/pp2.out" \
  && ok || fail "--print-pipeline-schedule printed no rank table: $(cat "$work/pp2.out")"
bubbles=$(sed -E 's/.*"bubble_fraction":([^,}]*).*/\1/' "$work/pp2.jsonl" | awk '$1 > 0 && $1 < 1 { n++ } END { print n + 0 }')
[ "$bubbles" -eq 6 ] && ok || fail "PP2 metrics: $bubbles of 6 steps with 0 < bubble_fraction < 1"

# --- pipeline resume: stopped at step 3 at PP2, resumed at PP2 (exact), PP4 and PP1 ---------
"$bin/dsp-train" --world-size 2 --pipeline-model-parallel-size 2 "${pp[@]}" --exit-interval 3 --save "$work/ckpt_pp_half" \
  --metrics-file "$work/pp_half.jsonl" >/dev/null || fail "PP2 first half"
for to in 2 4 1; do
  cp "$work/pp_half.jsonl" "$work/pp_resumed$to.jsonl"
  "$bin/dsp-train" --world-size $to --pipeline-model-parallel-size $to "${pp[@]}" --load "$work/ckpt_pp_half" \
    --metrics-file "$work/pp_resumed$to.jsonl" >"$work/out" 2>&1 || fail "PP2 checkpoint resumed at PP$to: $(cat "$work/out")"
  same_losses "PP2 checkpoint resumed at PP$to" "$work/pp2.jsonl" "$work/pp_resumed$to.jsonl"
done
diff <(losses "$work/pp2.jsonl") <(losses "$work/pp_resumed2.jsonl") >/dev/null && ok \
  || fail "PP2 resumed at PP2 is not exactly the uninterrupted run: $(diff <(losses "$work/pp2.jsonl") <(losses "$work/pp_resumed2.jsonl"))"

# --- a TP2 x PP2 checkpoint served at PP1 ---------------------------------------------------
for tp in 1 4; do
  "$bin/dsp-reshard" --load "$work/ckpt_pp" --save "$work/ckpt_pp_tp$tp" --tensor-model-parallel-size $tp \
    >"$work/out" 2>&1 && grep -q "(TP2/PP2/DP1) to .*(TP$tp/PP1/DP1)" "$work/out" && ok \
    || fail "reshard of the TP2 x PP2 checkpoint to TP$tp: $(cat "$work/out")"
done
"$bin/dsp-consistency-check" --load "$work/ckpt_pp_tp4" --tensor-model-parallel-size 4 >"$work/cc" \
  && grep -q "\"reference\":\"$work/ckpt_pp/iter_0000006\"" "$work/cc" && grep -q '"reference_layout":"TP2/PP2/DP1"' "$work/cc" \
  && grep -q '"consistent":true' "$work/cc" && ok || fail "consistency of the TP2 x PP2 checkpoint at TP4/PP1: $(cat "$work/cc")"
"$bin/dsp-consistency-check" --load "$work/ckpt_pp_tp1" --tensor-model-parallel-size 1 >"$work/cc" \
  && grep -q '"consistent":true' "$work/cc" && ok || fail "consistency of the TP2 x PP2 checkpoint at TP1/PP1: $(cat "$work/cc")"
"$bin/dsp-consistency-check" --load "$work/ckpt_pp" --tensor-model-parallel-size 4 >"$work/cc" \
  && grep -q '"consistent":true' "$work/cc" && ok \
  || fail "consistency of the TP2 x PP2 checkpoint loaded directly at TP4/PP1: $(cat "$work/cc")"
"$bin/dsp-generate" --load "$work/ckpt_pp" --tensor-model-parallel-size 4 --prompt "ROMEO:" --max-new-tokens 8 \
  >"$work/gen_pp4" && grep -q "ROMEO:" "$work/gen_pp4" && ok || fail "generate at TP4 from the TP2 x PP2 checkpoint"
"$bin/dsp-generate" --load "$work/ckpt_pp_tp1" --prompt "ROMEO:" --max-new-tokens 8 >"$work/gen_pp1" \
  && diff <(text_of "$work/gen_pp1" | tail -n +2) <(text_of "$work/gen_pp4" | tail -n +2) >/dev/null && ok \
  || fail "greedy generation from the TP2 x PP2 checkpoint differs between TP1 and TP4"
# merged from an interleaved checkpoint (rank 0 saved layers 0 and 2, rank 1 layers 1 and 3):
# the data of model.safetensors is in global layer order (data_offsets rise with the layer)
"$bin/dsp-reshard" --load "$work/ckpt_il" --save "$work/hf_il" --merge >/dev/null || fail "merge of the interleaved checkpoint"
offsets() { head -c 65536 "$1" | grep -ao '"model\.layers\.[0-9]*\.input_layernorm\.weight":{"data_offsets":\[[0-9]*' \
  | sed -E 's/"model\.layers\.([0-9]*)\..*\[([0-9]*)$/\2 \1/'; }
[ "$(offsets "$work/hf_il/model.safetensors" | sort -n | awk '{ printf "%s ", $2 }')" = "0 1 2 3 " ] && ok \
  || fail "merged interleaved checkpoint not in layer order: $(offsets "$work/hf_il/model.safetensors" | sort -n)"
"$bin/dsp-consistency-check" --load "$work/ckpt_il" --tensor-model-parallel-size 2 >"$work/cc" \
  && grep -q '"reference_layout":"TP1/PP2/DP1"' "$work/cc" && grep -q '"consistent":true' "$work/cc" && ok \
  || fail "consistency of the interleaved checkpoint at TP2/PP1: $(cat "$work/cc")"

# --- bad input: clear message, non-zero exit, no partial output -----------------------------
expect_fail "unknown gradient dtype" "--grad-reduce-dtype: fp8 not in {fp32,bf16,fp16}" "$work/m9" -- \
  "$bin/dsp-train" "${model[@]}" --grad-reduce-dtype fp8 --metrics-file "$work/m9"
expect_fail "zero bucket size" "--ddp-bucket-size must be >= 1 byte, got 0" "$work/m10" -- \
  "$bin/dsp-train" --world-size 2 "${model[@]}" --ddp-bucket-size 0 --metrics-file "$work/m10"
expect_fail "layout does not divide" "world size 3 is not divisible by tensor-model-parallel-size" "$work/m1" -- \
  "$bin/dsp-train" --world-size 3 --tensor-model-parallel-size 2 "${model[@]}" --metrics-file "$work/m1" --save "$work/s1"
expect_fail "heads not divisible by TP" "number of attention heads (4) is not divisible by tensor-model-parallel-size (8)" "$work/m2" -- \
  "$bin/dsp-train" --world-size 8 --tensor-model-parallel-size 8 "${model[@]}" --hidden-size 64 --metrics-file "$work/m2"
expect_fail "hidden not divisible by heads" "hidden size (30) is not divisible by number of attention heads (4)" "$work/m3" -- \
  "$bin/dsp-train" "${model[@]}" --hidden-size 30 --metrics-file "$work/m3"
expect_fail "kv heads vs TP" "number of query groups (3) and tensor-model-parallel-size (2) must divide one another" "$work/m4" -- \
  "$bin/dsp-train" --world-size 2 --tensor-model-parallel-size 2 "${model[@]}" --num-attention-heads 6 \
  --hidden-size 48 --num-query-groups 3 --metrics-file "$work/m4"
expect_fail "ffn not divisible by TP" "ffn hidden size (66) is not divisible by tensor-model-parallel-size (4)" "$work/m5" -- \
  "$bin/dsp-train" --world-size 4 --tensor-model-parallel-size 4 "${model[@]}" --ffn-hidden-size 66 --metrics-file "$work/m5"
expect_fail "unwritable trace file" "cannot write trace file '$work/nodir/t.json'" "$work/m8" -- \
  "$bin/dsp-train" "${model[@]}" --profile-file "$work/nodir/t.json" --metrics-file "$work/m8"
expect_fail "missing data file" "data file '$work/nope.txt' cannot be opened" "$work/m6" -- \
  "$bin/dsp-train" "${model[@]}" --data-path "$work/nope.txt" --metrics-file "$work/m6"
expect_fail "prompt longer than the sequence" "prompt 0: the prompt of 70 tokens plus max_tokens 1 exceeds --max-model-len 64" "" -- \
  "$bin/dsp-generate" --load "$work/ckpt" --prompt "$(printf 'x%.0s' {1..70})" --max-new-tokens 1
printf 'ROMEO:\n\nJULIET:\n' >"$work/blank_prompts"
expect_fail "a blank line in a prompts file" "prompts file '$work/blank_prompts' line 2 is blank" "" -- \
  "$bin/dsp-generate" --load "$work/ckpt" --prompts-file "$work/blank_prompts" --max-new-tokens 1
"$bin/dsp-generate" --load "$work/ckpt" --prompt "A" --top-k 5 --seed 3 --max-new-tokens 1 >/dev/null 2>"$work/err" \
  && grep -qF "warning: --top-k, --seed have no effect with --temperature 0" "$work/err" && ok \
  || fail "sampling flags at temperature 0 are not said to have no effect: $(cat "$work/err")"
expect_fail "top_p out of range" "top_p must be in (0, 1], got 1.5" "" -- \
  "$bin/dsp-generate" --load "$work/ckpt" --prompt "A" --temperature 1 --top-p 1.5
expect_fail "repetition penalty 0" "repetition_penalty must be > 0 (1: off), got 0" "" -- \
  "$bin/dsp-generate" --load "$work/ckpt" --prompt "A" --repetition-penalty 0
expect_fail "a KV cache too small for one request" "fewer than one request of --max-model-len 64 needs" "" -- \
  "$bin/dsp-generate" --load "$work/ckpt" --prompt "A" --kv-cache-memory 1000
expect_fail "reshard to a TP that does not divide" "cannot reshard" "$work/bad_tp" -- \
  "$bin/dsp-reshard" --load "$work/ckpt" --save "$work/bad_tp" --tensor-model-parallel-size 3
expect_fail "another model config" "another model config" "" -- \
  "$bin/dsp-train" --world-size 2 --tensor-model-parallel-size 2 "${model[@]}" --hidden-size 64 --load "$work/ckpt" \
  --train-iters 8
expect_fail "--log-interval 0" "--log-interval: must be >= 1, got 0" "$work/m27" -- \
  "$bin/dsp-train" "${model[@]}" --log-interval 0 --metrics-file "$work/m27"
expect_fail "negative learning rate" "--lr must be >= 0, got -1" "$work/m28" -- \
  "$bin/dsp-train" "${model[@]}" --lr -1 --metrics-file "$work/m28"
expect_fail "world size 0" "--world-size: must be >= 1, got 0" "$work/m29" -- \
  "$bin/dsp-train" --world-size 0 "${model[@]}" --metrics-file "$work/m29"
expect_fail "global batch not divisible" \
  "global batch size (4) is not divisible by micro batch size x data-parallel size = 2 x 3 = 6" "$work/m30" -- \
  "$bin/dsp-train" --world-size 3 "${model[@]}" --metrics-file "$work/m30"
printf '{"tensor-modle-parallel-size": 2}' >"$work/typo.json"
expect_fail "a config file key that is no flag" \
  "config file '$work/typo.json': --tensor-modle-parallel-size is not a flag" "$work/m31" -- \
  "$bin/dsp-train" --config "$work/typo.json" "${model[@]}" --metrics-file "$work/m31"
printf '{"seed": "two"}' >"$work/bad_value.json"
expect_fail "a config file value that does not convert" \
  "config file '$work/bad_value.json': Could not convert: --seed = two" "$work/m32" -- \
  "$bin/dsp-train" --config "$work/bad_value.json" "${model[@]}" --metrics-file "$work/m32"
printf '{"log-interval": 0}' >"$work/bad_range.json"
expect_fail "a config file value out of range" \
  "config file '$work/bad_range.json': --log-interval: must be >= 1, got 0" "$work/m33" -- \
  "$bin/dsp-train" --config "$work/bad_range.json" "${model[@]}" --metrics-file "$work/m33"
# Command-line edges: the nearest flag is suggested, --help names the program and the defaults,
# a folder as --data-path is named, DeepSpeed's nested values are refused naming the file and
# key, and relative paths in a config file are taken from the file's folder.
expect_fail "an unknown flag suggests the nearest" \
  "unknown flag --tensor-parallel-size: did you mean --tensor-model-parallel-size?" "$work/m40" -- \
  "$bin/dsp-train" "${model[@]}" --tensor-parallel-size 2 --metrics-file "$work/m40"
printf '{"tensor-parallel-size": 2}' >"$work/near.json"
expect_fail "an unknown config key suggests the nearest" \
  "config file '$work/near.json': --tensor-parallel-size is not a flag of this program (did you mean --tensor-model-parallel-size?)" \
  "$work/m41" -- "$bin/dsp-train" --config "$work/near.json" "${model[@]}" --metrics-file "$work/m41"
"$bin/dsp-train" --help >"$work/help" 2>&1
if grep -q '^Usage: dsp-train ' "$work/help" && grep -qE -- '^ +--lr FLOAT=0.001 ' "$work/help" &&
   grep -qE -- '^ +--seed UINT=1234 ' "$work/help"; then ok; else fail "--help lacks the program name or defaults: $(head -5 "$work/help")"; fi
expect_fail "a folder as --data-path" "data path '$work' is a directory: --data-path takes a text file" "$work/m42" -- \
  "$bin/dsp-train" "${model[@]}" --data-path "$work" --metrics-file "$work/m42"
printf '{"zero_optimization": {"stage": 2}}' >"$work/deepspeed.json"
expect_fail "a DeepSpeed-style nested value" \
  "config file '$work/deepspeed.json': key 'zero_optimization' holds a nested object (DeepSpeed's style); dsp config files are flat, one flag per key: use --zero-stage" \
  "$work/m43" -- "$bin/dsp-train" --config "$work/deepspeed.json" "${model[@]}" --metrics-file "$work/m43"
mkdir -p "$work/cfgdir/data"
cp "$data" "$work/cfgdir/data/corpus.txt"
printf '{"data-path": "data/corpus.txt", "metrics-file": "out/metrics.jsonl"}' >"$work/cfgdir/relative.json"
(cd / && "$bin/dsp-train" "${model[@]:2}" --train-iters 2 --config "$work/cfgdir/relative.json" >"$work/relative.out" 2>&1)
[ -s "$work/cfgdir/out/metrics.jsonl" ] && ok || fail "config-relative paths: $(tail -3 "$work/relative.out")"
"$bin/dsp-train" --config "$work/bad_range.json" "${model[@]}" --log-interval 5 --metrics-file "$work/m34" >/dev/null 2>&1 \
  && [ -s "$work/m34" ] && ok || fail "a flag on the command line overrides a config file value out of range"
expect_fail "serving at TP 0" "--tensor-model-parallel-size: must be >= 1, got 0" "" -- \
  "$bin/dsp-generate" --load "$work/ckpt" --tensor-model-parallel-size 0 --prompt "A"
expect_fail "resume from a serving checkpoint" "holds no optimizer state" "" -- \
  "$bin/dsp-train" --world-size 2 --tensor-model-parallel-size 2 "${model[@]}" --load "$work/serve_tp4"
expect_fail "resume with truncated optimizer files" "optim_tp00_pp000_dp000.safetensors: size is 100 bytes" "" -- \
  "$bin/dsp-train" --world-size 2 --tensor-model-parallel-size 2 "${model[@]}" --load "$work/ckpt_broken_optim"
# a checkpoint already at --train-iters: said, and nothing trained
"$bin/dsp-train" --world-size 2 --tensor-model-parallel-size 2 "${model[@]}" --load "$work/ckpt" --train-iters 3 \
  >"$work/out" 2>&1
grep -qF "is at iteration 6, not below --train-iters 3: nothing to train" "$work/out" &&
  grep -qF "trained 0 steps" "$work/out" && ok || fail "resume past --train-iters: $(cat "$work/out")"

expect_fail "pipeline size does not divide the world" \
  "world size 4 is not divisible by tensor-model-parallel-size x pipeline-model-parallel-size = 1 x 3 = 3" "$work/s_pp3" -- \
  "$bin/dsp-train" --world-size 4 --pipeline-model-parallel-size 3 "${pp[@]}" --save "$work/s_pp3" --metrics-file "$work/m11"
if [ -e "$work/m11" ]; then fail "pipeline size does not divide the world: partial output $work/m11"; else ok; fi
expect_fail "layer split does not sum to the layers" "layer split 1,2 sums to 3 layers, but the model has 4" "$work/m12" -- \
  "$bin/dsp-train" --world-size 2 --pipeline-model-parallel-size 2 "${pp[@]}" --pipeline-layer-split 1,2 \
  --metrics-file "$work/m12"
expect_fail "interleaved without virtual stages" \
  "--pipeline-schedule interleaved needs --num-layers-per-virtual-pipeline-stage" "$work/m13" -- \
  "$bin/dsp-train" --world-size 2 --pipeline-model-parallel-size 2 "${pp[@]}" --pipeline-schedule interleaved \
  --metrics-file "$work/m13"
expect_fail "interleaved with micro-batches not a multiple of PP" \
  "number of micro-batches (m=3) to be a positive multiple of the pipeline size (p=2)" "$work/m14" -- \
  "$bin/dsp-train" --world-size 2 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 "${pp[@]}" \
  --global-batch-size 6 --metrics-file "$work/m14"
expect_fail "reshard to PP2" "dsp-reshard writes one pipeline stage" "$work/bad_pp" -- \
  "$bin/dsp-reshard" --load "$work/ckpt_pp" --save "$work/bad_pp" --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2

# --- MoE and expert parallelism: the same losses at any EP, routing metrics, EP2 -> EP1 -----
moe=("${model[@]}" --num-layers 3 --peak-flops 1e10 --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 16
     --moe-shared-expert-intermediate-size 16 --first-k-dense-replace 1 --moe-router-score-function sigmoid
     --moe-router-enable-expert-bias --moe-router-bias-update-rate 0.01 --moe-aux-loss-coeff 0.001)
"$bin/dsp-train" "${moe[@]}" --metrics-file "$work/moe_ref.jsonl" >"$work/moe_ref.out" || fail "MoE world-1 run"
"$bin/dsp-train" --world-size 2 --expert-model-parallel-size 2 "${moe[@]}" --metrics-file "$work/moe_ep2.jsonl" \
  --save "$work/ckpt_moe" >"$work/moe_ep2.out" || fail "MoE EP2 run: $(cat "$work/moe_ep2.out")"
same_losses "MoE EP2" "$work/moe_ref.jsonl" "$work/moe_ep2.jsonl"
"$bin/dsp-train" --world-size 4 --expert-model-parallel-size 2 "${moe[@]}" --global-batch-size 4 \
  --micro-batch-size 1 --metrics-file "$work/moe_dp4.jsonl" >/dev/null || fail "MoE EP2 x DP4 run"
"$bin/dsp-train" "${moe[@]}" --global-batch-size 4 --micro-batch-size 1 --metrics-file "$work/moe_ref1.jsonl" \
  >/dev/null || fail "MoE world-1 run, micro-batch 1"
same_losses "MoE EP2 with DP4" "$work/moe_ref1.jsonl" "$work/moe_dp4.jsonl"
"$bin/dsp-train" --world-size 4 --tensor-model-parallel-size 2 --expert-model-parallel-size 2 "${moe[@]}" \
  --metrics-file "$work/moe_tp2ep2.jsonl" >"$work/out" || fail "MoE TP2 x EP2 run: $(cat "$work/out")"
grep -q "TP2/PP1/DP2/EP2" "$work/out" && ok || fail "TP2 x EP2 run did not report its layout: $(cat "$work/out")"
same_losses "MoE TP2 x EP2" "$work/moe_ref.jsonl" "$work/moe_tp2ep2.jsonl"
# per step and MoE layer (1 and 2): tokens per expert summing to tokens x k = 4 x 64 x 2
[ "$(grep -c '"moe":\[{"aux_loss":[^,]*,"dropped":0,"layer":1,"max_over_mean_load":[^,]*,"tokens_per_expert":\[' "$work/moe_ep2.jsonl")" -eq 6 ] \
  && [ "$(head -n 1 "$work/moe_ep2.jsonl" | grep -o '"tokens_per_expert":\[[0-9,]*\]' | head -n 1 | tr -dc '0-9,' | tr ',' '\n' | awk '{ s += $1 } END { print s }')" -eq 512 ] \
  && ok || fail "MoE metrics lack per-layer routing: $(head -n 1 "$work/moe_ep2.jsonl")"
grep -q "^layer | max/mean (run)" "$work/moe_ep2.out" && grep -Eq "^    2 \| +[0-9.]+ \|" "$work/moe_ep2.out" && ok \
  || fail "no end-of-run routing table: $(cat "$work/moe_ep2.out")"
cp <(head -n 3 "$work/moe_ep2.jsonl") "$work/moe_resumed.jsonl"
"$bin/dsp-train" --world-size 2 --expert-model-parallel-size 2 "${moe[@]}" --exit-interval 3 --save "$work/ckpt_moe_half" \
  >/dev/null || fail "MoE EP2 first half"
"$bin/dsp-train" "${moe[@]}" --load "$work/ckpt_moe_half" --metrics-file "$work/moe_resumed.jsonl" >"$work/out" 2>&1 \
  || fail "MoE EP2 checkpoint resumed at EP1: $(cat "$work/out")"
same_losses "MoE EP2 checkpoint resumed at EP1" "$work/moe_ep2.jsonl" "$work/moe_resumed.jsonl"
"$bin/dsp-reshard" --load "$work/ckpt_moe" --save "$work/ckpt_moe_tp1" --tensor-model-parallel-size 1 >/dev/null \
  && "$bin/dsp-consistency-check" --load "$work/ckpt_moe_tp1" --reference "$work/ckpt_moe" --tensor-model-parallel-size 1 \
  >"$work/cc" && grep -q '"consistent":true' "$work/cc" && ok || fail "MoE EP2 checkpoint served at TP1: $(cat "$work/cc")"
expect_fail "experts not divisible by EP" "number of experts (6) is not divisible by expert-model-parallel-size (4)" "$work/m15" -- \
  "$bin/dsp-train" --world-size 4 --expert-model-parallel-size 4 "${moe[@]}" --num-experts 6 --metrics-file "$work/m15"
expect_fail "EP does not divide DP" "data-parallel size 2 is not divisible by expert-model-parallel-size 4" "$work/m16" -- \
  "$bin/dsp-train" --world-size 4 --tensor-model-parallel-size 2 --expert-model-parallel-size 4 "${moe[@]}" --metrics-file "$work/m16"
expect_fail "negative number of experts" "number of experts must be >= 0 (0: dense), got -4" "$work/m18" -- \
  "$bin/dsp-train" "${moe[@]}" --num-experts -4 --metrics-file "$work/m18"
expect_fail "NaN capacity factor" "--moe-expert-capacity-factor must be finite" "$work/m19" -- \
  "$bin/dsp-train" "${moe[@]}" --moe-expert-capacity-factor nan --metrics-file "$work/m19"
expect_fail "expert parallelism of a dense model" "expert-model-parallel-size 2 needs an MoE model" "$work/m20" -- \
  "$bin/dsp-train" --world-size 2 --expert-model-parallel-size 2 "${model[@]}" --metrics-file "$work/m20"
expect_fail "an MoE flag without experts" "--moe-router-topk needs an MoE model" "$work/m21" -- \
  "$bin/dsp-train" "${model[@]}" --moe-router-topk 4 --metrics-file "$work/m21"
expect_fail "shared expert size not a multiple" "--moe-shared-expert-intermediate-size (24) is not divisible by --moe-ffn-hidden-size (16)" "$work/m17" -- \
  "$bin/dsp-train" "${moe[@]}" --moe-shared-expert-intermediate-size 24 --metrics-file "$work/m17"

mkdir -p "$work/notes" && echo keep >"$work/notes/keep.txt"
"$bin/dsp-train" "${model[@]}" --save "$work/notes" --metrics-file "$work/m7" >/dev/null || fail "--save into a folder of other files"
[ -f "$work/notes/keep.txt" ] && [ -f "$work/notes/iter_0000006/manifest.json" ] && ok \
  || fail "--save into a folder of other files: iter_0000006 missing or keep.txt lost"
# The run saved 6 iterations into ckpt (3 + resumed 3): starting over there without --load is refused.
expect_fail "--save over a later iteration without --load" "holds iteration 6, and this run would write iteration 2" \
  "$work/m7b" -- "$bin/dsp-train" --world-size 2 --tensor-model-parallel-size 2 "${model[@]}" --train-iters 2 \
  --save "$work/ckpt" --metrics-file "$work/m7b"
[ "$(cat "$work/ckpt/latest_checkpointed_iteration.txt")" = 6 ] && [ -d "$work/ckpt/iter_0000006" ] && ok \
  || fail "the refused run touched ckpt"
expect_fail "reshard onto itself" "onto itself" "" -- \
  "$bin/dsp-reshard" --load "$work/ckpt" --save "$work/ckpt" --tensor-model-parallel-size 1
expect_fail "--load of a path that does not exist" "does not exist" "" -- \
  "$bin/dsp-generate" --load "$work/nowhere" --prompt "A"

cp -r "$work/ckpt" "$work/trunc"
f=$(ls "$work/trunc"/iter_0000006/model_*.safetensors | head -n 1)
truncate -s -100 "$f"
expect_fail "truncated shard" "$(basename "$f")" "" -- "$bin/dsp-generate" --load "$work/trunc" --prompt "A" --max-new-tokens 1
cp -r "$work/ckpt" "$work/corrupt"
f=$(ls "$work/corrupt"/iter_0000006/model_*.safetensors | tail -n 1)
printf '\x7f' | dd of="$f" bs=1 seek=200 conv=notrunc status=none
expect_fail "corrupted shard" "$(basename "$f")" "" -- "$bin/dsp-generate" --load "$work/corrupt" --prompt "A" --max-new-tokens 1
mkdir -p "$work/empty"
expect_fail "missing manifest" "manifest.json" "" -- "$bin/dsp-generate" --load "$work/empty" --prompt "A"

# an MFU over 100% (a peak far too low) is flagged as a wrong peak, not printed as a figure
"$bin/dsp-train" "${model[@]}" --train-iters 1 --peak-flops 1e3 --metrics-file "$work/mfu.jsonl" >"$work/mfu.out" \
  && grep -q "MFU n/a (over 100%: wrong peak)" "$work/mfu.out" && grep -q '"mfu":null' "$work/mfu.jsonl" && ok \
  || fail "MFU over 100%: $(cat "$work/mfu.out")"

echo "cli: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
