"""``experts_implementation="smelt"``: transformers' routed experts on smelt's MoE kernels.

transformers 5 decorates the experts module of its MoE families with
``use_experts_implementation``; the decorated ``forward(hidden_states (T, H), top_k_index
(T, k), top_k_weights (T, k))`` looks its implementation up in ``ExpertsInterface`` by
``config._experts_implementation``. :func:`smelt_experts_forward` is registered there as
``"smelt"`` and computes what the module's own eager forward computes, on the module's own
parameters and the routing the model computed, forward and backward:

* the plain SwiGLU form runs :func:`smelt_kernels.moe_gemm.moe_ffn` (the fused kernel) on
  ``gate_up_proj`` (E, 2·d_e, H), gate rows first, and ``down_proj`` (E, H, d_e) -- no
  weight copy, no re-layout. Plain: the standard experts loop (its eager forward has the
  bytecode of Mixtral's), SiLU, gated, concatenated, not transposed, no biases, no
  post-expert norm.
* the other recognised forms run :func:`smelt_kernels.hf.expert_forms.composed_forward`:
  two :func:`smelt_kernels.moe_gemm.grouped_gemm` calls with the biases, the activation or
  the module's own gate function and the post-expert norm applied to the rows in torch
  between them. A form is recognised by its eager forward's bytecode against the loops in
  :data:`~smelt_kernels.hf.expert_forms.LOOPS` (the standard loop with any parameter-free
  elementwise activation -- GELU, GELU-tanh, ReLU², ...; Aria's transposed loop; the
  gate-function loop of DeepSeek-V4, GLM-5-Next, HY-V4, MiniMax-M3-VL and Beam; gpt-oss's
  loop with its biases, transposed storage and clamped, interleaved ``(up + 1) * glu``
  gate; its fp32 twin in openai_privacy_filter; Inkling2's softcapped loop with an fp32
  sum; NemotronH's ungated loop; MuseSpark's post-norm loop), and, for the loops that call
  ``self._apply_gate``, that function's bytecode against the known gate functions
  (:data:`~smelt_kernels.hf.expert_forms.GATES`).

Anything else -- another forward or gate function, an activation with parameters or one
that is not known to be elementwise, expert parallelism (sentinel ids), quantised or mixed
weights, flags that disagree with the forward -- runs transformers' own eager forward with
one log line naming what is not served (once per class and reason, on the ``smelt.hf``
logger), or raises :class:`UnsupportedExperts` in strict mode (:func:`set_strict`, or
``SMELT_HF_STRICT=1``).
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import torch
from torch import nn

from .. import backends
from ..moe_gemm import moe_ffn
from . import expert_forms as forms

__all__ = [
    "smelt_experts_forward",
    "unsupported_reason",
    "expert_form",
    "UnsupportedExperts",
    "set_strict",
    "is_strict",
    "SUPPORTED_FAMILIES",
]

logger = logging.getLogger("smelt.hf")

#: the transformers families (their models/ folder) whose experts :func:`expert_form` serves
#: with a tiny config of theirs in transformers 5.23 (tests/hf/test_hf_experts.py builds
#: each). Tested end to end as whole models against eager: mixtral, qwen2_moe, qwen3_moe,
#: olmoe and deepseek_v3 (tests/hf/test_hf_models.py) and gpt_oss
#: (tests/hf/test_hf_expert_forms.py); module by module against eager: the families in those
#: two test files' lists; the others share the bytecode of one of those.
SUPPORTED_FAMILIES = (
    # the plain SwiGLU form, on moe_ffn
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
    "axk1",
    "axk2",
    "bailing_hybrid",
    "cohere2_moe",
    "deepseek_ocr2",
    "deepseek_v32",
    "dots3_note",
    "ernie4_5_vl_moe",
    "flint",
    "glm4v_moe",
    "glm_moe_dsa",
    "granitemoe_swa",
    "hy_v3",
    "inkling",
    "kolibri1",
    "laguna",
    "mellum",
    "mistral4",
    "mistral_large4",
    "qwen3_omni_moe",
    "qwen4_exp",
    "unlimited_ocr",
    "zaya",
    # the other forms, on grouped_gemm
    "gpt_oss",
    "openai_privacy_filter",
    "aria",
    "gemma4",
    "diffusion_gemma",
    "deepseek_v4",
    "glm5_next",
    "hy_v4",
    "minimax_m3_vl",
    "beam",
    "inkling2",
    "nemotron_h",
    "muse_spark",
)


class UnsupportedExperts(NotImplementedError):
    """Raised in strict mode for an experts module the smelt kernel cannot serve."""


_strict: Optional[bool] = None
_logged: set[tuple[str, str]] = set()


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


def _is_silu(act) -> bool:
    from transformers.activations import SiLUActivation  # 5.x internals, as below

    return type(act) in (nn.SiLU, SiLUActivation) or act is torch.nn.functional.silu


@torch.compiler.assume_constant_result
def _class_key(cls: type) -> tuple:
    """(index into forms.LOOPS, gate function name, None) for a recognised class, else
    (-1, None, reason): plain values, so that torch.compile runs this (imports of the
    reference classes included) eagerly and keeps the result as a constant."""
    return _class_key_of(cls)


@functools.lru_cache(maxsize=None)
def _class_key_of(cls: type) -> tuple:
    loop, reason = forms.loop_of(cls)
    if reason is not None:
        return -1, None, reason
    gate = None
    if loop.gate == "apply_gate":
        gate, reason = forms.gate_of(cls)
        if reason is not None:
            return -1, None, reason
    return [entry[2] for entry in forms.LOOPS].index(loop), gate, None


def _weights_reason(module: nn.Module, loop: forms.Loop) -> Optional[str]:
    w1, w2 = getattr(module, loop.up_name, None), getattr(module, "down_proj", None)
    if not isinstance(w1, torch.Tensor) or not isinstance(w2, torch.Tensor):
        return f"it has no {loop.up_name} / down_proj tensors"
    if w1.dim() != 3 or w2.dim() != 3:
        return f"its weights are not 3-D: {tuple(w1.shape)}, {tuple(w2.shape)}"
    # (E, out, in), or (E, in, out) stored transposed
    (E1, out1, in1), (E2, out2, in2) = w1.shape, w2.shape
    if loop.transposed:
        (out1, in1), (out2, in2) = (in1, out1), (in2, out2)
    inner = out1 if loop.gate == "act" else out1 // 2
    if E1 != E2 or in2 != inner or out2 != in1 or (loop.gate != "act" and out1 % 2):
        layout = "(E, in, out)" if loop.transposed else "(E, out, in)"
        return (
            f"its {loop.up_name} / down_proj shapes {tuple(w1.shape)}, {tuple(w2.shape)} "
            f"do not chain as {layout} experts"
        )
    tensors = [w1, w2]
    if loop.bias:
        b1 = getattr(module, f"{loop.up_name}_bias", None)
        b2 = getattr(module, "down_proj_bias", None)
        if not isinstance(b1, torch.Tensor) or not isinstance(b2, torch.Tensor):
            return f"it has no {loop.up_name}_bias / down_proj_bias tensors"
        if tuple(b1.shape) != (E1, out1) or tuple(b2.shape) != (E1, out2):
            return (
                f"its biases {tuple(b1.shape)}, {tuple(b2.shape)} are not (E, out) for its weights"
            )
        tensors += [b1, b2]
    if any(not t.dtype.is_floating_point or t.dtype != w1.dtype for t in tensors):
        return f"its weights are {' / '.join(str(t.dtype) for t in tensors)} (quantised or mixed)"
    return None


def expert_form(module: nn.Module) -> tuple[Optional[forms.Form], Optional[str]]:
    """(the form smelt serves ``module`` as, None), or (None, the reason it falls back)."""
    if getattr(module, "_is_expert_parallel", False):
        return None, "it is expert-parallel (sentinel ids)"
    at, gate, reason = _class_key(type(module))
    if reason is not None:
        return None, reason
    loop = forms.LOOPS[at][2]
    defaults = dict(has_gate=True, has_bias=False, is_transposed=False, has_post_expert_norm=False)
    for flag, want in loop.flags().items():
        got = bool(getattr(module, flag, defaults[flag]))
        if got != want:
            return None, f"its {flag}={got} disagrees with its eager forward ({loop.name})"
    if loop.gate == "act_mul" and not getattr(module, "is_concatenated", True):
        return None, f"its gate/up rows are interleaved but {loop.name} splits them in halves"
    act = getattr(module, "act_fn", None)
    if loop.gate != "apply_gate" or forms.gate_calls_act(gate):
        reason = (
            forms.inkling_act_reason(act)
            if gate == "Inkling2Experts._apply_gate"
            else forms.activation_reason(act)
        )
        if reason is not None:
            return None, reason
    if loop.post_norm:
        reason = forms.post_norm_reason(getattr(module, "post_expert_norm", None))
        if reason is not None:
            return None, reason
    reason = _weights_reason(module, loop)
    if reason is not None:
        return None, reason
    plain = loop is forms.STANDARD and _is_silu(act)
    return forms.Form(loop, gate, plain), None


def unsupported_reason(module: nn.Module) -> Optional[str]:
    """None when smelt computes exactly what ``module``'s eager forward computes (on
    ``moe_ffn`` for the plain form, on ``grouped_gemm`` for the others), else a short
    reason naming what is not served."""
    return expert_form(module)[1]


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
    """The ``ExpertsInterface`` entry: ``moe_ffn`` on the module's own parameters for the
    plain form, the composed grouped-GEMM path for the other recognised forms, transformers'
    eager forward (with a log line, or an error in strict mode) for the rest."""
    form, reason = expert_form(self)
    if reason is not None:
        fallback("experts", type(self).__name__, reason)
        return type(self).forward.__wrapped__(self, hidden_states, top_k_index, top_k_weights)
    if not form.plain:
        return forms.composed_forward(self, form, hidden_states, top_k_index, top_k_weights)
    w1, w2 = self.gate_up_proj, self.down_proj
    x = hidden_states if hidden_states.dtype == w1.dtype else hidden_states.to(w1.dtype)
    # the ids come from the model's own top-k over E experts: in range and distinct
    y = moe_ffn(x, w1, w2, top_k_weights, top_k_index, check_values=False)
    return y.to(hidden_states.dtype)
