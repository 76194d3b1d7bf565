#!/usr/bin/env python3
"""Writes tests/fixtures/router/hf_routers.json: the routers of transformers' DeepSeek-V3 and
DeepSeek-V2 models on random logits, for tests/ep/test_router_hf.cpp.

Cases (each: config fields, router logits [tokens, E] as transformers computed them, the
correction bias, and per token the chosen experts with their gate weights, sorted by expert):
  v3_noaux_tc         DeepseekV3TopkRouter: sigmoid, bias for the choice only, group score =
                      sum of the group's top-2 biased scores, norm_topk_prob, routed_scaling_factor
  v2_group_limited    DeepseekV2TopkRouter, topk_method group_limited_greedy: softmax, group score
                      = the group's best score, no renormalisation, routed_scaling_factor
  v2_greedy           DeepseekV2TopkRouter, topk_method greedy: softmax top-k over all experts
Weights, bias and hidden states are redrawn until every choice (groups and experts) wins by at
least MARGIN over the next candidate (asserted), so that fp32 rounding cannot change a choice.
Run by hand: ~/.cache/dsp/hf-venv/bin/python tools/write_router_fixture.py (transformers 5.25.0,
torch 2.15.0). Tests never run this; they read the committed file.
"""
import json
import zlib
import pathlib

import torch
import transformers
from transformers import DeepseekV2Config, DeepseekV3Config
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

assert transformers.__version__ == "5.25.0", transformers.__version__
OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "router" / "hf_routers.json"
MARGIN = 1e-3
TOKENS, HIDDEN, EXPERTS = 12, 16, 16


def margins_ok(choice_scores, k, groups, group_topk, group_score):
    """Smallest gap at the group cut and at the expert cut, per token."""
    for row in choice_scores:
        if groups > 1:
            g = group_score(row.view(groups, -1)).sort(descending=True).values
            if g[group_topk - 1] - g[group_topk] < MARGIN:
                return False
            keep = group_score(row.view(groups, -1)).topk(group_topk).indices
            mask = torch.zeros(groups, dtype=torch.bool)
            mask[keep] = True
            row = row.view(groups, -1).masked_fill(~mask[:, None], float("-inf")).view(-1)
        s = row.sort(descending=True).values
        if s[k - 1] - s[k] < MARGIN:
            return False
    return True


def case(name, router, config, score_fn, group_score, use_bias):
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    for _ in range(1000):
        with torch.no_grad():
            router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
            if use_bias:
                router.e_score_correction_bias.copy_(0.1 * torch.randn(EXPERTS, generator=gen))
            x = torch.randn(TOKENS, HIDDEN, generator=gen)
            logits, weights, indices = router(x)
            scores = score_fn(logits)
            choice = scores + (router.e_score_correction_bias if use_bias else 0)
            groups = config.n_group if name != "v2_greedy" else 1
            if margins_ok(choice, config.num_experts_per_tok, groups, config.topk_group, group_score):
                break
    else:
        raise SystemExit(f"{name}: no draw without a near tie")
    order = indices.sort(dim=-1)
    return {
        "name": name,
        "score": "sigmoid" if use_bias else "softmax",
        "topk_method": getattr(config, "topk_method", "noaux_tc"),
        "num_experts": EXPERTS,
        "top_k": config.num_experts_per_tok,
        "n_group": config.n_group,
        "topk_group": config.topk_group,
        "norm_topk_prob": bool(getattr(config, "norm_topk_prob", False)),
        "routed_scaling_factor": config.routed_scaling_factor,
        "logits": logits.flatten().tolist(),
        "bias": router.e_score_correction_bias.tolist() if use_bias else [],
        "experts": order.values.flatten().tolist(),
        "weights": weights.gather(1, order.indices).flatten().tolist(),
    }


def main():
    torch.manual_seed(0)
    cases = []
    # norm_topk_prob true only: with sigmoid scores dsp always normalises the k > 1 weights, as
    # DeepSeek's reference inference code and Megatron-Core do (transformers follows the flag).
    for name, norm in (("v3_noaux_tc", True),):
        c = DeepseekV3Config(hidden_size=HIDDEN, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=EXPERTS, num_experts_per_tok=4, n_group=4,
                             topk_group=2, norm_topk_prob=norm, routed_scaling_factor=2.5)
        cases.append(case(name, DeepseekV3TopkRouter(c), c, torch.sigmoid,
                          lambda g: g.topk(2, dim=-1).values.sum(-1), True))
    for name, method in (("v2_group_limited", "group_limited_greedy"), ("v2_greedy", "greedy")):
        c = DeepseekV2Config(hidden_size=HIDDEN, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=EXPERTS, num_experts_per_tok=3, n_group=4,
                             topk_group=2, topk_method=method, routed_scaling_factor=1.5)
        cases.append(case(name, DeepseekV2TopkRouter(c), c, lambda z: z.softmax(-1),
                          lambda g: g.max(dim=-1).values, False))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"transformers": transformers.__version__, "tokens": TOKENS, "cases": cases}) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
