#!/usr/bin/env python3
"""Writes the Megatron indexed-dataset fixtures of tests/data/ with megatron-core itself.

Everything here is produced and read back by megatron-core (pip install megatron-core torch;
written with megatron-core 0.16.1, numpy 2.4, torch from PyPI), so the C++ tests compare
against Megatron's own writer, reader, GPTDataset index builders, blending helper and split code:

  tests/data/fixtures/megatron_shakespeare.{bin,idx}  uint16 tokens: the first speeches of
      data/tinyshakespeare.txt as bytes, one sequence per line, every document (speech) ends
      with the EOD token 256 (what --append-eod does)
  tests/data/fixtures/megatron_modes.{bin,idx}        int32 tokens, multimodal (a mode byte per
      sequence), values beyond uint16 and negative
  tests/data/fixtures/megatron_expected.json          what megatron-core's IndexedDataset read
      back, GPTDataset's document/sample/shuffle indices and first samples for four configurations,
      helpers.build_blending_indices for two blends, and split ranges for six --split strings
      (null: a split Megatron builds no dataset for). The split ranges use megatron-core's
      parse_and_normalize_split and convert_split_vector_to_split_matrix; the two rounding lines
      of BlendedMegatronDatasetBuilder._build_megatron_dataset_splits (int(round(x * n))) are
      repeated here because they sit inside that method.

Run from the repository root:  python3 tools/write_megatron_fixture.py
"""
import json
import os
import sys
import tempfile
import types

import numpy
import torch
from megatron.core.datasets import helpers
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron.core.datasets.utils import Split

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "data", "fixtures")
EOD = 256


def write_shakespeare(prefix):
    text = open(os.path.join(ROOT, "data", "tinyshakespeare.txt"), "rb").read()[:2400]
    speeches = [s for s in text.split(b"\n\n") if s][:-1]  # drop the cut-off last speech
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    for speech in speeches:
        lines = speech.split(b"\n")
        for k, line in enumerate(lines):
            tokens = list(line + b"\n")
            if k == len(lines) - 1:
                tokens.append(EOD)
            builder.add_item(torch.tensor(tokens, dtype=torch.int64))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def write_modes(prefix):
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.int32, multimodal=True)
    docs = [[[1, 2, 3], [70000, -5]], [[2147483647, -2147483648, 0, 9]], [[], [7], [8, 8]]]
    for d, doc in enumerate(docs):
        for s, seq in enumerate(doc):
            builder.add_item(torch.tensor(seq, dtype=torch.int64), mode=(d + s) % 3)
        builder.end_document()
    builder.finalize(prefix + ".idx")


def read_back(prefix, multimodal):
    ds = IndexedDataset(prefix, multimodal=multimodal)
    out = {
        "dtype_code": {numpy.uint16: 8, numpy.int32: 4}[ds.index.dtype],
        "sequence_lengths": ds.sequence_lengths.tolist(),
        "sequence_pointers": ds.index.sequence_pointers.tolist(),
        "document_indices": ds.document_indices.tolist(),
        "sequences": [ds[i].tolist() if not multimodal else ds[i][0].tolist() for i in range(len(ds))],
    }
    if multimodal:
        out["sequence_modes"] = ds.index.sequence_modes.tolist()  # (IndexedDataset.sequence_modes asserts on an array in 0.16.1)
    return ds, out


def gpt_cases(ds, cache):
    tokenizer = types.SimpleNamespace(vocab_size=257, eod=EOD, pad=EOD, unique_identifiers={"class": "bytes"})
    cases = []
    n = len(ds)
    # ranges of --split 8,1,1, computed as BlendedMegatronDatasetBuilder does
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split("8,1,1"))
    ranges = [(int(round(m[0] * n)), int(round(m[1] * n))) for m in matrix]
    # (seq_length, num_samples, seed, split, drop_last_partial_validation_sequence): one epoch;
    # two epochs with a separate (small) final epoch; two epochs shuffled together; the
    # validation part keeping its last partial sample (padded with the pad token)
    for seq_length, num_samples, seed, split, drop_last in [(32, None, 1234, Split.train, True),
                                                            (16, 150, 7, Split.train, True),
                                                            (24, 150, 99, Split.train, True),
                                                            (10, 40, 3, Split.valid, False)]:
        beg, end = ranges[split.value]
        config = GPTDatasetConfig(
            random_seed=seed, sequence_length=seq_length, tokenizer=tokenizer,
            reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
            path_to_cache=cache, split="8,1,1", drop_last_partial_validation_sequence=drop_last,
        )
        gpt = GPTDataset(ds, "megatron_shakespeare", numpy.arange(beg, end, dtype=numpy.int32),
                         num_samples, split, config)
        cases.append({
            "seq_length": seq_length, "num_samples": num_samples, "seed": seed,
            "begin": beg, "end": end, "drop_last_partial_sequence": drop_last,
            # the pad token collides with EOD, so megatron-core pads with its _PAD_TOKEN_ID -1
            "pad": int(gpt._pad_token_id),
            "document_index": gpt.document_index.tolist(),
            "sample_index": gpt.sample_index.reshape(-1).tolist(),
            "shuffle_index": gpt.shuffle_index.tolist(),
            # the text of each sample before __getitem__ splits it into tokens and labels (and
            # maps pad tokens to 0 there, the loss mask already 0 for them)
            "samples": [gpt._query_document_sample_shuffle_indices(i)[0].tolist()
                        for i in range(len(gpt) if len(gpt) <= 60 else 12)],
            "getitem_tokens_0": gpt[0]["tokens"].tolist(), "getitem_labels_0": gpt[0]["labels"].tolist(),
        })
    return cases


def blend_cases():
    cases = []
    for weights, size in [([0.3, 0.7], 1000), ([0.2, 0.5, 0.3], 777)]:
        w = numpy.array(weights, dtype=numpy.float64)
        dataset_index = numpy.zeros(size, dtype=numpy.int16)
        dataset_sample_index = numpy.zeros(size, dtype=numpy.int64)
        helpers.build_blending_indices(dataset_index, dataset_sample_index, w, len(weights), size, False)
        cases.append({"weights": weights, "size": size, "dataset_index": dataset_index.tolist(),
                      "dataset_sample_index": dataset_sample_index.tolist()})
    return cases


def split_cases():
    cases = []
    for text, n in [("969,30,1", 1000), ("969,30,1", 77), ("8,1,1", 45), ("1/1/1", 10), ("99,1", 13), ("1,0,0", 5)]:
        matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(text))
        ranges = [None if m is None else [int(round(m[0] * n)), int(round(m[1] * n))] for m in matrix]
        cases.append({"split": text, "num_elements": n, "ranges": ranges})
    return cases


def main():
    os.makedirs(OUT, exist_ok=True)
    shakespeare = os.path.join(OUT, "megatron_shakespeare")
    modes = os.path.join(OUT, "megatron_modes")
    write_shakespeare(shakespeare)
    write_modes(modes)
    ds, expected_shakespeare = read_back(shakespeare, False)
    _, expected_modes = read_back(modes, True)
    with tempfile.TemporaryDirectory() as cache:
        gpt = gpt_cases(ds, cache)
    expected = {"eod": EOD, "shakespeare": expected_shakespeare, "modes": expected_modes, "gpt": gpt,
                "blend": blend_cases(), "split": split_cases()}
    with open(os.path.join(OUT, "megatron_expected.json"), "w") as f:
        json.dump(expected, f, separators=(",", ":"))
        f.write("\n")
    print("wrote", OUT, file=sys.stderr)


if __name__ == "__main__":
    main()
