#!/usr/bin/env bash
# dsp-plan end to end on the two worked examples and the three classic mistakes:
#  - a 60-layer model of ~128 GB bf16 weights on 2 nodes x 8 GPUs x 80 GB: per-rank training and
#    serving memory, a layout (TP8 x PP2, full recomputation) and ranked recommendations;
#  - a 64-layer model (hidden 7168, 56 heads) on 8 nodes x 8 GPUs, global batch 512: TP8 x PP2 x DP4;
#  - no model flags: dsp-train's default model, said so, its figures in MB (not 0.00 GB);
#  - TP 16 with 56 heads, PP 8 with 60 layers and no split, global batch 512 with micro 3 x DP 4:
#    each rejected with its numbers on stderr and a non-zero exit.
# Usage: plan_test.sh BIN_DIR CONFIG_DIR
set -uo pipefail
bin=$1
configs=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
passed=0
failed=0
ok() { passed=$((passed + 1)); }
fail() { failed=$((failed + 1)); echo "FAILED: $*"; }

# expect_ok NAME TEXT... -- command...: exit 0 and stdout holds every TEXT
expect_ok() {
  local name=$1
  shift
  local texts=()
  while [ "$1" != "--" ]; do texts+=("$1"); shift; done
  shift
  if ! "$@" >"$work/out" 2>"$work/err"; then fail "$name: exit code $?: $(cat "$work/err")"; return; fi
  for t in "${texts[@]}"; do
    grep -qF -- "$t" "$work/out" || { fail "$name: stdout lacks '$t'"; cat "$work/out"; return; }
  done
  ok
}
# expect_fail NAME TEXT -- command...: non-zero exit and stderr holds TEXT
expect_fail() {
  local name=$1 text=$2
  shift 3
  "$@" >"$work/out" 2>"$work/err"
  local rc=$?
  if [ "$rc" -eq 0 ]; then fail "$name: exit code 0"; return; fi
  grep -qF -- "$text" "$work/err" || { fail "$name: stderr lacks '$text': $(cat "$work/err")"; return; }
  ok
}

a=(--model-config "$configs/plan_60layer.json")
b=(--model-config "$configs/plan_64layer_7168.json")

expect_ok "60-layer example" "63.94 B parameters = 127.9 GB in bf16" "layout: TP8 x PP2 x DP1 = 16 ranks" \
  "recompute full" "optimizer state" "activations | KV cache" "serve TP8" "fits in the GPU memory" \
  "1   TP8 x PP2 x DP1              full" -- \
  "$bin/dsp-plan" "${a[@]}" --num-nodes 2 --gpus-per-node 8 --gpu-memory 80
grep -E '^  total' "$work/out" | grep -qE ' 69\.[0-9]{2} ' || fail "60-layer example: worst-rank total is not ~69 GB"

expect_ok "64-layer example" "36.16 B parameters" "layout: TP8 x PP2 x DP4 = 64 ranks" \
  "128 micro-batches of 1 x 4096 tokens per step (global batch 512 = 1 x DP4 x 128 accumulation)" \
  "1   TP8 x PP2 x DP4              none" -- \
  "$bin/dsp-plan" "${b[@]}" --num-nodes 8 --gpus-per-node 8 --global-batch-size 512

expect_ok "64-layer example, layout given" "layout: TP8 x PP2 x DP4 = 64 ranks" "bubble (p-1)/(v m+p-1) = 0.8 %" -- \
  "$bin/dsp-plan" "${b[@]}" --world-size 64 --global-batch-size 512 --tensor-model-parallel-size 8 \
  --pipeline-model-parallel-size 2

expect_ok "explicit layer split" "PP rank 0: layers 0-7 + embedding" "PP rank 7: layers 53-59 + output layer" -- \
  "$bin/dsp-plan" "${a[@]}" --num-nodes 2 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 8 \
  --pipeline-layer-split 8,8,8,8,7,7,7,7

# DeepSeek's published configs (MLA): parameters as transformers builds them (671,026,404,352 and
# 15,706,484,224: tools note in samples/configs), activated per token against the reports'
# "37 B" (-1.0%) and "2.4 B" (+2.1%: the report rounds), the latent KV cache per token
# (61 x 576 x 2 = 70,272 bytes in bf16), and V3's training layout (PP16 x DP128 with EP64,
# ZeRO-1, 2,048 GPUs, 4,096-token sequences, global batch 15,360).
expect_ok "DeepSeek-V3" "671.03 B parameters" "36.63 B activated per token" "KV cache per token: 70272 bytes in bf16" \
  "layout: TP1 x PP16 x DP128 (EP64) = 2048 ranks" "ZeRO stage 1" "blocks of 16 tokens, 1124352 bytes each" -- \
  "$bin/dsp-plan" --model-config "$configs/deepseek_v3_config.json" --seq-length 4096 --pipeline-model-parallel-size 16 \
  --expert-model-parallel-size 64 --world-size 2048 --zero-stage 1 --global-batch-size 15360 \
  --recompute-granularity selective
expect_ok "DeepSeek-V2-Lite" "15.71 B parameters" "2.45 B activated per token" "KV cache per token: 31104 bytes in bf16" -- \
  "$bin/dsp-plan" --model-config "$configs/deepseek_v2_lite_config.json" --seq-length 4096

expect_ok "no model flags: dsp-train's default model, in units that show it" \
  "planning dsp-train's default model" "557696 parameters = 1.1 MB in bf16, 2.2 MB in fp32" "per-rank memory, MB (1e6 B)" -- \
  "$bin/dsp-plan"
grep -E '^  total' "$work/out" | grep -qE ' [1-9][0-9]*\.[0-9]{2} ' || fail "default model: total shows no non-zero MB figure"
expect_ok "the default model's recommendations in MB" "worst MB" "1   TP1 x PP1 x DP2" -- \
  "$bin/dsp-plan" --num-nodes 1 --gpus-per-node 2

expect_fail "TP does not divide the heads" \
  "number of attention heads (56) is not divisible by tensor-model-parallel-size (16)" -- \
  "$bin/dsp-plan" "${b[@]}" --num-nodes 8 --global-batch-size 512 --tensor-model-parallel-size 16 \
  --pipeline-model-parallel-size 2
expect_ok "PP that does not divide the layers: split as dsp-train splits them" \
  "PP rank 0: layers 0-7 + embedding" "PP rank 7: layers 53-59 + output layer" -- \
  "$bin/dsp-plan" "${a[@]}" --num-nodes 2 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 8
expect_fail "more stages than layers" \
  "number of layers (60) is smaller than the number of pipeline stages (64)" -- \
  "$bin/dsp-plan" "${a[@]}" --num-nodes 8 --tensor-model-parallel-size 1 --pipeline-model-parallel-size 64
expect_fail "no layout of the cluster validates: each says why" \
  "TP8 x PP2 x DP1: global batch size (3) is not divisible by micro batch size x data-parallel size = 2 x 1 = 2" -- \
  "$bin/dsp-plan" "${a[@]}" --num-nodes 2 --global-batch-size 3 --micro-batch-size 2
expect_fail "global batch is not micro x DP x accumulation" \
  "global batch size (512) is not divisible by micro batch size x data-parallel size = 3 x 4 = 12" -- \
  "$bin/dsp-plan" "${b[@]}" --num-nodes 8 --global-batch-size 512 --micro-batch-size 3 \
  --tensor-model-parallel-size 8 --pipeline-model-parallel-size 2
expect_fail "missing model config" "cannot be opened" -- "$bin/dsp-plan" --model-config "$work/none.json"

echo "plan_test: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
