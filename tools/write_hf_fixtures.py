#!/usr/bin/env python3
"""Writes tests/fixtures/hf/: tiny random Hugging Face models and their logits, and an FP8
block-scaled tensor with its dequantised values, for dsp's import tests.

Run by hand (not by CI), offline, with transformers==5.25.0 and torch 2.15.0:

    ~/.cache/dsp/hf-venv/bin/python tools/write_hf_fixtures.py [OUT_DIR]

OUT_DIR defaults to tests/fixtures/hf. For each model <name> in llama, deepseek_v3, deepseek_v2:
    <name>/config.json, <name>/model.safetensors   save_pretrained (safetensors, fp32)
    <name>/logits.safetensors                      "logits" [tokens, vocab] fp32 of the forward
                                                   pass over "ids" [tokens] (token ids stored as
                                                   F32, exact: ids < 2^24)
and fp8/block_scaled.safetensors:
    "weight"            F8_E4M3 [130, 140] (its first 256 elements: every byte value, NaNs included)
    "weight_scale_inv"  F32 [2, 2]: one scale per 128 x 128 block (ceil(130/128), ceil(140/128))
    "dequantized"       F32 [130, 140]: weight.float() * scale expanded over the blocks, by torch

Models are built from config objects (no downloads), fp32, with weights redrawn at a scale that
gives logits of order 1 (so a 1e-4 comparison means something). DeepSeek routers are redrawn
(weights and, for V3, e_score_correction_bias) until, for the fixed ids, every choice the router
makes (the groups, then the experts) wins by at least MIN_MARGIN in the score it is chosen by,
asserted below: dsp's fp32 arithmetic (different summation order, ~1e-6) cannot flip a choice.
"""
import json
import os
import sys

import torch
import transformers
from safetensors.torch import save_file
from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM,
                          LlamaConfig, LlamaForCausalLM)

assert transformers.__version__ == "5.25.0", transformers.__version__

IDS = [1, 17, 42, 99, 128, 200, 255, 256, 3, 64]  # fixed prompt, 10 tokens of a 257-token vocabulary
MIN_MARGIN = 1e-3  # router scores lie in [0, 1] (sigmoid/softmax) or [0, 2] with the bias


def redraw(model, seed, std=0.15):
    """Every weight ~ N(0, std), norms ~ 1 + N(0, 0.1): logits of order 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(std * noise)


def topk_margin(scores, k):
    """Smallest gap between the k-th and (k+1)-th largest score of each row (inf when k == n)."""
    if k >= scores.shape[-1]:
        return float("inf")
    s = scores.sort(dim=-1, descending=True).values
    return float((s[:, k - 1] - s[:, k]).min())


def router_margin(gate, hidden, cfg, v3):
    """The smallest winning margin of the router's group and expert choices for `hidden`."""
    h = hidden.reshape(-1, hidden.shape[-1]).float()
    logits = h @ gate.weight.float().t()
    n, groups, per = cfg.n_routed_experts, cfg.n_group or 1, cfg.n_routed_experts // (cfg.n_group or 1)
    if v3:
        scores = logits.sigmoid() + gate.e_score_correction_bias
        group_scores = scores.view(-1, groups, per).topk(2, dim=-1).values.sum(-1)
        masked_fill = float("-inf")
    else:
        scores = logits.softmax(dim=-1)
        if cfg.topk_method == "greedy":
            return topk_margin(scores, cfg.num_experts_per_tok)
        group_scores = scores.view(-1, groups, per).max(dim=-1).values
        masked_fill = 0.0
    margin = topk_margin(group_scores, cfg.topk_group)
    chosen = group_scores.topk(cfg.topk_group, dim=-1).indices
    mask = torch.zeros_like(group_scores).scatter_(1, chosen, 1).bool()
    mask = mask.unsqueeze(-1).expand(-1, groups, per).reshape(-1, n)
    return min(margin, topk_margin(scores.masked_fill(~mask, masked_fill), cfg.num_experts_per_tok))


