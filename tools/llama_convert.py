#!/usr/bin/env python3
"""Runs llama.cpp's convert_hf_to_gguf.py on a merged dsp checkpoint (tools/llama_server.sh convert).

    llama_convert.py LLAMA_CPP_DIR MERGED_DIR [converter arguments, e.g. --outtype f32 --outfile m.gguf]

A model without dsp's byte-level tokenizer is converted by the converter as it is. For a byte
model (dsp-reshard --merge writes tokenizer.json: GPT-2's byte alphabet, byte b = id b, no
merges, a ByteLevel pre-tokenizer) two things stop the converter, and this script changes only
those, only for such a tokenizer:

1. The converter names llama.cpp's pre-tokenizer by hashing the ids its tokenizer gives a test
   text, against a list of known models. Without merges the ids are the text's bytes whatever
   the pre-tokenizer splits, so the hash is new and the converter refuses it. The tokenizer's
   pre-tokenizer is GPT-2's ByteLevel split, which llama.cpp calls "gpt-2", so "gpt-2" is written
   (the choice cannot change an id: with no merges every byte is its own token).
2. llama.cpp refuses a GPT-2 BPE vocabulary without the key tokenizer.ggml.merges, and gguf-py
   cannot write an empty array. One merge is written whose two sides are not in the byte
   alphabet ("<dsp:no-merges>"), so it can never apply: no pair of symbols of any text is it.

Everything else (tensors, hyper-parameters, special tokens, the vocabulary itself) is the
converter's own work. The GGUF is then checked: 256/257 tokens, token i is byte i in GPT-2's
alphabet, the pre-tokenizer "gpt-2", no BOS added.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

NO_MERGES_SENTINEL = "<dsp:no-merges> <dsp:no-merges>"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: the printable bytes as themselves, the others as U+0100 + n."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def is_dsp_byte_tokenizer(model_dir: Path) -> bool:
    """Whether model_dir/tokenizer.json is dsp's byte-level tokenizer (byte_tokenizer_json.hpp)."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return False
    spec = json.loads(path.read_text(encoding="utf-8"))
    model = spec.get("model") or {}
    pre = spec.get("pre_tokenizer") or {}
    alphabet = bytes_to_unicode()
    return (
        model.get("type") == "BPE"
        and not model.get("merges")
        and model.get("vocab") == {alphabet[b]: b for b in range(256)}
        and pre.get("type") == "ByteLevel"
        and not pre.get("add_prefix_space", False)
        and all(t.get("id") == 256 and t.get("content") == "<|endoftext|>" for t in spec.get("added_tokens") or [])
    )


def check_gguf(path: Path, gguf) -> None:
    """Reads the written GGUF back: the byte vocabulary as the converter wrote it."""
    reader = gguf.GGUFReader(path)
    fields = reader.fields

    def value(key):
        return fields[key].contents() if key in fields else None

    tokens = value("tokenizer.ggml.tokens")
    alphabet = bytes_to_unicode()
    assert value("tokenizer.ggml.model") == "gpt2", value("tokenizer.ggml.model")
    assert value("tokenizer.ggml.pre") == "gpt-2", value("tokenizer.ggml.pre")
    assert len(tokens) in (256, 257), len(tokens)
    assert all(tokens[b] == alphabet[b] for b in range(256)), "token i is not byte i"
    assert value("tokenizer.ggml.add_bos_token") in (None, False), "a BOS would be added"
    assert value("tokenizer.ggml.merges") == [NO_MERGES_SENTINEL], value("tokenizer.ggml.merges")
    keys = ("general.architecture", "llama.vocab_size", "llama.context_length", "llama.embedding_length",
            "llama.block_count", "llama.feed_forward_length", "llama.attention.head_count",
            "llama.attention.head_count_kv", "llama.rope.freq_base", "llama.attention.layer_norm_rms_epsilon",
            "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.bos_token_id",
            "tokenizer.ggml.eos_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token")
    summary = {k: value(k) for k in keys if k in fields}
    summary["tensors"] = len(reader.tensors)
    summary["output.weight (untied lm_head)"] = any(t.name == "output.weight" for t in reader.tensors)
    print("GGUF metadata:", json.dumps(summary))


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    llama_dir, model_dir, rest = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    sys.path.insert(0, str(llama_dir))
    sys.argv = [str(llama_dir / "convert_hf_to_gguf.py"), str(model_dir), *rest]
    import convert_hf_to_gguf as converter  # puts the bundled gguf-py first on sys.path
    import gguf
    from conversion.base import TextModel

    byte_model = is_dsp_byte_tokenizer(model_dir)
    if byte_model:
        print(f"llama_convert: {model_dir}/tokenizer.json is dsp's byte-level tokenizer: "
              "pre-tokenizer 'gpt-2', an inert merge (see tools/llama_convert.py; gguf.vocab's warning "
              "'no merges found' below is expected)")
        vocab_base_pre = TextModel.get_vocab_base_pre

        def get_vocab_base_pre(self, tokenizer):
            return "gpt-2" if Path(self.dir_model) == model_dir else vocab_base_pre(self, tokenizer)

        TextModel.get_vocab_base_pre = get_vocab_base_pre
        add_to_gguf = gguf.SpecialVocab.add_to_gguf

        def add_to_gguf_with_merges(self, gw, quiet: bool = False):
            add_to_gguf(self, gw, quiet)
            if self.load_merges and not self.merges:
                gw.add_token_merges([NO_MERGES_SENTINEL])

        gguf.SpecialVocab.add_to_gguf = add_to_gguf_with_merges

    converter.main()
    if byte_model:
        args = converter.parse_args()
        if args.outfile is not None and "{" not in str(args.outfile):
            check_gguf(args.outfile, gguf)


if __name__ == "__main__":
    main()
