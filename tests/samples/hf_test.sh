#!/usr/bin/env bash
# Hugging Face interchange end to end through the command-line programs, on the fixtures of
# tools/write_hf_fixtures.py (tests/fixtures/hf, written by transformers 5.25.0):
#  - dsp-generate --load <HF folder> --prompt-ids ... --logits-file: the Llama fixture's logits
#    equal transformers' within 1e-4 at TP1 and TP2 (fp32; od prints 9 significant digits);
#  - dsp-reshard --load <HF folder> --save ckpt --tensor-model-parallel-size 2 imports it: the
#    checkpoint's logits are the folder's, bit for bit; --merge of that checkpoint gives a folder
#    with the same logits again (the round trip HF -> dsp -> HF);
#  - dsp-generate generates from the HF folder directly; dsp-train starts from it (at TP1 and
#    TP2 x PP2, the same losses) and its checkpoint merges;
#  - DeepSeek-V3 (MLA) imported at TP2, served by the engine (latent cache, absorbed attention),
#    gives transformers' logits; so does DeepSeek-V2 at TP2 x EP2; both generate;
#  - bad input: --merge of an HF folder, a missing TP size, a
#    bad token id, a tensor of the wrong shape (file and tensor named).
# Usage: hf_test.sh BIN_DIR SOURCE_DIR
set -uo pipefail
bin=$1
fixtures=$2/tests/fixtures/hf
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
source "$(dirname "$0")/lib.sh"

# values FILE TENSOR: the F32 elements of TENSOR in the safetensors FILE, one per line
values() {
  local file=$1 name=$2 n entry offsets
  n=$(od -A n -t u8 -N 8 "$file" | tr -d ' ')
  entry=$(head -c $((8 + n)) "$file" | tail -c "$n" | grep -o "\"$name\":{[^}]*}")
  offsets=$(sed -E 's/.*"data_offsets":\[([0-9]+),([0-9]+)\].*/\1 \2/' <<<"$entry")
  set -- $offsets
  od -A n -t f4 -v -j $((8 + n + $1)) -N $(($2 - $1)) "$file" | tr -s ' ' '\n' | sed '/^$/d'
}
# max_diff A_FILE A_TENSOR B_FILE B_TENSOR: the largest |a - b| (or "count mismatch")
max_diff() {
  paste -d' ' <(values "$1" "$2") <(values "$3" "$4") | awk '
    NF != 2 { print "count mismatch"; exit }
    { d = $1 - $2; if (d < 0) d = -d; if (d > m) m = d; n++ }
    END { if (n == 0) print "empty"; else printf "%.3g\n", m }'
}
within() { awk -v d="$1" -v t="$2" 'BEGIN { exit !(d != "count mismatch" && d != "empty" && d <= t) }'; }

llama=$fixtures/llama
ids=$(values "$llama/logits.safetensors" ids | awk '{ printf "%s%d", (NR > 1 ? "," : ""), $1 }')
[ -n "$ids" ] && ok || fail "fixture ids unreadable"

for tp in 1 2; do
  "$bin/dsp-generate" --load "$llama" --tensor-model-parallel-size $tp --prompt-ids "$ids" --prompt-ids 5,6,7 \
    --logits-file "$work/hf_tp$tp.safetensors" >/dev/null 2>"$work/err" || fail "dsp-generate --logits-file TP$tp: $(cat "$work/err")"
  d=$(max_diff "$work/hf_tp$tp.safetensors" logits.0 "$llama/logits.safetensors" logits)
  within "$d" 1e-4 && ok || fail "TP$tp logits differ from transformers' by $d"
done
[ "$(values "$work/hf_tp1.safetensors" logits.1 | wc -l)" -eq $((3 * 257)) ] && ok || fail "second prompt's logits not [3, 257]"

"$bin/dsp-reshard" --load "$llama" --save "$work/ckpt" --tensor-model-parallel-size 2 >"$work/out" 2>"$work/err" \
  && grep -q "imported" "$work/out" && [ -f "$work/ckpt/manifest.json" ] && ok || fail "dsp-reshard import: $(cat "$work/err")"
"$bin/dsp-generate" --load "$work/ckpt" --prompt-ids "$ids" --prompt-ids 5,6,7 --logits-file "$work/ckpt.safetensors" \
  >/dev/null 2>&1 || fail "dsp-generate on the imported checkpoint"
d=$(max_diff "$work/ckpt.safetensors" logits.0 "$work/hf_tp2.safetensors" logits.0)
[ "$d" = 0 ] && ok || fail "imported checkpoint's logits differ from the folder's by $d"

"$bin/dsp-reshard" --load "$work/ckpt" --save "$work/merged" --merge >/dev/null 2>&1 || fail "merge of the imported checkpoint"
"$bin/dsp-generate" --load "$work/merged" --prompt-ids "$ids" --logits-file "$work/merged.safetensors" >/dev/null 2>&1 \
  || fail "dsp-generate on the merged folder"
d=$(max_diff "$work/merged.safetensors" logits.0 "$work/hf_tp1.safetensors" logits.0)
[ "$d" = 0 ] && ok || fail "merged folder's logits differ from the original's by $d"

"$bin/dsp-generate" --load "$llama" --prompt "ab" --max-new-tokens 3 --temperature 0 >"$work/out" 2>"$work/err" \
  && grep -q -- "--- 3 tokens" "$work/out" && ok || fail "dsp-generate from the HF folder: $(cat "$work/err")"

# dsp-train --load <HF folder>: its config is the model (--seq-length overrides it), its weights
# the start; TP2 x PP2 gives the TP1 losses (1e-5 relative); the first loss is not that of the
# same architecture from random weights; the result merges.
fresh=(--data-path "$2/data/tinyshakespeare.txt" --seq-length 32 --micro-batch-size 2 --global-batch-size 4 --lr 1e-3
       --train-iters 6)
