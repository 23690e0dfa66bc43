"""smelt as a backend of Hugging Face transformers (5.x).

    import smelt_kernels.hf            # registers "smelt" (or call smelt_kernels.hf.register())
    model = AutoModelForCausalLM.from_config(cfg, experts_implementation="smelt",
                                             attn_implementation="smelt")
    model.set_experts_implementation("smelt"); model.set_attn_implementation("smelt")

``"smelt"`` lands in three of transformers' registries: ``ExpertsInterface``
(:mod:`.experts`: the routed SwiGLU experts on :func:`smelt_kernels.moe_gemm.moe_ffn`),
``AttentionInterface`` (:mod:`.attention`: :func:`smelt_kernels.attention.segment_attention`
with padding masks of any shape, packing, caches, windows, soft-capping and sinks) and
``AttentionMaskInterface`` (hands the 2-D padding mask to the attention function instead of
building a 4-D one). Experts the kernel cannot serve fall back to transformers' eager path,
attention cases it does not compute to transformers' sdpa, each with one log line
(``smelt.hf`` logger). :func:`set_strict` (or ``SMELT_HF_STRICT=1``) turns a fallback into
an error.

transformers is an optional dependency (``pip install -e ".[hf]"``); importing this package
without it raises an ``ImportError`` that says so.
"""

from __future__ import annotations

try:
    import transformers as _transformers
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError('smelt_kernels.hf needs transformers 5.x: pip install -e ".[hf]"') from e

from .attention import UnsupportedAttention, smelt_attention_forward, smelt_attention_mask
from .experts import (
    SUPPORTED_FAMILIES,
    UnsupportedExperts,
    is_strict,
    set_strict,
    smelt_experts_forward,
    unsupported_reason,
)

__all__ = [
    "NAME",
    "register",
    "set_strict",
    "is_strict",
    "unsupported_reason",
    "UnsupportedExperts",
    "UnsupportedAttention",
    "SUPPORTED_FAMILIES",
    "smelt_experts_forward",
    "smelt_attention_forward",
    "smelt_attention_mask",
]

NAME = "smelt"


def _check_version() -> None:
    major = int(_transformers.__version__.split(".")[0])
    if major != 5:
        raise ImportError(
            f"smelt_kernels.hf supports transformers 5.x, found {_transformers.__version__}"
        )


def register(name: str = NAME) -> str:
    """Register ``name`` (default ``"smelt"``) in transformers' experts, attention and
    attention-mask interfaces; idempotent. Returns the name."""
    _check_version()
    # names of transformers 5.x: imported after the version check, which says what is wrong
    from transformers import AttentionInterface
    from transformers.integrations.moe import ExpertsInterface
    from transformers.masking_utils import AttentionMaskInterface

    ExpertsInterface.register(name, smelt_experts_forward)
    AttentionInterface.register(name, smelt_attention_forward)
    AttentionMaskInterface.register(name, smelt_attention_mask)
    return name


register()
