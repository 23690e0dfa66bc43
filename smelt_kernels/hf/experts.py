"""``experts_implementation="smelt"``: transformers' routed experts on :func:`moe_ffn`.

transformers 5 decorates the experts module of its MoE families with
``use_experts_implementation``; the decorated ``forward(hidden_states (T, H), top_k_index
(T, k), top_k_weights (T, k))`` looks its implementation up in ``ExpertsInterface`` by
``config._experts_implementation``. :func:`smelt_experts_forward` is registered there as
``"smelt"``: it runs :func:`smelt_kernels.moe_gemm.moe_ffn` on the module's own
``gate_up_proj`` (E, 2·d_e, H), gate rows first, and ``down_proj`` (E, H, d_e), with the
routing the model computed -- no weight copy, no re-layout, forward and backward.

A module is served when it is the plain SwiGLU form that ``moe_ffn`` computes:
gated, concatenated (gate rows, then up rows), not transposed, no biases, no post-expert
norm, not expert-parallel, SiLU on the gate, the default gate function, and an eager
``forward`` that is the standard experts loop (its bytecode equals Mixtral's, so a family
that adds a clamp or a scale inside its own loop is never taken for the plain form).
Anything else runs transformers' own eager forward with one log line saying why (once per
class and reason, on the ``smelt.hf`` logger), or raises :class:`UnsupportedExperts`
in strict mode (:func:`set_strict`, or ``SMELT_HF_STRICT=1``).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from .. import backends
from ..moe_gemm import moe_ffn

__all__ = [
    "smelt_experts_forward",
    "unsupported_reason",
    "UnsupportedExperts",
    "set_strict",
    "is_strict",
    "SUPPORTED_FAMILIES",
]

logger = logging.getLogger("smelt.hf")

#: the transformers families (model_type) whose experts pass :func:`unsupported_reason`
#: with their default config in transformers 5.23; the first five are tested end to end.
SUPPORTED_FAMILIES = (
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "deepseek_v3",
    "qwen3_next",
    "glm4_moe",
    "dots1",
    "ernie4_5_moe",
    "minimax",
    "deepseek_v2",
    "phimoe",
    "qwen3_vl_moe",
    "qwen3_5_moe",
    "glm4_moe_lite",
    "hunyuan_v1_moe",
    "jamba",
    "granitemoe",
    "granitemoeshared",
    "granitemoehybrid",
    "flex_olmo",
    "lfm2_moe",
    "minimax_m2",
    "exaone_moe",
    "afmoe",
    "kimi_linear",
    "mimo_v2_flash",
    "solar_open",
)


class UnsupportedExperts(NotImplementedError):
    """Raised in strict mode for an experts module the smelt kernel cannot serve."""


_strict: Optional[bool] = None
_logged: set[tuple[str, str]] = set()
_reasons: dict[type, Optional[str]] = {}


def set_strict(on: Optional[bool] = True) -> Optional[bool]:
    """Raise instead of falling back; ``None`` goes back to ``SMELT_HF_STRICT``.
    Returns the previous setting (pass it back to restore)."""
    global _strict
    old = _strict
    _strict = None if on is None else bool(on)
    return old


def is_strict() -> bool:
    if _strict is not None:
        return _strict
    return backends.env_flag("SMELT_HF_STRICT")


def _reference_code():
    # transformers 5.x internals: imported when used, so that another version fails in the
    # package's version check (hf.register) rather than on import
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    return MixtralExperts.forward.__wrapped__.__code__


def _same_code(a, b) -> bool:
    return (
        a.co_code == b.co_code
        and a.co_names == b.co_names
        and a.co_consts == b.co_consts
        and a.co_argcount == b.co_argcount
    )


def _is_silu(act) -> bool:
    if isinstance(act, nn.SiLU) or act is torch.nn.functional.silu:
        return True
    return type(act).__name__ == "SiLUActivation"  # transformers' own SiLU module


def _class_reason(cls: type) -> Optional[str]:
    """What in the class (not the instance) keeps the kernel from serving it."""
    from transformers.integrations.moe import _default_apply_gate  # 5.x internals, as above

    if getattr(cls, "_apply_gate", _default_apply_gate) is not _default_apply_gate:
        return "it has its own gate function (e.g. a clamped or scaled SwiGLU)"
    eager = getattr(cls.forward, "__wrapped__", None)
    if eager is None:
        return "its forward is not wrapped by use_experts_implementation"
    if not _same_code(eager.__code__, _reference_code()):
        return "its eager forward differs from the standard experts loop"
    return None


def unsupported_reason(module: nn.Module) -> Optional[str]:
    """None when ``moe_ffn`` computes exactly what ``module``'s eager forward computes,
    else a short reason."""
    flags = (
        (not getattr(module, "has_gate", True), "it has no gate (has_gate=False)"),
        (getattr(module, "has_bias", False), "it has biases"),
        (not getattr(module, "is_concatenated", True), "its gate/up rows are interleaved"),
        (getattr(module, "is_transposed", False), "its weights are stored transposed"),
        (getattr(module, "has_post_expert_norm", False), "it has a post-expert norm"),
        (getattr(module, "_is_expert_parallel", False), "it is expert-parallel (sentinel ids)"),
    )
    for bad, why in flags:
        if bad:
            return why
    cls = type(module)
    if cls not in _reasons:
        _reasons[cls] = _class_reason(cls)
    if _reasons[cls] is not None:
        return _reasons[cls]
    if not _is_silu(getattr(module, "act_fn", None)):
        act = getattr(module, "act_fn", None)
        return f"its activation is {getattr(act, '__name__', type(act).__name__)}, not SiLU"
    w1, w2 = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(w1, torch.Tensor) or not isinstance(w2, torch.Tensor):
        return "it has no gate_up_proj / down_proj tensors"
    if (
        w1.dim() != 3
        or w2.dim() != 3
        or w1.shape[1] != 2 * w2.shape[2]
        or w1.shape[2] != w2.shape[1]
        or w1.shape[0] != w2.shape[0]
    ):
        return (
            f"its weights are not (E, 2*d_e, H) and (E, H, d_e): "
            f"{tuple(w1.shape)}, {tuple(w2.shape)}"
        )
    if not w1.dtype.is_floating_point or w1.dtype != w2.dtype:
        return f"its weights are {w1.dtype} / {w2.dtype} (quantised or mixed)"
    return None


def fallback(kind: str, owner: str, reason: str) -> None:
    """Strict mode: raise. Otherwise log once per (owner, reason) that transformers' own
    path runs instead."""
    if is_strict():
        raise UnsupportedExperts(f"smelt {kind} cannot serve {owner}: {reason} (strict mode)")
    key = (owner, reason)
    if key not in _logged:
        _logged.add(key)
        logger.warning(
            "smelt %s: %s falls back to transformers' eager path: %s", kind, owner, reason
        )


def smelt_experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The ``ExpertsInterface`` entry: ``moe_ffn`` on the module's own parameters."""
    reason = unsupported_reason(self)
    if reason is not None:
        fallback("experts", type(self).__name__, reason)
        return type(self).forward.__wrapped__(self, hidden_states, top_k_index, top_k_weights)
    w1, w2 = self.gate_up_proj, self.down_proj
    x = hidden_states if hidden_states.dtype == w1.dtype else hidden_states.to(w1.dtype)
    # the ids come from the model's own top-k over E experts: in range and distinct
    y = moe_ffn(x, w1, w2, top_k_weights, top_k_index, check_values=False)
    return y.to(hidden_states.dtype)
