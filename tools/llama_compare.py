#!/usr/bin/env python3
"""Greedy completions of dsp-generate and of llama-server on the same byte-level model, compared.

    tools/llama_compare.py --server http://127.0.0.1:8090 --generate build/default/samples/dsp-generate \\
        --load CKPT [--prompt TEXT ...] [--max-tokens 64] [--top 5] [--json out.json]

Each prompt is sent to llama-server's /completion as token ids (byte b = id b), temperature 0,
ignore_eos, n_predict tokens, n_probs --top (log-probabilities of the raw logits); dsp-generate
serves the same prompts greedily with --logprobs --top. Reported per prompt: whether the token
ids are equal, the first position where they differ and, there, each side's top-2 gap (a gap near
zero: a near-tie that fp32 rounding can flip), and the largest |log-probability difference| of the
tokens both sides list among their top --top, over the positions up to and including the first
difference (after it the two continue from different texts). Also checks llama.cpp's own
tokenizer of the GGUF: /tokenize (with and without special tokens) gives ids = UTF-8 bytes and
/detokenize gives the text back, for 105 strings (ASCII, white space runs, contractions, Latin,
CJK, emoji; fixed seed). Python's standard library only; requests go to the given server
(127.0.0.1), a bounded number of them (one per prompt, three per tokenizer string).
Exit status 0 when every prompt's tokens are equal and the tokenizer maps bytes to ids, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import urllib.request

DEFAULT_PROMPTS = [
    "ROMEO:",
    "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?",
    "First Citizen:\nBefore we proceed any further, hear me speak.",
    "KING RICHARD III:\nNow is the winter of our discontent",
    "\n",
    "What say you, my lord?",
]


def dsp_generate(args, prompt: str) -> dict:
    """dsp-generate's greedy tokens and top log-probabilities of one prompt."""
    if "\\n" in prompt:
        sys.exit(f"prompt {prompt!r} holds a literal \\n, which dsp-generate would read as a newline")
    cmd = [args.generate, "--load", args.load, "--prompt", prompt.replace("\n", "\\n"), "--temperature", "0",
           "--max-new-tokens", str(args.max_tokens), "--logprobs", str(args.top)]
    out = subprocess.run(cmd, check=True, capture_output=True).stdout
    for line in out.split(b"\n"):
        if line.startswith(b"--- logprobs "):
            j = json.loads(line[len(b"--- logprobs "):])
            top = [{int(i): float(lp) for i, lp in step} for step in j["top"]]
            return {"tokens": j["tokens"], "top": top}
    sys.exit(f"dsp-generate printed no logprobs line: {out[-400:]!r}")


