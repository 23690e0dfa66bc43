"""The self-test's cases: small, odd and edge shapes for every shipped op, each with how to
call the op's public entry point on a backend.

A :class:`Case` holds float32 (and integer) CPU tensors; the runner casts the floating ones
to the dtype under test, moves them to the device, and calls :attr:`Case.call` with a
backend name. :data:`CASES` maps each op name of the registry to a function that builds its
cases; ``quick`` keeps the cases marked for ``--quick``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import torch

from smelt_kernels.attention import apply_rotary, segment_attention
from smelt_kernels.attention import reference as attention_reference
from smelt_kernels.moe_gemm import grouped_gemm, moe_ffn, route
from smelt_kernels.norm import rms_norm

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


# ----------------------------------------------------------------------------- moe_ffn
def _moe(name, T, H, de, E, k, ids=None, quick=False, seed=0) -> Case:
    g = _gen(seed)
    x = torch.randn(T, H, generator=g)
    w1 = torch.randn(E, 2 * de, H, generator=g) * max(H, 1) ** -0.5
    w2 = torch.randn(E, H, de, generator=g) * de**-0.5
    if ids is None:  # k distinct experts per token, at random
        ids = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :k]
    tw = torch.softmax(torch.randn(T, ids.shape[1], generator=g), dim=-1)
    return Case(
        name,
        dict(x=x, w1=w1, w2=w2, tw=tw, ids=ids.to(torch.int32)),
        call=lambda b, t: (moe_ffn(t["x"], t["w1"], t["w2"], t["tw"], t["ids"], backend=b),),
        outputs=("y",),
        differentiable=("x", "w1", "w2", "tw"),
        keep=("tw",),
        select=lambda t: (t["x"], t["w1"], t["w2"], t["tw"], t["ids"]),
        quick=quick,
        seed=seed,
    )


def moe_cases() -> list[Case]:
    return [
        _moe("T=1", 1, 24, 16, 4, 2, quick=True),
        _moe("odd H and d_e", 13, 37, 19, 5, 3, seed=1),
        _moe(
            "experts with no tokens", 9, 32, 24, 6, 2, seed=2, ids=torch.tensor([1, 0]).repeat(9, 1)
        ),  # experts 2..5 get no rows
        _moe(
            "all tokens on one expert",
            11,
            16,
            8,
            4,
            1,
            quick=True,
            seed=3,
            ids=torch.full((11, 1), 3),
        ),
        _moe("many rows per expert", 96, 48, 40, 4, 2, seed=4),
        _moe("T=0", 0, 16, 8, 4, 2, quick=True, seed=5),
        _moe("H=0", 5, 0, 8, 4, 2, seed=6),
    ]


# ----------------------------------------------------------------------------- grouped_gemm
def _grouped(name, Ma, K, N, ends, gather_rows=None, quick=False, seed=0) -> Case:
    g = _gen(seed)
    E = len(ends)
    t = dict(
        a=torch.randn(Ma, K, generator=g),
        b=torch.randn(E, N, K, generator=g) * K**-0.5,
        ends=torch.tensor(ends, dtype=torch.int32),
    )
    if gather_rows is not None:
        t["gather"] = torch.randint(0, Ma, (gather_rows,), generator=g, dtype=torch.int32)
    return Case(
        name,
        t,
        call=lambda b, t: (
            grouped_gemm(t["a"], t["b"], t["ends"], gather_idx=t.get("gather"), backend=b),
        ),
        outputs=("c",),
        differentiable=("a", "b"),
        select=lambda t: (t["a"], t["b"], t["ends"], t.get("gather"), True),
        quick=quick,
        seed=seed,
    )


def grouped_cases() -> list[Case]:
    return [
        _grouped("empty group and tail rows", 37, 23, 19, [4, 4, 15, 30, 33], quick=True),
        _grouped("gathered rows", 21, 16, 12, [3, 3, 20, 30], gather_rows=30, quick=True, seed=1),
        _grouped("one group", 9, 8, 5, [9], seed=2),
        _grouped("one row", 1, 13, 7, [0, 1], seed=3),
        _grouped("no rows", 0, 8, 4, [0, 0, 0], seed=4),
    ]


# ----------------------------------------------------------------------------- route
def _route(name, T, E, k, renormalize=True, quick=False, seed=0) -> Case:
    g = _gen(seed)
    # logits a step of 0.125 apart within a row: no ties, even in 16-bit floats
    ranks = torch.argsort(torch.rand(T, E, generator=g), dim=1).float()
    logits = ranks * 0.125 - 2.0 + torch.randn(T, 1, generator=g)
    return Case(
        name,
        dict(logits=logits),
        call=lambda b, t: route(t["logits"], k, renormalize, backend=b),
        outputs=("weights", "ids"),
        differentiable=("logits",),
        exact=("ids",),
        float32_outputs=("weights",),
        select=lambda t: (t["logits"], k, renormalize),
        quick=quick,
        seed=seed,
    )


def route_cases() -> list[Case]:
    return [
        _route("T=1, k=1", 1, 8, 1, quick=True),
        _route("odd E, k=4", 17, 33, 4, quick=True, seed=1),
        _route("no renormalisation", 6, 12, 3, renormalize=False, seed=2),
        _route("k=E", 3, 5, 5, seed=3),
        _route("T=0", 0, 8, 2, seed=4),
    ]


# ----------------------------------------------------------------------------- attention
def _segments(B: int, T: int, lengths: Optional[list[int]], seed: int) -> Optional[torch.Tensor]:
    """(B, T) ids: row 0 from ``lengths``, other rows random lengths; None for no ids."""
    if lengths is None:
        return None
    g = _gen(seed + 100)
    rows = []
    for b in range(B):
        lens = list(lengths)
        if b > 0:
            lens, left = [], T
            while left > 0:
                n = min(left, int(torch.randint(1, max(2, T // 2) + 1, (1,), generator=g)))
                lens.append(n)
                left -= n
        rows.append(
            torch.repeat_interleave(
                torch.arange(len(lens)) * 3 - 1 + b, torch.tensor(lens, dtype=torch.long)
            )
        )
    return torch.stack(rows)


def _plain_attention(t: dict) -> tuple:
    return attention_reference.segment_attention(t["q"], t["k"], t["v"], t.get("seg"), upcast=False)


def _attention(name, B, Tq, Tk, hq, hkv, D, lengths, quick=False, seed=0) -> Case:
    g = _gen(seed)
    t = dict(
        q=torch.randn(B, Tq, hq, D, generator=g),
        k=torch.randn(B, Tk, hkv, D, generator=g),
        v=torch.randn(B, Tk, hkv, D, generator=g),
    )
    seg = _segments(B, Tk, lengths, seed)
    if seg is not None:
        t["seg"] = seg
    return Case(
        name,
        t,
        call=lambda b, t: segment_attention(
            t["q"], t["k"], t["v"], t.get("seg"), return_lse=True, return_sink=True, backend=b
        ),
        outputs=("o", "lse", "sink"),
        differentiable=("q", "k", "v"),
        plain=_plain_attention,
        select=lambda t: (t["q"], t["k"], t["v"], t.get("seg")),
        quick=quick,
        seed=seed,
    )


def attention_cases() -> list[Case]:
    return [
        _attention("length-1 segments", 1, 9, 9, 2, 2, 16, [1] * 9, quick=True),
        _attention("one segment filling the context, GQA 2:1", 2, 20, 20, 4, 2, 32, None, seed=1),
        _attention("mixed segments, GQA 6:1", 2, 37, 37, 6, 1, 64, [5, 16, 1, 15], seed=2),
        _attention("decode form Tq=1 < Tk", 2, 1, 19, 4, 2, 16, [7, 12], seed=3),
        _attention(
            "decode form Tq=3 < Tk, GQA 2:1, D=88", 1, 3, 21, 2, 1, 88, [10, 11], quick=True, seed=4
        ),
        _attention("odd head dim D=7", 1, 11, 11, 2, 1, 7, [4, 7], seed=5),
        _attention("T=0", 1, 0, 0, 2, 1, 8, [], seed=6),
    ]


# ----------------------------------------------------------------------------- rotary
def _rotary(name, B, T, heads, D, per_batch=False, quick=False, seed=0) -> Case:
    g = _gen(seed)
    inv_freq = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    pos = torch.randint(0, 4096, (B, T), generator=g) if per_batch else torch.arange(T) + 3
    angles = (pos.double()[..., None] * inv_freq).float()
    t = dict(x=torch.randn(B, T, heads, D, generator=g), cos=angles.cos(), sin=angles.sin())
    return Case(
        name,
        t,
        call=lambda b, t: (apply_rotary(t["x"], t["cos"], t["sin"], backend=b),),
        outputs=("y",),
        differentiable=("x",),
        keep=("cos", "sin"),
        select=lambda t: (t["x"], t["cos"], t["sin"]),
        quick=quick,
        seed=seed,
    )


def rotary_cases() -> list[Case]:
    return [
        _rotary("one position, D=2", 1, 1, 1, 2, quick=True),
        _rotary("odd heads and positions, D=10", 2, 7, 3, 10, seed=1),
        _rotary("per-batch tables", 3, 5, 2, 12, per_batch=True, quick=True, seed=2),
        _rotary("T=0", 2, 0, 2, 8, seed=3),
    ]


# ----------------------------------------------------------------------------- rms_norm
def _norm(name, shape, quick=False, seed=0) -> Case:
    g = _gen(seed)
    t = dict(x=torch.randn(*shape, generator=g) * 3, w=torch.rand(shape[-1], generator=g) + 0.5)
    return Case(
        name,
        t,
        call=lambda b, t: (rms_norm(t["x"], t["w"], 1e-5, backend=b),),
        outputs=("y",),
        differentiable=("x", "w"),
        select=lambda t: (t["x"], t["w"], 1e-5),
        quick=quick,
        seed=seed,
    )


def norm_cases() -> list[Case]:
    return [
        _norm("one row", (1, 8), quick=True),
        _norm("odd width", (3, 37), seed=1),
        _norm("leading batch dims", (2, 5, 96), quick=True, seed=2),
        _norm("H=1", (4, 1), seed=3),
        _norm("no rows", (0, 16), seed=4),
    ]


#: op name -> the function that builds its cases
CASES: dict[str, Callable[[], list[Case]]] = {
    "moe_ffn": moe_cases,
    "grouped_gemm": grouped_cases,
    "route": route_cases,
    "segment_attention": attention_cases,
    "rotary": rotary_cases,
    "rms_norm": norm_cases,
}
