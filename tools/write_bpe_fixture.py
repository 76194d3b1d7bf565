#!/usr/bin/env python3
"""Writes the byte-level BPE fixture of tests/data/test_bpe_tokenizer.cpp.

Trains a small byte-level BPE (Hugging Face `tokenizers`, pip install tokenizers) on
data/tinyshakespeare.txt and writes, under tests/data/fixtures/shakespeare_bpe/:
  tokenizer.json   the trained tokenizer (ByteLevel pre-tokenizer and decoder,
                   special token <|endoftext|>)
  corpus_ids.u16.gz  the ids of encoding the whole corpus as one string, uint16
                   little-endian, gzip (mtime 0, so reruns give the same bytes)
  cases.json       special-case strings and their ids, with add_prefix_space false
                   ("ids") and true ("ids_prefix_space")
Run from anywhere: python3 tools/write_bpe_fixture.py [--vocab-size N]
Tests never run this; they read the committed files.
"""
import argparse
import gzip
import json
import pathlib
import struct

import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = pathlib.Path(__file__).resolve().parent.parent
CORPUS = ROOT / "data" / "tinyshakespeare.txt"
OUT = ROOT / "tests" / "data" / "fixtures" / "shakespeare_bpe"

CASES = [
    "",
    "<|endoftext|>",
    "<|endoftext|><|endoftext|>",
    "Hello world<|endoftext|>Second document",
    "text<|endoftext|>",
    " <|endoftext|> ",
    "<|endoftext|>hello",
    "<|endoftext",
    "  leading spaces",
    "trailing spaces   ",
    "\n\n\nnew lines\n\n",
    "a\tb\r\nc \t \n d",
    "   ",
    " ",
    "x",
    "digits 12345 and 3.14159, 1,000,000 and 0x1F",
    "punctuation!!! ?? ... --- (parens) [brackets] {braces} 'quoted' \"double\" @#$%^&*",
    "it's I'm you're we've they'll he'd don't 'S 'T 'tis o'er ''s !!'s",
    "ROMEO:\nWhat's this? A man's\n\nJULIET:\nAy, me!",
    "caf\u00e9 na\u00efve \u00dcn\u00efc\u00f6d\u00e9 \u00bd \u00b2 \u00b5 \u00aa \u00bf\u00a1 \u00d7\u00f7",
    "emoji \U0001F600\U0001F44D\U0001F3FD ok \u2764\ufe0f",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 \ud55c\uad6d\uc5b4",
    "\u03a9\u03bc\u03ad\u03b3\u03b1 \u041f\u0440\u0438\u0432\u0435\u0442 \u0645\u0631\u062d\u0628\u0627 \u0661\u0662\u0663",
    "nbsp\u00a0here\u2003em\u3000ideographic \u2028line",
    "a" * 300,
    "abc" * 100 + " " + "!" * 50,
    "Mixed123numbers456 and_underscores __init__",
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=2000)
    args = parser.parse_args()

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(CORPUS)], trainer)

    OUT.mkdir(parents=True, exist_ok=True)
    tok.save(str(OUT / "tokenizer.json"), pretty=True)
    tok = Tokenizer.from_file(str(OUT / "tokenizer.json"))  # encode with what was saved

    spec = json.loads((OUT / "tokenizer.json").read_text(encoding="utf-8"))
    spec["pre_tokenizer"]["add_prefix_space"] = True
    tok_prefix = Tokenizer.from_str(json.dumps(spec))

    text = CORPUS.read_text(encoding="utf-8")
    ids = tok.encode(text, add_special_tokens=False).ids
    assert max(ids) < 65536
    assert tok.decode(ids, skip_special_tokens=False) == text
    with open(OUT / "corpus_ids.u16.gz", "wb") as raw:
        with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, compresslevel=9) as f:
            f.write(struct.pack("<%dH" % len(ids), *ids))

    cases = []
    for s in CASES:
        cases.append({
            "text": s,
            "ids": tok.encode(s, add_special_tokens=False).ids,
            "ids_prefix_space": tok_prefix.encode(s, add_special_tokens=False).ids,
        })
    meta = {
        "source": "tools/write_bpe_fixture.py",
        "tokenizers_version": tokenizers.__version__,
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "corpus_tokens": len(ids),
        "cases": cases,
    }
    (OUT / "cases.json").write_text(json.dumps(meta, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"vocab {meta['vocab_size']}, corpus {len(text)} chars -> {len(ids)} tokens")


if __name__ == "__main__":
    main()
