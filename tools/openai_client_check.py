#!/usr/bin/env python3
"""Speaks to a running dsp-serve with the official `openai` Python client (pip install openai).

Streams a completion and a chat completion, asks for the same ones whole, and checks that the
streamed text equals the whole text, token counts and finish reasons included; with --load it
also checks that the greedy completion equals dsp-generate's for the same prompt. Exits 1 on
any difference. Run by hand (the CI test of the server, tests/samples/serve_test.sh, uses curl):

    build/default/samples/dsp-serve --model out/demo/ckpt_tp2 --served-model-name demo &
    python3 tools/openai_client_check.py --base-url http://127.0.0.1:8000/v1 --model demo \
        --load out/demo/ckpt_tp2 --dsp-generate build/default/samples/dsp-generate
"""
import argparse
import subprocess
import sys

import openai


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default="demo")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--prompt", default="ROMEO:\nBut soft, what light")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--load", help="checkpoint dsp-serve serves: compare the greedy text with dsp-generate's")
    ap.add_argument("--dsp-generate", default="build/default/samples/dsp-generate")
    ap.add_argument("--tensor-parallel-size", type=int, default=0, help="dsp-generate's TP (0: the checkpoint's)")
    args = ap.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
    failures = 0

    def check(name: str, ok: bool, detail: str = "") -> None:
        nonlocal failures
        print(("ok    " if ok else "FAIL  ") + name + ("" if ok else f": {detail}"))
        failures += 0 if ok else 1

    models = [m.id for m in client.models.list()]
    check("GET /v1/models lists the model", args.model in models, str(models))

    for label, sampling in (("greedy", {"temperature": 0}), ("sampled", {"temperature": 0.8, "seed": 1234})):
        whole = client.completions.create(model=args.model, prompt=args.prompt, max_tokens=args.max_tokens, **sampling)
        pieces, usage, finish = [], None, None
        stream = client.completions.create(model=args.model, prompt=args.prompt, max_tokens=args.max_tokens,
                                           stream=True, stream_options={"include_usage": True}, **sampling)
        for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            for c in chunk.choices:
                pieces.append(c.text)
                finish = c.finish_reason or finish
        check(f"completion ({label}): streamed text == whole text", "".join(pieces) == whole.choices[0].text,
              f"{''.join(pieces)!r} vs {whole.choices[0].text!r}")
        check(f"completion ({label}): usage and finish_reason", usage is not None and
              usage.completion_tokens == whole.usage.completion_tokens == args.max_tokens and
              finish == whole.choices[0].finish_reason == "length", f"{usage} {finish}")
        if label == "greedy":
            greedy_text = whole.choices[0].text

    messages = [{"role": "system", "content": "Thou art Juliet."}, {"role": "user", "content": "Where art thou?"}]
    whole = client.chat.completions.create(model=args.model, messages=messages, max_tokens=args.max_tokens, temperature=0)
    pieces, role = [], None
    for chunk in client.chat.completions.create(model=args.model, messages=messages, max_tokens=args.max_tokens,
                                                temperature=0, stream=True):
        for c in chunk.choices:
            role = role or c.delta.role
            pieces.append(c.delta.content or "")
    check("chat: streamed text == whole text", "".join(pieces) == whole.choices[0].message.content,
          f"{''.join(pieces)!r} vs {whole.choices[0].message.content!r}")
    check("chat: role assistant", role == "assistant" and whole.choices[0].message.role == "assistant", str(role))

    try:
        client.completions.create(model=args.model, prompt=args.prompt, max_tokens=10_000)
        check("over-long request is refused", False, "no error")
    except openai.BadRequestError as e:
        check("over-long request: 400 with OpenAI's error", e.status_code == 400 and "maximum context length" in str(e), str(e))

    if args.load:
        cmd = [args.dsp_generate, "--load", args.load, "--prompt", args.prompt.replace("\n", "\\n"),
               "--max-new-tokens", str(args.max_tokens)]
        if args.tensor_parallel_size:
            cmd += ["--tensor-model-parallel-size", str(args.tensor_parallel_size)]
        out = subprocess.run(cmd, capture_output=True, check=True).stdout.decode("utf-8", "replace")
        body = out.split("\n", 1)[1]
        generated = body[len(args.prompt):body.rindex("\n--- ")]
        check("greedy completion == dsp-generate's", generated == greedy_text, f"{greedy_text!r} vs {generated!r}")

    print(f"{'all checks passed' if failures == 0 else f'{failures} checks failed'} (openai {openai.__version__})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
