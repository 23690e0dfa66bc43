"""The self-test's cases: the edge cases of every shipped op
(:data:`smelt_kernels.testing.EDGES`, the list the tests run too), each with its inputs and
how to call the op's public entry point on a backend.

A :class:`Case` holds float32 (and integer) CPU tensors; the runner casts the floating ones
to the dtype under test, moves them to the device, and calls :attr:`Case.call` with a
backend name. :data:`CASES` maps each op name of the registry to a function that builds its
cases; ``quick`` marks the one per op that ``--quick`` runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import torch

from smelt_kernels import testing
from smelt_kernels.attention import reference as attention_reference
from smelt_kernels.attention import segment_attention
from smelt_kernels.dense import linear
from smelt_kernels.moe_gemm import grouped_gemm, moe_ffn, route
from smelt_kernels.norm import rms_norm
from smelt_kernels.rotary import apply_rotary

__all__ = ["Case", "CASES"]


@dataclass(frozen=True)
class Case:
    """One call of an op.

    ``tensors``: the inputs by name (floating ones float32, cast to the dtype under test;
    those named in ``keep`` stay float32, float64 in the reference). ``call(backend, t)``:
    the op's public entry point on the inputs ``t``, returning its outputs, named by
    ``outputs``; ``differentiable``: the inputs whose gradients are compared (a random
    upstream gradient flows into the first ``grad_outputs`` outputs); ``exact``: outputs
    that must equal the reference's exactly (expert ids); ``float32_outputs``: outputs the
    op computes in float32 whatever the inputs' dtype (the router's weights), whose
    tolerance floor is float32's, not the inputs'. ``select(t)``: the inputs
    ``backends.select`` reads. ``plain(t)``: plain PyTorch in the low precision, where the
    op's ``"torch"`` backend computes in a higher one inside (default: that backend).
    """

    name: str
    tensors: Mapping[str, torch.Tensor]
    call: Callable[[str, dict], tuple]
    outputs: tuple[str, ...]
    differentiable: tuple[str, ...]
    select: Callable[[dict], tuple]
    grad_outputs: int = 1
    exact: tuple[str, ...] = ()
    float32_outputs: tuple[str, ...] = ()
    keep: tuple[str, ...] = ()
    plain: Optional[Callable[[dict], tuple]] = None
    quick: bool = False
    seed: int = 0

    def inputs(self, dtype: torch.dtype, device, grad: bool, keep_dtype=torch.float32) -> dict:
        """The inputs in ``dtype`` on ``device`` (``keep`` ones in ``keep_dtype``), the
        differentiable ones as leaves that require grad when ``grad``."""
        out = {}
        for name, t in self.tensors.items():
            if t.is_floating_point():
                t = t.to(keep_dtype if name in self.keep else dtype)
            t = t.to(device)
            if grad and name in self.differentiable:
                t = t.detach().requires_grad_()
            out[name] = t
        return out


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _cases(op: str, build: Callable) -> Callable[[], list[Case]]:
    """The function that builds ``op``'s cases: one per edge case of
    :data:`smelt_kernels.testing.EDGES`, seeded by its position."""
    return lambda: [build(edge, seed) for seed, edge in enumerate(testing.EDGES[op])]


# ----------------------------------------------------------------------------- moe_ffn
def _moe(edge: testing.MoeEdge, seed: int) -> Case:
    g = _gen(seed)
    T, H, de, E = edge.T, edge.H, edge.de, edge.E
    x = torch.randn(T, H, generator=g)
    w1 = torch.randn(E, 2 * de, H, generator=g) * max(H, 1) ** -0.5
    w2 = torch.randn(E, H, de, generator=g) * max(de, 1) ** -0.5
    ids = testing.moe_ids(T, E, edge.k, edge.routing, g)
    tw = torch.softmax(torch.randn(T, edge.k, generator=g), dim=-1)
    return Case(
        edge.name,
        dict(x=x, w1=w1, w2=w2, tw=tw, ids=ids),
        call=lambda b, t: (moe_ffn(t["x"], t["w1"], t["w2"], t["tw"], t["ids"], backend=b),),
        outputs=("y",),
        differentiable=("x", "w1", "w2", "tw"),
        keep=("tw",),
        select=lambda t: (t["x"], t["w1"], t["w2"], t["tw"], t["ids"]),
        quick=edge.quick,
        seed=seed,
    )


# ----------------------------------------------------------------------------- grouped_gemm
def _grouped(edge: testing.GroupedEdge, seed: int) -> Case:
    g = _gen(seed)
    K = edge.K
    t = dict(
        a=torch.randn(edge.rows, K, generator=g),
        b=torch.randn(len(edge.ends), edge.N, K, generator=g) * max(K, 1) ** -0.5,
        ends=torch.tensor(edge.ends, dtype=torch.int32),
    )
    if edge.gather is not None:
        t["gather"] = torch.randint(0, edge.rows, (edge.gather,), generator=g, dtype=torch.int32)
    return Case(
        edge.name,
        t,
        call=lambda b, t: (
            grouped_gemm(t["a"], t["b"], t["ends"], gather_idx=t.get("gather"), backend=b),
        ),
        outputs=("c",),
        differentiable=("a", "b"),
        select=lambda t: (t["a"], t["b"], t["ends"], t.get("gather"), True),
        quick=edge.quick,
        seed=seed,
    )


# ----------------------------------------------------------------------------- route
def _route(edge: testing.RouteEdge, seed: int) -> Case:
    g = _gen(seed)
    T, E, k, renormalize = edge.T, edge.E, edge.k, edge.renormalize
    # logits a step of 0.125 apart within a row: no ties, even in 16-bit floats
    ranks = torch.argsort(torch.rand(T, E, generator=g), dim=1).float()
    logits = ranks * 0.125 - 2.0 + torch.randn(T, 1, generator=g)
    return Case(
        edge.name,
        dict(logits=logits),
        call=lambda b, t: route(t["logits"], k, renormalize, backend=b),
        outputs=("weights", "ids"),
        differentiable=("logits",),
        exact=("ids",),
        float32_outputs=("weights",),
        select=lambda t: (t["logits"], k, renormalize),
        quick=edge.quick,
        seed=seed,
    )


# ----------------------------------------------------------------------------- attention
def _plain_attention(t: dict) -> tuple:
    return attention_reference.segment_attention(t["q"], t["k"], t["v"], t.get("seg"), upcast=False)


def _attention(edge: testing.AttentionEdge, seed: int) -> Case:
    g = _gen(seed)
    B, Tq, Tk, D = edge.B, edge.Tq, edge.Tk, edge.D
    t = dict(
        q=torch.randn(B, Tq, edge.Hq, D, generator=g),
        k=torch.randn(B, Tk, edge.Hkv, D, generator=g),
        v=torch.randn(B, Tk, edge.Hkv, D, generator=g),
    )
    seg = testing.segment_ids(edge.segments, B, Tk, seed)
    if seg is not None:
        t["seg"] = seg
    return Case(
        edge.name,
        t,
        call=lambda b, t: segment_attention(
            t["q"], t["k"], t["v"], t.get("seg"), return_lse=True, return_sink=True, backend=b
        ),
        outputs=("o", "lse", "sink"),
        differentiable=("q", "k", "v"),
        plain=_plain_attention,
        select=lambda t: (t["q"], t["k"], t["v"], t.get("seg")),
        quick=edge.quick,
        seed=seed,
    )


# ----------------------------------------------------------------------------- rotary
def _rotary(edge: testing.RotaryEdge, seed: int) -> Case:
    g = _gen(seed)
    B, T, D = edge.B, edge.T, edge.D
    inv_freq = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    pos = torch.randint(0, 4096, (B, T), generator=g) if edge.per_batch else torch.arange(T) + 3
    angles = (pos.double()[..., None] * inv_freq).float()
    t = dict(x=torch.randn(B, T, edge.heads, D, generator=g), cos=angles.cos(), sin=angles.sin())
    return Case(
        edge.name,
        t,
        call=lambda b, t: (apply_rotary(t["x"], t["cos"], t["sin"], backend=b),),
        outputs=("y",),
        differentiable=("x",),
        keep=("cos", "sin"),
        select=lambda t: (t["x"], t["cos"], t["sin"]),
        quick=edge.quick,
        seed=seed,
    )


# ----------------------------------------------------------------------------- rms_norm
def _norm(edge: testing.NormEdge, seed: int) -> Case:
    g = _gen(seed)
    shape = edge.shape
    t = dict(x=torch.randn(*shape, generator=g) * 3, w=torch.rand(shape[-1], generator=g) + 0.5)
    return Case(
        edge.name,
        t,
        call=lambda b, t: (rms_norm(t["x"], t["w"], 1e-5, backend=b),),
        outputs=("y",),
        differentiable=("x", "w"),
        select=lambda t: (t["x"], t["w"], 1e-5),
        quick=edge.quick,
        seed=seed,
    )


# ----------------------------------------------------------------------------- linear
def _dense(edge: testing.DenseEdge, seed: int) -> Case:
    g = _gen(seed)
    K = edge.shape[-1]
    t = dict(x=torch.randn(*edge.shape, generator=g), w=torch.randn(edge.N, K, generator=g) * 0.2)
    return Case(
        edge.name,
        t,
        call=lambda b, t: (linear(t["x"], t["w"], backend=b),),
        outputs=("y",),
        differentiable=("x", "w"),
        select=lambda t: (t["x"], t["w"], True),
        quick=edge.quick,
        seed=seed,
    )


#: op name -> the function that builds its cases (the edge cases of smelt_kernels.testing)
CASES: dict[str, Callable[[], list[Case]]] = {
    "moe_ffn": _cases("moe_ffn", _moe),
    "grouped_gemm": _cases("grouped_gemm", _grouped),
    "route": _cases("route", _route),
    "segment_attention": _cases("segment_attention", _attention),
    "rotary": _cases("rotary", _rotary),
    "rms_norm": _cases("rms_norm", _norm),
    "linear": _cases("linear", _dense),
}
