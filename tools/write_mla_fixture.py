#!/usr/bin/env python3
"""Writes the Multi-head Latent Attention fixture of tests/model/test_yarn.cpp and
tests/model/test_mla_attention.cpp (tests/fixtures/mla/mla.json).

With transformers 5.25 (pip install torch transformers; CPU, fp32, eager attention):
  rope      YaRN frequencies and attention factor of a DeepSeek rope_parameters dict
            (ROPE_INIT_FUNCTIONS["yarn"]), the softmax scale (yarn_apply_mscale), and a batch of
            rotary slices rotated by DeepseekV2's apply_rotary_emb (interleaved pairs, in place)
            at far-apart positions.
  v3, v2    a DeepseekV3Attention (q_lora_rank set, rope_interleave, YaRN with mscale !=
            mscale_all_dim) and a DeepseekV2Attention (q_lora_rank null as in V2-Lite, YaRN as
            V2-Lite configures it) with random weights: every weight by its Hugging Face name
            ([out, in]), the hidden states [batch, seq, hidden], position ids 0..seq-1, a causal
            mask, and the output [batch, seq, hidden].
Run from anywhere with the venv: python tools/write_mla_fixture.py. Tests never run this; they
read the committed file.
"""
import json
import pathlib

import torch
from transformers import DeepseekV2Config, DeepseekV3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, yarn_apply_mscale
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "mla" / "mla.json"

BATCH, SEQ = 2, 7
COMMON = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
              qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=163840,
              attention_bias=False, attention_dropout=0.0, vocab_size=64, num_hidden_layers=1,
              intermediate_size=64, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
              rms_norm_eps=1e-6)
YARN_V3 = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
               beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.8)
YARN_V2 = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
               beta_fast=32.0, beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707)


def flat(t):
    return [float(v) for v in t.detach().to(torch.float32).reshape(-1).tolist()]


def causal_mask():
    m = torch.full((SEQ, SEQ), float("-inf")).triu(1)
    return m[None, None].expand(BATCH, 1, SEQ, SEQ)


def attention_case(config, module, rotary, name):
    config._attn_implementation = "eager"
    attn = module(config, layer_idx=0).eval()
    gen = torch.Generator().manual_seed(1234 if name == "v3" else 4321)
    with torch.no_grad():
        for p in attn.parameters():
            if p.dim() == 1:  # the RMSNorm weights: away from 1 so that they matter
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
    hidden = torch.randn(BATCH, SEQ, config.hidden_size, generator=gen)
    position_ids = torch.arange(SEQ)[None].expand(BATCH, SEQ)
    with torch.no_grad():
        emb = rotary(config)(hidden, position_ids)
        if name == "v3":
            out, _ = attn(hidden, position_embeddings=emb, attention_mask=causal_mask())
        else:
            out, _ = attn(hidden, attention_mask=causal_mask(), position_embeddings=emb)
    rp = config.rope_parameters
    return {
        "config": {k: (getattr(config, k)) for k in ("hidden_size", "num_attention_heads", "q_lora_rank",
                                                    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                                    "v_head_dim", "max_position_embeddings", "rms_norm_eps")}
        | {"rope_parameters": {k: rp[k] for k in YARN_V3}},
        "scaling": attn.scaling,
        "weights": {n: {"shape": list(p.shape), "values": flat(p)} for n, p in attn.named_parameters()},
        "batch": BATCH, "seq": SEQ,
        "position_ids": flat(position_ids[0]),
        "hidden_states": flat(hidden),
        "output": flat(out),
    }


def rope_case():
    config = DeepseekV3Config(**COMMON, q_lora_rank=16, rope_parameters=dict(YARN_V3), rope_interleave=True)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    positions = torch.tensor([0, 1, 5, 100, 3000, 20000, 163839])
    heads, dim = 3, config.qk_rope_head_dim
    x = torch.randn(1, heads, len(positions), dim, generator=torch.Generator().manual_seed(99))
    freqs = positions[:, None].float() * inv_freq[None, :].float()
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs) * attention_factor
    y, _ = v2.apply_rotary_emb(x, x, freqs_cis[None])
    return {
        "dim": dim, "rope_parameters": YARN_V3, "inv_freq": flat(inv_freq), "attention_factor": attention_factor,
        "softmax_scale_qk16": yarn_apply_mscale(config.rope_parameters, 16 ** -0.5),
        "positions": positions.tolist(), "heads": heads,
        # [tokens, heads, dim] (the tensors are [1, heads, tokens, dim])
        "x": flat(x[0].transpose(0, 1)), "y": flat(y[0].transpose(0, 1)),
    }


def main():
    torch.manual_seed(0)
    cfg3 = DeepseekV3Config(**COMMON, q_lora_rank=16, rope_parameters=dict(YARN_V3), rope_interleave=True)
    cfg2 = DeepseekV2Config(**COMMON, q_lora_rank=None, rope_parameters=dict(YARN_V2))
    fixture = {
        "transformers": __import__("transformers").__version__,
        "rope": rope_case(),
        "v3": attention_case(cfg3, v3.DeepseekV3Attention, v3.DeepseekV3RotaryEmbedding, "v3"),
        "v2": attention_case(cfg2, v2.DeepseekV2Attention, v2.DeepseekV2RotaryEmbedding, "v2"),
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(fixture, indent=None, separators=(",", ":")) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