def post(args, path: str, body: dict) -> dict:
    req = urllib.request.Request(args.server.rstrip("/") + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def check_tokenizer(args) -> int:
    """Strings whose llama.cpp tokens are not their UTF-8 bytes, or that do not decode back."""
    rng = random.Random(3)
    strings = ["ROMEO:\nBut soft!", "  x  \t\n\n  y", "I've 'RE 3.33 \u00e9t\u00e9 \u2581 \U0001F999 \u4f60\u597d",
               "".join(chr(i) for i in range(1, 0x250)), "a\x0bb"]
    for _ in range(100):
        strings.append("".join(chr(rng.choice([rng.randrange(1, 128), rng.randrange(128, 0x3000),
                                               rng.randrange(0x1F300, 0x1F600)])) for _ in range(rng.randrange(0, 40))))
    bad = 0
    for s in strings:
        ok = all(post(args, "/tokenize", {"content": s, "add_special": special})["tokens"] == list(s.encode())
                 for special in (False, True))
        ok = ok and post(args, "/detokenize", {"tokens": list(s.encode())})["content"] == s
        if not ok:
            bad += 1
            print(f"llama.cpp's tokenizer does not map {s[:40]!r} to its bytes and back")
    print(f"llama.cpp tokenizer: {len(strings) - bad} of {len(strings)} strings give ids = UTF-8 bytes and decode back")
    return bad


def llama_complete(args, prompt: str) -> dict:
    """llama-server's greedy tokens and top log-probabilities of one prompt (sent as ids)."""
    body = {"prompt": list(prompt.encode()), "n_predict": args.max_tokens, "temperature": 0, "ignore_eos": True,
            "n_probs": args.top, "cache_prompt": False, "return_tokens": True, "stream": False}
    j = post(args, "/completion", body)
    probs = j["completion_probabilities"]
    tokens = [p["id"] for p in probs]
    if j.get("tokens") and j["tokens"] != tokens:
        sys.exit(f"llama-server's tokens {j['tokens']} differ from its probabilities' ids {tokens}")
    top = [{int(t["id"]): float(t["logprob"]) for t in p["top_logprobs"]} for p in probs]
    return {"tokens": tokens, "top": top}


def gap(top: dict) -> float:
    lps = sorted(top.values(), reverse=True)
    return lps[0] - lps[1] if len(lps) > 1 else float("inf")


def compare(prompt: str, dsp: dict, llama: dict) -> dict:
    a, b = dsp["tokens"], llama["tokens"]
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if first is None and len(a) != len(b):
        first = min(len(a), len(b))
    upto = len(a) if first is None else first + 1
    max_diff, compared = 0.0, 0
    for i in range(min(upto, len(dsp["top"]), len(llama["top"]))):
        for tok, lp in dsp["top"][i].items():
            if tok in llama["top"][i]:
                max_diff = max(max_diff, abs(lp - llama["top"][i][tok]))
                compared += 1
    r = {"prompt": prompt, "tokens": len(a), "equal": first is None, "first_difference": first,
         "max_abs_logprob_diff": max_diff, "logprobs_compared": compared,
         "min_top2_gap_dsp": min((gap(t) for t in dsp["top"][:upto]), default=None)}
    if first is not None and first < min(len(dsp["top"]), len(llama["top"])):
        r["at_difference"] = {"dsp": {"token": a[first], "top2_gap": gap(dsp["top"][first]),
                                      "top": sorted(dsp["top"][first].items(), key=lambda kv: -kv[1])[:3]},
                              "llama": {"token": b[first], "top2_gap": gap(llama["top"][first]),
                                        "top": sorted(llama["top"][first].items(), key=lambda kv: -kv[1])[:3]}}
        r["dsp_text"] = bytes(a).decode(errors="replace")
        r["llama_text"] = bytes(b).decode(errors="replace")
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", required=True, help="llama-server's URL, e.g. http://127.0.0.1:8090")
    p.add_argument("--generate", required=True, help="path of dsp-generate")
    p.add_argument("--load", required=True, help="the dsp checkpoint the GGUF was converted from")
    p.add_argument("--prompt", action="append", help="prompt text (repeatable; default: six Shakespeare prompts)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--top", type=int, default=5, help="log-probabilities of the top N tokens per step")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    tokenizer_bad = check_tokenizer(args)
    results = []
    for prompt in args.prompt or DEFAULT_PROMPTS:
        r = compare(prompt, dsp_generate(args, prompt), llama_complete(args, prompt))
        results.append(r)
        status = "equal" if r["equal"] else f"differ from token {r['first_difference']}"
        print(f"{prompt[:40]!r:44} {r['tokens']:3} tokens {status:22} max |dlogprob| {r['max_abs_logprob_diff']:.2e} "
              f"over {r['logprobs_compared']} (min top-2 gap {r['min_top2_gap_dsp']:.2e})")
        if not r["equal"]:
            print("   at the difference:", json.dumps(r.get("at_difference")))
    equal = sum(r["equal"] for r in results)
    worst = max(r["max_abs_logprob_diff"] for r in results)
    print(f"{equal} of {len(results)} prompts equal; largest |log-probability difference| {worst:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    sys.exit(0 if equal == len(results) and tokenizer_bad == 0 else 1)


if __name__ == "__main__":
    main()
