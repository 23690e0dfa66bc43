"""Tiny transformers models for the smelt integration tests (random weights, nothing downloads)."""

from __future__ import annotations

import math

import torch

VOCAB = 97

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

#: family -> (config class path, extra config fields)
FAMILIES = {
    "mixtral": (
        "MixtralConfig",
        dict(intermediate_size=24, num_local_experts=5, num_experts_per_tok=2),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            intermediate_size=40,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=16,
            num_experts=5,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            intermediate_size=40,
            moe_intermediate_size=24,
            num_experts=5,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        ),
    ),
    "olmoe": ("OlmoeConfig", dict(intermediate_size=24, num_experts=5, num_experts_per_tok=2)),
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(
            intermediate_size=40,
            moe_intermediate_size=24,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
            head_dim=8,
            routed_scaling_factor=1.0,
            num_key_value_heads=4,
        ),
    ),
}


def config(family: str, **overrides):
    import transformers

    cls_name, extra = FAMILIES[family]
    kw = dict(_COMMON)
    kw.update(extra)
    kw.update(overrides)
    return getattr(transformers, cls_name)(**kw)


@torch.no_grad()
def o1_init(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """O(1)-scale weights: transformers' 0.02 init makes routing near uniform and hides
    mistakes. Norm gains in [0.5, 1.5], biases N(0, 0.1), matrices N(0, 1/fan_in)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 1:
            if "norm" in name or "layernorm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        else:
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    return model


def build(family: str, seed: int = 0, **overrides):
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config(family, **overrides))
    return o1_init(model, seed).eval()


def use(model, experts: str, attn: str):
    model.set_experts_implementation(experts)
    model.set_attn_implementation(attn)
    return model


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_close_dict(a: dict, b: dict, rtol: float, atol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m: f"{k}: {m}")
