#!/usr/bin/env bash
# The demo: train a TP2 x DP2 model on tiny Shakespeare (4 CPU ranks as threads), save it
# sharded, reshard it to TP1 and TP4 (serving checkpoints: --no-save-optim leaves out the Adam
# moments, two thirds of the bytes), generate text at both, and check that the served
# models are the trained one (max |logit diff| <= 1e-4 on 9 prompts of different lengths).
# Outputs go to $DSP_DEMO_DIR (default out/demo).
# `scripts/demo.sh pp`: the pipeline demo instead: the same model trained TP2 x PP2, its
# checkpoint served at TP4 on one stage and checked against the TP2 x PP2 layout
# (default out/demo_pp).
# `scripts/demo.sh moe`: the MoE demo: a DeepSeekMoE model (8 routed experts, top-2, a shared
# expert, the first layer dense, sigmoid router with the expert bias) trained TP2 x EP2 on 4
# ranks, resharded to TP1 (every expert on one rank), generated from, and checked against its
# training layout (default out/demo_moe).
# `scripts/demo.sh mla`: the DeepSeek-V3-architecture demo: Multi-head Latent Attention (query
# latent 64, KV latent 32, RoPE key 16) and DeepSeekMoE with V3's router (sigmoid, groups,
# routed scaling 2.5, expert bias) trained TP2 x EP2 on 4 ranks, served through the engine with
# MLA's latent cache at TP1 and at TP2 x EP2, checked against the training layout, and its KV
# cache bytes per token set against the GQA MoE demo's (default out/demo_mla).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cmake --preset default >/dev/null
cmake --build --preset default -j2 --target dsp-train dsp-generate dsp-reshard dsp-consistency-check dsp-serve
bin=build/default/samples

if [ "${1:-}" = pp ]; then
  out=${DSP_DEMO_DIR:-out/demo_pp}
  mkdir -p "$out"
  echo "== 1. train (TP2 x PP2, world 4, 1F1B) =="
  "$bin/dsp-train" --config samples/configs/demo_pp.json --save "$out/ckpt" --overwrite-checkpoints --metrics-file "$out/metrics.jsonl"
  echo "== 2. serve at TP4 on one pipeline stage: generate, and check against the TP2 x PP2 layout =="
  "$bin/dsp-generate" --load "$out/ckpt" --tensor-model-parallel-size 4 --prompt "JULIET:" --max-new-tokens 90 \
    --temperature 0.8 --top-k 40 --top-p 0.95 --seed 7
  "$bin/dsp-consistency-check" --load "$out/ckpt" --tensor-model-parallel-size 4
  echo "pipeline demo finished: checkpoint and metrics in $out"
  exit 0
fi

if [ "${1:-}" = moe ]; then
  out=${DSP_DEMO_DIR:-out/demo_moe}
  mkdir -p "$out"
  echo "== 1. train (TP2 x EP2 on 4 ranks: DP2, the experts split over the two DP ranks) =="
  "$bin/dsp-train" --config samples/configs/demo_moe.json --save "$out/ckpt" --overwrite-checkpoints --metrics-file "$out/metrics.jsonl"
  echo "== 2. reshard to TP1 / EP1, generate, and check against the TP2 x EP2 checkpoint =="
  "$bin/dsp-reshard" --load "$out/ckpt" --save "$out/ckpt_tp1" --tensor-model-parallel-size 1 --no-save-optim
  "$bin/dsp-generate" --load "$out/ckpt_tp1" --prompt "ROMEO:" --max-new-tokens 90 --temperature 0.8 --top-k 40 --seed 1
  "$bin/dsp-consistency-check" --load "$out/ckpt_tp1" --reference "$out/ckpt" --tensor-model-parallel-size 1
  echo "MoE demo finished: checkpoints and metrics in $out"
  exit 0
fi

