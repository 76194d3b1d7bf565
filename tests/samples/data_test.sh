#!/usr/bin/env bash
# dsp-preprocess-data and dsp-train on Megatron indexed datasets, end to end:
#  - the byte tokenizer with --append-eod writes each JSON line's text as its bytes and the EOD
#    256 (uint16 tokens, compared with od's reading of the text); two --json-keys give two
#    datasets; the Hugging Face BPE tokenizer writes the ids the `tokenizers` package gave for the
#    whole corpus (tests/data/fixtures/shakespeare_bpe/corpus_ids.u16.gz, byte for byte);
#  - the dataset megatron-core's IndexedDatasetBuilder wrote (tests/data/fixtures/
#    megatron_shakespeare) trains: the loss falls, the validation loss is reported;
#  - a blend "0.3 A 0.7 B" with --eod-mask-loss --reset-position-ids --reset-attention-mask
#    trains at TP2 x DP2 with the world-1 losses (1e-5 relative), and a run stopped at step 3
#    resumes with exactly the uninterrupted losses;
#  - a blend in a --config file resolves its prefixes against the file's folder;
#  - a raw text file still trains as before; bad input: a clear message and a non-zero exit.
# Usage: data_test.sh BIN_DIR REPO_DIR
set -uo pipefail
bin=$1
repo=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
source "$(dirname "$0")/lib.sh"
corpus=$repo/data/tinyshakespeare.txt
fixtures=$repo/tests/data/fixtures

# JSON lines from the corpus: one document per speech (paragraph), its text and its first line.
awk 'BEGIN { RS = "" }
     function esc(s) { gsub(/\\/, "\\\\", s); gsub(/"/, "\\\"", s); gsub(/\t/, "\\t", s); gsub(/\n/, "\\n", s); return s }
     { split($0, l, "\n"); printf "{\"text\": \"%s\\n\", \"speaker\": \"%s\"}\n", esc($0), esc(l[1]) }' \
  "$corpus" > "$work/speeches.jsonl"
docs=$(wc -l < "$work/speeches.jsonl")

"$bin/dsp-preprocess-data" --input "$work/speeches.jsonl" --json-keys text speaker --append-eod --workers 2 \
  --output-prefix "$work/ds/speeches" > "$work/pre.out" || fail "dsp-preprocess-data (bytes): $(cat "$work/pre.out")"
grep -q "$docs documents" "$work/pre.out" && ok || fail "documents counted: $(cat "$work/pre.out")"
# the expected tokens: each speech's bytes and "\n", then the EOD (a NUL byte here, 256 below)
awk 'BEGIN { RS = ""; ORS = "" } { print $0 "\n"; printf "%c", 0 }' "$corpus" | od -An -v -tu1 | tr -s ' ' '\n' \
  | sed '/^$/d; s/^0$/256/' > "$work/want_tokens"
od -An -v -tu2 --endian=little "$work/ds/speeches_text_document.bin" | tr -s ' ' '\n' | sed '/^$/d' > "$work/got_tokens"
cmp -s "$work/want_tokens" "$work/got_tokens" && ok \
  || fail "byte tokens differ from the text: $(diff "$work/want_tokens" "$work/got_tokens" | head -n 4)"
[ -s "$work/ds/speeches_speaker_document.bin" ] && [ -s "$work/ds/speeches_speaker_document.idx" ] && ok \
  || fail "--json-keys speaker wrote no dataset"

# the whole corpus as one document, BPE: the ids of the `tokenizers` package
printf '{"text": "%s"}\n' "$(sed -z 's/\\/\\\\/g; s/"/\\"/g; s/\t/\\t/g; s/\n/\\n/g' "$corpus")" > "$work/corpus.jsonl"
"$bin/dsp-preprocess-data" --input "$work/corpus.jsonl" --output-prefix "$work/ds/bpe" \
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$fixtures/shakespeare_bpe/tokenizer.json" >/dev/null \
  || fail "dsp-preprocess-data (BPE)"
zcat "$fixtures/shakespeare_bpe/corpus_ids.u16.gz" > "$work/want_bpe"
cmp -s "$work/want_bpe" "$work/ds/bpe_text_document.bin" && ok || fail "BPE ids differ from those of tokenizers"

# --- training on Megatron datasets ---------------------------------------------------------
model=(--num-layers 2 --hidden-size 32 --num-attention-heads 4 --ffn-hidden-size 64 --seq-length 32
       --micro-batch-size 2 --global-batch-size 4 --lr 3e-3 --peak-flops 1e10)
"$bin/dsp-train" --data-path "$fixtures/megatron_shakespeare" --split 8,1,1 "${model[@]}" --train-iters 30 \
  --eval-interval 30 --eval-iters 1 --metrics-file "$work/fixture.jsonl" > "$work/fixture.out" \
  || fail "training on megatron-core's dataset: $(cat "$work/fixture.out")"
grep -q "Megatron indexed datasets, 120 training and 4 validation samples of 32 tokens, vocabulary 257" \
  "$work/fixture.out" && ok || fail "data line: $(grep '^data' "$work/fixture.out")"
first=$(losses "$work/fixture.jsonl" | head -n 1 | cut -d' ' -f2)
last=$(losses "$work/fixture.jsonl" | tail -n 1 | cut -d' ' -f2)
awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a - 0.5) }' && grep -q '"val_loss":[0-9]' "$work/fixture.jsonl" \
  && ok || fail "megatron-core's dataset: the loss went from $first to $last"