def pin_routers(model, cfg, v3, ids):
    """Redraws the routers until every choice wins by MIN_MARGIN; returns that margin."""
    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    assert gates, "no MoE layer"
    inputs = {}
    hooks = [g.register_forward_hook(lambda m, args, out, i=i: inputs.__setitem__(i, args[0].detach()))
             for i, g in enumerate(gates)]
    for seed in range(1000):
        gen = torch.Generator().manual_seed(10_000 + seed)
        with torch.no_grad():
            for g in gates:
                g.weight.copy_(0.4 * torch.randn(g.weight.shape, generator=gen))
                if v3:
                    g.e_score_correction_bias.copy_(0.1 * torch.randn(g.e_score_correction_bias.shape, generator=gen))
            model(torch.tensor([ids]))
        margin = min(router_margin(g, inputs[i], cfg, v3) for i, g in enumerate(gates))
        if margin >= MIN_MARGIN:
            break
    for h in hooks:
        h.remove()
    assert margin >= MIN_MARGIN, f"no router draw gives a margin of {MIN_MARGIN} (best last: {margin})"
    return margin


def write_model(out, name, model, ids):
    folder = os.path.join(out, name)
    model.save_pretrained(folder, safe_serialization=True)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float().contiguous()
    save_file({"ids": torch.tensor(ids, dtype=torch.float32), "logits": logits},
              os.path.join(folder, "logits.safetensors"), metadata={"format": "pt"})
    print(f"{name}: logits {tuple(logits.shape)}, |logits| max {logits.abs().max():.3f}")


def llama():
    cfg = LlamaConfig(vocab_size=257, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = LlamaForCausalLM(cfg).eval()
    redraw(model, 1)
    return model


def deepseek_common():
    return dict(vocab_size=257, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
                num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, qk_nope_head_dim=8,
                qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                first_k_dense_replace=1, n_group=4, topk_group=2, max_position_embeddings=128, rms_norm_eps=1e-6,
                tie_word_embeddings=False, routed_scaling_factor=2.5)


def deepseek_v3():
    cfg = DeepseekV3Config(**deepseek_common(), q_lora_rank=24, norm_topk_prob=True,
                           rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                            "original_max_position_embeddings": 32, "beta_fast": 32.0,
                                            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
    assert cfg.topk_method == "noaux_tc" if hasattr(cfg, "topk_method") else True
    model = DeepseekV3ForCausalLM(cfg).eval()
    redraw(model, 2)
    margin = pin_routers(model, cfg, True, IDS)
    print(f"deepseek_v3: router margin {margin:.4f}")
    return model


def deepseek_v2():
    cfg = DeepseekV2Config(**deepseek_common(), q_lora_rank=None, topk_method="group_limited_greedy",
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = DeepseekV2ForCausalLM(cfg).eval()
    redraw(model, 3)
    margin = pin_routers(model, cfg, False, IDS)
    print(f"deepseek_v2: router margin {margin:.4f}")
    return model


def fp8(out):
    g = torch.Generator().manual_seed(4)
    rows, cols, block = 130, 140, 128
    w = (torch.randn(rows, cols, generator=g) * 40).to(torch.float8_e4m3fn)
    bits = w.view(torch.uint8)
    bits.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)  # every e4m3fn value, both NaNs included
    scale = torch.rand(-(-rows // block), -(-cols // block), generator=g) * 0.01 + 1e-3
    expanded = scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    deq = w.float() * expanded
    folder = os.path.join(out, "fp8")
    os.makedirs(folder, exist_ok=True)
    save_file({"weight": w, "weight_scale_inv": scale.contiguous(), "dequantized": deq.contiguous()},
              os.path.join(folder, "block_scaled.safetensors"), metadata={"format": "pt"})
    print(f"fp8: weight {tuple(w.shape)}, scale {tuple(scale.shape)}")


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "hf")
    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    write_model(out, "llama", llama(), IDS)
    write_model(out, "deepseek_v3", deepseek_v3(), IDS)
    write_model(out, "deepseek_v2", deepseek_v2(), IDS)
    fp8(out)
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)
    print(f"{out}: {total} bytes")
    assert total < 2_000_000, "fixtures too large"


if __name__ == "__main__":
    main()