train=("${fresh[@]}" --load "$llama")
"$bin/dsp-train" "${train[@]}" --metrics-file "$work/t1.jsonl" --save "$work/trained" >/dev/null 2>"$work/err"   || fail "dsp-train --load <HF folder>: $(cat "$work/err")"
"$bin/dsp-train" --world-size 4 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "${train[@]}"   --metrics-file "$work/t4.jsonl" >/dev/null 2>"$work/err" || fail "dsp-train --load <HF folder> at TP2 x PP2: $(cat "$work/err")"
same_losses "HF start at TP2 x PP2" "$work/t1.jsonl" "$work/t4.jsonl"
"$bin/dsp-train" "${fresh[@]}" --num-layers 2 --hidden-size 64 --num-attention-heads 4 --num-query-groups 2 \
  --ffn-hidden-size 96 --vocab-size 257 --untie-embeddings-and-output-weights --metrics-file "$work/t0.jsonl" \
  >/dev/null 2>&1 || fail "the same model from random weights"
[ "$(losses "$work/t1.jsonl" | head -1)" != "$(losses "$work/t0.jsonl" 2>/dev/null | head -1)" ] && ok \
  || fail "the HF weights made no difference to the first loss"
"$bin/dsp-reshard" --load "$work/trained" --save "$work/trained_hf" --merge >/dev/null 2>&1 \
  && [ -f "$work/trained_hf/model.safetensors" ] && ok || fail "merge of the model trained from the HF folder"

# DeepSeek-V3 (MLA, YaRN, noaux_tc MoE): imported at TP2, its logits equal transformers'.
"$bin/dsp-reshard" --load "$fixtures/deepseek_v3" --save "$work/v3" --tensor-model-parallel-size 2 >/dev/null \
  2>"$work/err" || fail "dsp-reshard import of DeepSeek-V3: $(cat "$work/err")"
v3_ids=$(values "$fixtures/deepseek_v3/logits.safetensors" ids | awk '{ printf "%s%d", (NR > 1 ? "," : ""), $1 }')
"$bin/dsp-generate" --load "$work/v3" --prompt-ids "$v3_ids" --logits-file "$work/v3.safetensors" >/dev/null \
  2>"$work/err" || fail "dsp-generate --logits-file on DeepSeek-V3: $(cat "$work/err")"
d=$(max_diff "$work/v3.safetensors" logits.0 "$fixtures/deepseek_v3/logits.safetensors" logits)
within "$d" 1e-4 && ok || fail "DeepSeek-V3 logits differ from transformers' by $d"
"$bin/dsp-generate" --load "$work/v3" --prompt "hi" --prompt "ROMEO:" --max-new-tokens 4 >"$work/v3_out" 2>&1 \
  && grep -q "KV cache" "$work/v3_out" && ok || fail "generation from DeepSeek-V3: $(cat "$work/v3_out")"
v2_ids=$(values "$fixtures/deepseek_v2/logits.safetensors" ids | awk '{ printf "%s%d", (NR > 1 ? "," : ""), $1 }')
"$bin/dsp-generate" --load "$fixtures/deepseek_v2" --tensor-model-parallel-size 2 --expert-parallel-size 2 \
  --prompt-ids "$v2_ids" --logits-file "$work/v2.safetensors" >/dev/null 2>"$work/err" \
  || fail "dsp-generate --logits-file on DeepSeek-V2 at TP2 x EP2: $(cat "$work/err")"
d=$(max_diff "$work/v2.safetensors" logits.0 "$fixtures/deepseek_v2/logits.safetensors" logits)
within "$d" 1e-4 && ok || fail "DeepSeek-V2 logits (TP2 x EP2) differ from transformers' by $d"
# a prompt of the model's whole context (max_position_embeddings tokens) still gives its logits
ctx=$(grep -o '"max_position_embeddings": *[0-9]*' "$fixtures/deepseek_v3/config.json" | grep -o '[0-9]*$')
long_ids=$(seq 1 "$ctx" | awk '{ printf "%s%d", (NR > 1 ? "," : ""), $1 % 200 }')
"$bin/dsp-generate" --load "$work/v3" --prompt-ids "$long_ids" --logits-file "$work/v3_long.safetensors" >/dev/null \
  2>"$work/err" && [ "$(values "$work/v3_long.safetensors" logits.0 | wc -l)" -eq $((ctx * 257)) ] && ok \
  || fail "--logits-file of a prompt of $ctx tokens (the whole context): $(cat "$work/err")"
expect_fail "merge of an HF folder" "is a Hugging Face model folder already" "$work/m2" -- \
  "$bin/dsp-reshard" --load "$llama" --save "$work/m2" --merge
expect_fail "import without a TP size" "--tensor-model-parallel-size is required" "$work/c2" -- \
  "$bin/dsp-reshard" --load "$llama" --save "$work/c2"
expect_fail "bad token id" "'257' is not a token id in [0, 257)" "$work/l.safetensors" -- \
  "$bin/dsp-generate" --load "$llama" --prompt-ids 1,257 --logits-file "$work/l.safetensors"
mkdir -p "$work/bad"
cp "$llama/config.json" "$work/bad/"
sed 's/"num_key_value_heads": 2/"num_key_value_heads": 4/' "$llama/config.json" >"$work/bad/config.json"
cp "$llama/model.safetensors" "$work/bad/"
expect_fail "wrong shape" "model.safetensors: tensor 'model.layers.0.self_attn.k_proj.weight' has shape [32, 64]" "$work/c3" -- \
  "$bin/dsp-reshard" --load "$work/bad" --save "$work/c3" --tensor-model-parallel-size 2

echo "hf_test: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