if [ "${1:-}" = mla ]; then
  out=${DSP_DEMO_DIR:-out/demo_mla}
  mkdir -p "$out"
  echo "== 1. train a DeepSeek-V3-architecture model (MLA + DeepSeekMoE, TP2 x EP2 on 4 ranks) =="
  "$bin/dsp-train" --config samples/configs/demo_mla.json --save "$out/ckpt" --overwrite-checkpoints --metrics-file "$out/metrics.jsonl"
  echo "== 2. serve it through the engine (latent KV cache, absorbed attention): TP1, and TP2 x EP2 =="
  "$bin/dsp-reshard" --load "$out/ckpt" --save "$out/ckpt_tp1" --tensor-model-parallel-size 1 --no-save-optim
  "$bin/dsp-generate" --load "$out/ckpt_tp1" --prompt "ROMEO:" --max-new-tokens 90 --temperature 0.8 --top-k 40 --seed 1 \
    2> >(tee "$out/generate_mla.log" >&2)
  "$bin/dsp-generate" --load "$out/ckpt" --tensor-model-parallel-size 2 --expert-parallel-size 2 --prompt "JULIET:" \
    --max-new-tokens 90 --temperature 0.8 --top-k 40 --top-p 0.95 --seed 7
  echo "== 3. consistency: served layouts vs the training layout =="
  "$bin/dsp-consistency-check" --load "$out/ckpt_tp1" --reference "$out/ckpt" --tensor-model-parallel-size 1
  "$bin/dsp-consistency-check" --load "$out/ckpt" --tensor-model-parallel-size 2
  echo "== 4. KV cache bytes per token at TP1, fp32: MLA's latent against the GQA MoE demo's keys and values =="
  "$bin/dsp-train" --config samples/configs/demo_moe.json --train-iters 1 --eval-interval 0 --save "$out/gqa" \
    --overwrite-checkpoints >/dev/null
  "$bin/dsp-reshard" --load "$out/gqa" --save "$out/gqa_tp1" --tensor-model-parallel-size 1 --no-save-optim >/dev/null
  "$bin/dsp-generate" --load "$out/gqa_tp1" --prompt "ROMEO:" --max-new-tokens 1 2>"$out/generate_gqa.log" >/dev/null
  per_token() { sed -n 's/.*, \([0-9]*\) bytes per token.*/\1/p' "$1"; }
  echo "MLA demo: $(per_token "$out/generate_mla.log") bytes per token; GQA MoE demo: $(per_token "$out/generate_gqa.log") bytes per token"
  echo "MLA demo finished: checkpoints and metrics in $out"
  exit 0
fi

out=${DSP_DEMO_DIR:-out/demo}
mkdir -p "$out"

echo "== 1. train (TP2 x DP2, world 4) =="
start=$(date +%s)
"$bin/dsp-train" --config samples/configs/demo.json --save "$out/ckpt_tp2" --overwrite-checkpoints --metrics-file "$out/metrics.jsonl"
echo "training wall time: $(( $(date +%s) - start )) s"

echo "== 2. reshard TP2 -> TP1 and TP4 (serving checkpoints: the model without the Adam moments) =="
"$bin/dsp-reshard" --load "$out/ckpt_tp2" --save "$out/ckpt_tp1" --tensor-model-parallel-size 1 --no-save-optim
"$bin/dsp-reshard" --load "$out/ckpt_tp2" --save "$out/ckpt_tp4" --tensor-model-parallel-size 4 --no-save-optim

echo "== 3. generate at TP1 and TP4 (all prompts of a call in one batch, KV cache) =="
"$bin/dsp-generate" --load "$out/ckpt_tp1" --prompt "ROMEO:" --prompt "First Citizen:\nBefore we proceed" \
  --max-new-tokens 90 --temperature 0.8 --top-k 40 --seed 1
"$bin/dsp-generate" --load "$out/ckpt_tp4" --prompt "JULIET:" --max-new-tokens 90 --temperature 0.8 --top-k 40 \
  --top-p 0.95 --seed 7

echo "== 4. consistency: served layouts vs the training layout =="
"$bin/dsp-consistency-check" --load "$out/ckpt_tp1" --reference "$out/ckpt_tp2" --tensor-model-parallel-size 1
"$bin/dsp-consistency-check" --load "$out/ckpt_tp4" --reference "$out/ckpt_tp2" --tensor-model-parallel-size 4
echo "demo finished: checkpoints and metrics in $out"
