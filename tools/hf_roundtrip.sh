#!/usr/bin/env bash
# hf_roundtrip.sh BIN_DIR [HF_DIR]: a Hugging Face DeepSeek model through dsp and back, checked
# by transformers (issue 33's round trip; run by hand, not by CI: it needs PyTorch).
#   1. dsp-train --load HF_DIR: 20 steps on tiny Shakespeare at TP2 x EP2 (4 thread ranks)
#   2. dsp-reshard --merge: the trained checkpoint as a Hugging Face folder
#      (DeepseekV3ForCausalLM or DeepseekV2ForCausalLM)
#   3. dsp-generate --logits-file: dsp's logits of the fixture's token ids at TP2
#   4. transformers loads the merged folder; prints max |transformers - dsp| (must be < 1e-4)
#      and how far training moved the logits from HF_DIR's (must not be ~0).
# HF_DIR defaults to tests/fixtures/hf/deepseek_v3 (its logits.safetensors holds the ids).
# Python: the venv of tools/write_hf_fixtures.py (torch 2.15.0, transformers 5.25.0), or PYTHON.
set -euo pipefail
bin=$1
root=$(cd "$(dirname "$0")/.." && pwd)
hf=${2:-$root/tests/fixtures/hf/deepseek_v3}
python=${PYTHON:-$HOME/.cache/dsp/hf-venv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$bin/dsp-train" --load "$hf" --world-size 4 --tensor-model-parallel-size 2 --expert-model-parallel-size 2 \
  --data-path "$root/data/tinyshakespeare.txt" --train-iters 20 --micro-batch-size 2 --global-batch-size 4 \
  --seq-length 32 --lr 1e-3 --eval-interval 1000 --save "$work/trained" | tail -1
"$bin/dsp-reshard" --load "$work/trained" --save "$work/merged" --merge >/dev/null
ids=$("$python" -c "from safetensors.torch import load_file as l; import sys
print(','.join(str(int(x)) for x in l(sys.argv[1])['ids']))" "$hf/logits.safetensors")
"$bin/dsp-generate" --load "$work/trained" --tensor-model-parallel-size 2 --prompt-ids "$ids" \
  --logits-file "$work/dsp.safetensors" >/dev/null
"$python" - "$hf" "$work" <<'PY'
import sys
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

hf, work = sys.argv[1], sys.argv[2]
ref = load_file(f"{hf}/logits.safetensors")
dsp = load_file(f"{work}/dsp.safetensors")["logits.0"]
model = AutoModelForCausalLM.from_pretrained(f"{work}/merged", dtype=torch.float32)
with torch.no_grad():
    out = model(ref["ids"].long().view(1, -1)).logits[0]
diff = (out - dsp).abs().max().item()
moved = (out - ref["logits"]).abs().max().item()
print(f"{type(model).__name__}: max |transformers - dsp| = {diff:.3g}; trained logits moved by {moved:.3g}")
sys.exit(0 if diff < 1e-4 and moved > 1e-3 else 1)
PY
