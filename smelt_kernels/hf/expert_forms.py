"""The experts forms ``experts_implementation="smelt"`` recognises, and the composed path that
serves every form but the plain SwiGLU one.

A form is what a module's eager ``forward`` computes per expert, told apart by the bytecode
of that forward (``forward.__wrapped__``) against the loops of reference transformers
classes (:data:`LOOPS`), and, for the loops that call ``self._apply_gate``, by the bytecode of
that gate function against the known ones (:data:`GATES`). The activations the loops call
(``self.act_fn``) must be parameter-free elementwise ones (:func:`activation_reason`).

:func:`composed_forward` computes such a module on smelt's grouped GEMM
(:func:`smelt_kernels.moe_gemm.grouped_gemm`): the (token, slot) pairs are sorted by expert
on the device, the gate/up (or up) projection runs as one grouped GEMM over the gathered
rows, the per-expert bias, the module's own gate function or activation and its post-expert
norm are applied to those rows in torch (all row-local, so the rows' order changes nothing),
the down projection is the second grouped GEMM, and the weighted rows are summed back per
token in the accumulation dtype of the eager loop. Weights stored transposed ((E, in, out),
``x @ W[e]``) are read in place. Everything is differentiable through autograd (the grouped
GEMM's own backward), with no host read, so it runs under ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import activations as A

from ..moe_gemm import grouped_gemm

__all__ = [
    "Loop",
    "Form",
    "LOOPS",
    "GATES",
    "STANDARD",
    "loop_of",
    "gate_of",
    "gate_calls_act",
    "activation_reason",
    "composed_forward",
]


@dataclass(frozen=True)
class Loop:
    """What one eager experts loop computes for the rows of expert e.

    ``gate``: "act_mul" (``act_fn(gate) * up`` of the concatenated gate/up projection),
    "apply_gate" (``self._apply_gate(gate_up)``) or "act" (``act_fn(up)``, no gate).
    ``transposed``: weights (E, in, out), applied as ``x @ W[e]``; ``bias``: per-expert
    ``gate_up_proj_bias`` / ``down_proj_bias`` added after each projection; ``fp32``: inputs,
    weights, biases and routing weights taken to fp32 before use; ``post_norm``: the row
    norm ``self.post_expert_norm`` applied to the down projection; ``acc``: the dtype the
    weighted rows are summed in ("hidden": the input's, "fp32", "weights": the routing
    weights'); the result is always in the input's dtype."""

    name: str
    gate: str
    transposed: bool = False
    bias: bool = False
    fp32: bool = False
    post_norm: bool = False
    acc: str = "hidden"

    @property
    def up_name(self) -> str:
        return "up_proj" if self.gate == "act" else "gate_up_proj"

    def flags(self) -> dict:
        """The ``use_experts_implementation`` flags a module with this loop carries."""
        return dict(
            has_gate=self.gate != "act",
            has_bias=self.bias,
            is_transposed=self.transposed,
            has_post_expert_norm=self.post_norm,
        )


#: the reference loops: (transformers model folder, experts class) whose eager forward defines
#: the form, and the form; a module is of a form when its eager forward has the very bytecode
STANDARD = Loop("the standard loop", "act_mul")

LOOPS: tuple[tuple[str, str, Loop], ...] = (
    ("mixtral", "MixtralExperts", STANDARD),
    ("aria", "AriaExperts", Loop("the transposed standard loop", "act_mul", transposed=True)),
    ("deepseek_v4", "DeepseekV4Experts", Loop("the gate-function loop", "apply_gate")),
    (
        "gpt_oss",
        "GptOssExperts",
        Loop("gpt-oss's loop", "apply_gate", transposed=True, bias=True),
    ),
    (
        "openai_privacy_filter",
        "OpenAIPrivacyFilterExperts",
        Loop("the fp32 gpt-oss loop", "apply_gate", transposed=True, bias=True, fp32=True),
    ),
    (
        "inkling2",
        "Inkling2Experts",
        Loop("the fp32-sum gate-function loop", "apply_gate", acc="fp32"),
    ),
    ("nemotron_h", "NemotronHExperts", Loop("the ungated loop", "act", acc="weights")),
    ("muse_spark", "MuseSparkExperts", Loop("the post-norm loop", "act_mul", post_norm=True)),
)

#: the gate functions (``_apply_gate``) of the reference classes: row-local maps of the
#: gate/up projection, computed by calling the module's own function
GATES: tuple[tuple[str, str], ...] = (
    ("deepseek_v4", "DeepseekV4Experts"),  # clamped SwiGLU on act_fn
    ("glm5_next", "Glm5NextTextExperts"),  # clamped SwiGLU on F.silu
    ("hy_v4", "HYV4Experts"),  # the same
    ("minimax_m3_vl", "MiniMaxM3VLExperts"),  # gpt-oss's clamped gate, concatenated
    ("gpt_oss", "GptOssExperts"),  # clamped sigmoid gate, (up + 1), interleaved
    ("openai_privacy_filter", "OpenAIPrivacyFilterExperts"),  # gpt-oss's, concatenated
    ("beam", "BeamExperts"),  # act_fn(gate) * up in fp32
    ("inkling2", "Inkling2Experts"),  # act_fn(gate, up): the softcapped SwiGLU below
)


def _same_code(a, b) -> bool:
    return (
        a.co_code == b.co_code
        and a.co_names == b.co_names
        and a.co_consts == b.co_consts
        and a.co_argcount == b.co_argcount
    )


def _reference(folder: str, name: str):
    """A transformers 5.x class, imported when first asked for; None where this
    transformers lacks it (its form is then not recognised)."""
    try:
        mod = importlib.import_module(f"transformers.models.{folder}.modeling_{folder}")
    except ImportError:
        return None
    return getattr(mod, name, None)


#: the row-local modules the reference families call, by (folder, class): inkling2's
#: softcapped SwiGLU and its softcap, MuseSpark's post-expert row norm
MODULES: tuple[tuple[str, str], ...] = (
    ("inkling2", "Inkling2SoftcappedSwiGLU"),
    ("inkling2", "Inkling2Softcap"),
    ("muse_spark", "MuseSparkTextInputScaledRMSNorm"),
)

_tables: Optional[dict] = None


def load() -> dict:
    """The reference bytecodes, classes and activations, imported once. Called by the class
    check (which torch.compile runs eagerly), so traced code only reads them."""
    global _tables
    if _tables is None:
        loops, gates = [], []
        for folder, name, loop in LOOPS:
            eager = getattr(getattr(_reference(folder, name), "forward", None), "__wrapped__", None)
            if eager is not None:
                loops.append((eager.__code__, loop))
        for folder, name in GATES:
            fn = getattr(_reference(folder, name), "_apply_gate", None)
            if fn is not None:
                gates.append((fn.__code__, f"{name}._apply_gate"))
        modules = {name: _reference(folder, name) for folder, name in MODULES}
        _tables = dict(loops=loops, gates=gates, modules=modules, acts=_elementwise_activations())
    return _tables


def _loops():
    return load()["loops"]


def _gates():
    return load()["gates"]


def loop_of(cls: type) -> tuple[Optional[Loop], Optional[str]]:
    """(the loop of ``cls``'s eager forward, None) or (None, why not)."""
    eager = getattr(cls.forward, "__wrapped__", None)
    if eager is None:
        return None, "its forward is not wrapped by use_experts_implementation"
    code = getattr(eager, "__code__", None)
    for ref, loop in _loops():
        if code is not None and _same_code(code, ref):
            return loop, None
    return None, (
        f"its eager forward ({eager.__qualname__}) is none of the experts loops smelt "
        f"recognises ({', '.join(name for _, name, _ in LOOPS)})"
    )


def gate_of(cls: type) -> tuple[Optional[str], Optional[str]]:
    """(the name of ``cls._apply_gate``'s reference, None) when it is transformers' default
    ("default") or a recognised gate function, else (None, why not)."""
    from transformers.integrations.moe import _default_apply_gate  # 5.x internals

    fn = getattr(cls, "_apply_gate", _default_apply_gate)
    if fn is _default_apply_gate:
        return "default", None
    code = getattr(fn, "__code__", None)
    for ref, name in _gates():
        if code is not None and _same_code(code, ref):
            return name, None
    name = getattr(fn, "__qualname__", type(fn).__name__)
    return None, f"its gate function {name} is none of the gate functions smelt recognises"


def gate_calls_act(gate: Optional[str]) -> bool:
    """Whether the recognised gate function ``gate`` (its name) calls ``self.act_fn``."""
    if gate == "default":
        return True
    return any(n == gate and "act_fn" in ref.co_names for ref, n in _gates())


# --------------------------------------------------------------------------- activations
def _elementwise_activations() -> tuple[set, set]:
    """(module classes, functions): parameter-free elementwise activations, by identity."""

    classes = {
        nn.SiLU,
        nn.GELU,
        nn.ReLU,
        nn.ReLU6,
        nn.LeakyReLU,
        nn.Sigmoid,
        nn.Tanh,
        nn.Mish,
        nn.Hardswish,
        nn.Identity,
    }
    for name in (
        "SiLUActivation",
        "GELUActivation",
        "GELUTanh",
        "NewGELUActivation",
        "FastGELUActivation",
        "QuickGELUActivation",
        "ClippedGELUActivation",
        "AccurateGELUActivation",
        "MishActivation",
        "LinearActivation",
        "LaplaceActivation",
        "ReLUSquaredActivation",
        "SqrtSoftplusActivation",
    ):
        cls = getattr(A, name, None)
        if cls is not None:
            classes.add(cls)
    functions = {F.silu, F.gelu, F.relu, torch.relu, torch.sigmoid, torch.tanh, F.mish}
    return classes, functions


def _act_name(act) -> str:
    if isinstance(act, nn.Module):
        return type(act).__name__
    return getattr(act, "__name__", None) or type(act).__name__


def activation_reason(act) -> Optional[str]:
    """None when ``act`` is a parameter-free elementwise activation smelt recognises (a
    module of one of those classes exactly, or one of those functions)."""
    classes, functions = load()["acts"]
    if isinstance(act, nn.Module):
        if any(True for _ in act.parameters()):
            return f"its activation {type(act).__name__} has parameters"
        if type(act) in classes:
            return None
    elif act in functions:
        return None
    return f"its activation {_act_name(act)} is not an elementwise activation smelt recognises"


def inkling_act_reason(act) -> Optional[str]:
    """The two-argument activation of inkling2's gate function: its softcapped SwiGLU."""
    ref = load()["modules"]["Inkling2SoftcappedSwiGLU"]
    cap = load()["modules"]["Inkling2Softcap"]
    if ref is not None and type(act) is ref:
        subs = [type(m) for m in act.children()]
        if subs and all(t is cap for t in subs) and not any(True for _ in act.parameters()):
            return None
    return f"its gate activation {type(act).__name__} is not inkling2's softcapped SwiGLU"


def post_norm_reason(norm) -> Optional[str]:
    """The post-expert norms smelt recognises: row norms of the reference class."""
    ref = load()["modules"]["MuseSparkTextInputScaledRMSNorm"]
    if ref is not None and type(norm) is ref:
        return None
    return f"its post-expert norm {type(norm).__name__} is not a row norm smelt recognises"


# --------------------------------------------------------------------------- the compute
@dataclass(frozen=True)
class Form:
    """A recognised module: its loop, the reference name of its gate function (None where
    the loop calls none) and whether it is the plain SwiGLU form ``moe_ffn`` computes."""

    loop: Loop
    gate_fn: Optional[str] = None
    plain: bool = False


def _gemm(a, w, ends, gather, transposed: bool):
    """Rows ``a[gather]`` (or ``a``) of expert e times its weight: ``w[e]^T`` for Linear
    layout (E, out, in), ``w[e]`` for transposed storage (E, in, out), read in place."""
    layout = "kn" if transposed else "nk"
    return grouped_gemm(a, w, ends, gather_idx=gather, b_layout=layout, check_values=False)


def composed_forward(
    module: nn.Module,
    form: Form,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """``module``'s eager forward on smelt's grouped GEMM (see the module docstring)."""
    loop = form.loop
    w_up: torch.Tensor = getattr(module, loop.up_name)
    w_down: torch.Tensor = module.down_proj
    T, k = top_k_index.shape
    E = w_up.shape[0]
    dtype = torch.float32 if loop.fp32 else w_up.dtype
    x = hidden_states.to(dtype)
    w_up, w_down = w_up.to(dtype), w_down.to(dtype)

    # the (token, slot) pairs p = t*k + j sorted by expert, stably; expert e owns sorted rows
    # [ends[e-1], ends[e]); ``rev`` puts the rows back in pair order
    flat = top_k_index.reshape(-1)
    expert, order = torch.sort(flat, stable=True)
    ends = torch.searchsorted(
        expert, torch.arange(1, E + 1, device=flat.device, dtype=flat.dtype), out_int32=True
    )
    tok = (order // k).to(torch.int32)
    rev = torch.empty_like(order).scatter_(
        0, order, torch.arange(order.numel(), device=order.device)
    )

    h = _gemm(x, w_up, ends, tok, loop.transposed)
    if loop.bias:
        h = h + getattr(module, f"{loop.up_name}_bias").to(dtype)[expert]
    if loop.gate == "act_mul":
        gate, up = h.chunk(2, dim=-1)
        h = module.act_fn(gate) * up
    elif loop.gate == "apply_gate":
        h = module._apply_gate(h)
        if loop.fp32:
            h = h.float()
    else:
        h = module.act_fn(h)
    out = _gemm(h, w_down, ends, None, loop.transposed)
    if loop.bias:
        out = out + module.down_proj_bias.to(dtype)[expert]
    if loop.post_norm:
        out = module.post_expert_norm(out)
    w = top_k_weights.reshape(-1)[order]
    if loop.fp32:
        w = w.float()
    out = out * w[:, None]
    acc = {"hidden": hidden_states.dtype, "fp32": torch.float32, "weights": top_k_weights.dtype}
    out = out.to(acc[loop.acc])
    y = out[rev].view(T, k, out.shape[-1]).sum(dim=1)
    return y.to(hidden_states.dtype)