data=(--data-path 0.3 "$fixtures/megatron_shakespeare" 0.7 "$work/ds/speeches_text_document" --split 90,9,1)
blend=("${data[@]}" --eod-mask-loss --reset-position-ids --reset-attention-mask "${model[@]}" --train-iters 6)
"$bin/dsp-train" "${blend[@]}" --metrics-file "$work/blend1.jsonl" >/dev/null || fail "blend, world 1"
"$bin/dsp-train" --world-size 4 --tensor-model-parallel-size 2 "${blend[@]}" --metrics-file "$work/blend4.jsonl" \
  >/dev/null || fail "blend, TP2 x DP2"
same_losses "blend with document masks at TP2 x DP2" "$work/blend1.jsonl" "$work/blend4.jsonl"
# the masks change the losses (they are applied), and the same data without them trains too
"$bin/dsp-train" "${data[@]}" "${model[@]}" --train-iters 6 --metrics-file "$work/plain.jsonl" >/dev/null \
  || fail "blend without masks"
[ "$(losses "$work/plain.jsonl")" != "$(losses "$work/blend1.jsonl")" ] && ok || fail "document masks changed nothing"
"$bin/dsp-train" "${blend[@]}" --metrics-file "$work/part.jsonl" --exit-interval 3 --save "$work/ckpt" >/dev/null \
  || fail "blend, first half"
"$bin/dsp-train" "${blend[@]}" --metrics-file "$work/part.jsonl" --load "$work/ckpt" >/dev/null \
  || fail "blend, resumed half"
exact_losses "blend stopped at step 3 and resumed" "$work/blend1.jsonl" "$work/part.jsonl"

# a blend in a --config file: its relative prefixes resolve against the file's folder (a folder
# named like a number included); the weights stay numbers
mkdir -p "$work/cfg/2024"
cp "$fixtures/megatron_shakespeare".* "$work/cfg/2024/"
cp "$fixtures/megatron_shakespeare".* "$work/cfg/"
printf '{"data-path": [0.3, "megatron_shakespeare", 0.7, "2024/megatron_shakespeare"], "split": "8,1,1"}\n' \
  > "$work/cfg/c.json"
(cd "$work" && "$bin/dsp-train" --config cfg/c.json "${model[@]}" --train-iters 2 > "$work/cfg.out" 2>&1) \
  && grep -q "Megatron indexed datasets" "$work/cfg.out" && ok || fail "blend in a config file: $(cat "$work/cfg.out")"

# a raw text file still trains (bytes, vocabulary 256)
"$bin/dsp-train" --data-path "$corpus" "${model[@]}" --train-iters 2 > "$work/text.out" \
  && grep -q "text file (bytes), .* vocabulary 256" "$work/text.out" && ok || fail "raw text: $(cat "$work/text.out")"

# --- bad input -----------------------------------------------------------------------------
expect_fail "blend naming a missing prefix" "$work/nope" "" -- \
  "$bin/dsp-train" --data-path 0.5 "$fixtures/megatron_shakespeare" 0.5 "$work/nope" "${model[@]}"
expect_fail "odd blend" "WEIGHT PREFIX" "" -- \
  "$bin/dsp-train" --data-path 0.5 "$fixtures/megatron_shakespeare" "$fixtures/megatron_shakespeare" "${model[@]}"
expect_fail "--split without validation" "gives the validation part no weight" "" -- \
  "$bin/dsp-train" --data-path "$fixtures/megatron_shakespeare" --split 100,0,0 "${model[@]}"
expect_fail "--vocab-size below the tokenizer's" "--vocab-size 256 is below the tokenizer's 257 ids" "" -- \
  "$bin/dsp-train" --data-path "$fixtures/megatron_shakespeare" --vocab-size 256 "${model[@]}"
expect_fail "BPE without its file" "needs --tokenizer-model" "" -- \
  "$bin/dsp-preprocess-data" --input "$work/corpus.jsonl" --output-prefix "$work/x" --tokenizer-type HuggingFaceTokenizer
expect_fail "a dataset's .bin as --data-path" "give its prefix '$fixtures/megatron_shakespeare'" "" -- \
  "$bin/dsp-train" --data-path "$fixtures/megatron_shakespeare.bin" "${model[@]}"
expect_fail "document masks on a text file" "the text file '$corpus' has none" "" -- \
  "$bin/dsp-train" --data-path "$corpus" --reset-attention-mask "${model[@]}"
expect_fail "a tokenizer with a text file" "apply to Megatron datasets" "" -- \
  "$bin/dsp-train" --data-path "$corpus" --tokenizer-type HuggingFaceTokenizer \
  --tokenizer-model "$fixtures/shakespeare_bpe/tokenizer.json" "${model[@]}"
expect_fail "a seed numpy refuses" "is over 2^32 - 1" "" -- \
  "$bin/dsp-train" --data-path "$fixtures/megatron_shakespeare" --seed 4294967296 "${model[@]}"
expect_fail "a key twice" "--json-keys names 'text' twice" "" -- \
  "$bin/dsp-preprocess-data" --input "$work/corpus.jsonl" --json-keys text text --output-prefix "$work/twice"
printf '{"text": "a"}\n\n{"title": "b"}\n' > "$work/bad.jsonl"
expect_fail "a line without the key" "bad.jsonl:3: no key \"text\"" "$work/bad_text_document.bin" -- \
  "$bin/dsp-preprocess-data" --input "$work/bad.jsonl" --output-prefix "$work/bad"
printf '{"text": "a"}\nnot json\n' > "$work/bad2.jsonl"
expect_fail "a line that is not JSON" "bad2.jsonl:2: not a JSON object" "$work/bad2_text_document.idx" -- \
  "$bin/dsp-preprocess-data" --input "$work/bad2.jsonl" --output-prefix "$work/bad2"

echo "data: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
