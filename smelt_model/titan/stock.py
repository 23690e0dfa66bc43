"""A stock torchtitan model at CPU size, for trying smelt's overrides on one machine.

``--module smelt_model.titan.stock --config qwen3_moe_tiny``: torchtitan's own qwen3 MoE
(its ``Qwen3Model``, blocks, FlexAttention, ``GroupedExperts``, all-to-all dispatcher,
state-dict adapter and ``parallelize_qwen3``) and its ``qwen3_moe_debug`` training config,
with the model narrowed from the debug flavour's 316M parameters (8 layers of 64 experts
of width 768 over dim 256) to 2 layers of 16 experts of width 64 over dim 128, so that two
CPU processes move its weights through gloo in well under a second a step. Nothing of
smelt is in it: smelt comes in through ``--override.imports`` (``docs/titan.md``).
"""

from __future__ import annotations

from torchtitan.models.common import CosSinRoPE, Embedding, Linear
from torchtitan.models.qwen3 import _build_qwen3_moe_layers, _qwen3_norm, model_registry  # noqa: PLC2701
from torchtitan.models.qwen3.config_registry import qwen3_moe_debug
from torchtitan.models.qwen3.model import Qwen3Model
from torchtitan.trainer import Trainer

__all__ = ["qwen3_moe_tiny"]


def _qwen3_moe_tiny_model() -> Qwen3Model.Config:
    dim, head_dim, vocab = 128, 32, 2048
    init = {"weight": lambda t: t.normal_(0.0, 0.02)}
    return Qwen3Model.Config(
        vocab_size=vocab,
        dim=dim,
        norm=_qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=init),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=init),
        layers=_build_qwen3_moe_layers(
            n_layers=2,
            dim=dim,
            n_heads=4,
            n_kv_heads=2,
            head_dim=head_dim,
            moe_hidden_dim=64,
            num_experts=16,
            top_k=4,
            attn_backend="flex",
            moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=4096, theta=1000000.0),
        ),
    )


def qwen3_moe_tiny() -> Trainer.Config:
    """torchtitan's ``qwen3_moe_debug`` config with the narrowed qwen3 MoE model."""
    config = qwen3_moe_debug()
    spec = model_registry("debugmodel_moe")
    spec.flavor = "moe_tiny"
    spec.model = _qwen3_moe_tiny_model()
    config.model_spec = spec
    return config
