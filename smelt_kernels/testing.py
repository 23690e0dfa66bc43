"""Testing smelt's kernels, as :mod:`torch.testing` tests torch's: the one tolerance rule a
kernel is held to against its float64 reference, and the one list of edge-case shapes per
op. The self-test (``smelt-selftest``) and the test suite both read them from here.

The rule (flash-attn's): an output's error against the float64 reference may be at most
twice the error plain PyTorch makes from the same inputs in the same low precision, plus a
floor at the output's scale: two units of that precision, and at least 1e-5 (for cases where
plain PyTorch rounds luckily, and for fp32, where both errors are rounding noise of
different summation orders). A value that is not finite where the reference is fails;
exact outputs (expert ids) must be equal. :func:`compare` measures one output,
:func:`assert_close` raises on it.

The edge cases (:data:`EDGES`, one tuple per op, by the registry's op names): an expert with
no tokens, all tokens on one expert, length-1 segments, one segment filling the context,
T = 1, odd sizes, zero-size dimensions... Each is a small frozen description of sizes; the
self-test and the tests build their own tensors from it (:func:`moe_ids` and
:func:`segment_ids` build the routings and the segment layouts the cases name). ``quick``
marks the one case per op a smoke test runs: small (the interpreted Triton rows stay fast)
but through each kernel's main path.

This module imports nothing of smelt beyond ``smelt_kernels`` and no test framework.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

__all__ = [
    "Tolerance",
    "TOLERANCES",
    "bound",
    "compare",
    "assert_close",
    "MoeEdge",
    "GroupedEdge",
    "RouteEdge",
    "AttentionEdge",
    "RotaryEdge",
    "NormEdge",
    "DenseEdge",
    "EDGES",
    "moe_ids",
    "SEGMENT_LAYOUTS",
    "segment_ids",
    "ids_from_lengths",
]


# ----------------------------------------------------------------------------- tolerances
@dataclass(frozen=True)
class Tolerance:
    """The bound on one output's error against the float64 reference::

        max |got - ref| <= factor * max |plain - ref| + max(floor_ulps * eps, floor_min) * scale

    ``plain``: what plain PyTorch (the op's ``"torch"`` backend, or the reference computed
    wholly in the low precision where the backend upcasts inside) makes from the same inputs
    in the same precision; ``eps``: the machine epsilon of the dtype the inputs were given
    in (an fp32 output of a bf16 computation is only as good as bf16), or float32's for an
    output the op computes in float32 whatever its inputs (the router's weights); ``scale``:
    ``max(1, max |ref|)``. An error divided by its bound is the *normalised* error: at most
    1 passes.
    """

    factor: float
    floor_ulps: float
    floor_min: float


#: the one tolerance table, by the name of the dtype the inputs were given in
TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(factor=2.0, floor_ulps=2.0, floor_min=1e-5),
    "bfloat16": Tolerance(factor=2.0, floor_ulps=2.0, floor_min=1e-5),
    "float16": Tolerance(factor=2.0, floor_ulps=2.0, floor_min=1e-5),
    "float64": Tolerance(factor=2.0, floor_ulps=2.0, floor_min=1e-12),
}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def bound(
    plain_error: float,
    scale: float,
    dtype: torch.dtype,
    floor_dtype: Optional[torch.dtype] = None,
) -> float:
    """The largest error :class:`Tolerance` allows an output of inputs in ``dtype``:
    ``plain_error`` is plain PyTorch's, ``scale`` the reference's largest magnitude;
    ``floor_dtype``: the precision the floor counts in, when not ``dtype``'s."""
    tol = TOLERANCES[_name(dtype)]
    eps = torch.finfo(floor_dtype or dtype).eps
    floor = max(tol.floor_ulps * eps, tol.floor_min) * max(1.0, scale)
    return tol.factor * plain_error + floor


def _max_abs(a: torch.Tensor) -> float:
    return a.abs().max().item() if a.numel() else 0.0


def compare(
    name: str,
    got: torch.Tensor,
    ref: torch.Tensor,
    plain: Optional[torch.Tensor],
    dtype: torch.dtype,
    exact: bool = False,
    floor_dtype: Optional[torch.dtype] = None,
) -> tuple[float, Optional[str]]:
    """(normalised error, None or what failed) of output ``name``: ``got`` against the
    float64 reference ``ref``, with ``plain`` plain PyTorch's result in ``dtype`` (the dtype
    the inputs were given in). ``exact``: must equal ``ref``. Non-finite values must sit
    where the reference's are (NaN where NaN, inf where inf)."""
    got = got.detach().cpu()
    ref = ref.detach().cpu()
    if tuple(got.shape) != tuple(ref.shape):
        return math.inf, f"{name}: shape {tuple(got.shape)}, the reference's {tuple(ref.shape)}"
    if exact:
        if torch.equal(got.to(ref.dtype), ref):
            return 0.0, None
        bad = int((got.to(ref.dtype) != ref).sum())
        return math.inf, f"{name}: {bad} of {ref.numel()} values differ from the reference's"
    if not got.is_floating_point():
        return math.inf, f"{name}: dtype {got.dtype}, expected floating point"
    g, r = got.double(), ref.double()
    finite = torch.isfinite(r)
    lost = int((~torch.isfinite(g) & finite).sum())
    if lost:
        return math.inf, f"{name}: {lost} NaN or inf values where the reference is finite"
    if not torch.equal(torch.isfinite(g), finite):
        return math.inf, f"{name}: finite values where the reference has NaN or inf"
    if not torch.equal(torch.isnan(g), torch.isnan(r)):
        return math.inf, f"{name}: NaN where the reference has inf (or the reverse)"
    err = _max_abs(torch.where(finite, g - r, torch.where(g == r, 0.0, math.inf)))
    base = 0.0
    if plain is not None:
        base = _max_abs(torch.where(finite, plain.detach().cpu().double() - r, 0.0))
    limit = bound(base, _max_abs(r[finite]), dtype, floor_dtype)
    norm = err / limit
    if norm <= 1.0:
        return norm, None
    tol = TOLERANCES[_name(dtype)]
    return norm, (
        f"{name}: max error {err:.3e} > bound {limit:.3e} ({tol.factor:g} x plain torch's "
        f"{base:.3e} + floor {limit - tol.factor * base:.3e})"
    )


def assert_close(
    name: str,
    got: torch.Tensor,
    ref: torch.Tensor,
    plain: torch.Tensor,
    dtype: Optional[torch.dtype] = None,
    floor_dtype: Optional[torch.dtype] = None,
) -> None:
    """:func:`compare`, raising AssertionError with what failed; ``dtype`` defaults to
    ``got``'s."""
    _, why = compare(name, got, ref, plain, dtype or got.dtype, floor_dtype=floor_dtype)
    if why is not None:
        raise AssertionError(why)


# ----------------------------------------------------------------------------- edge cases
#: how a MoE case routes its tokens: None (k distinct experts per token, at random),
#: "first_k" (every token on experts k-1..0: the others get none), "one_expert" (every
#: token on the last expert, k = 1), or the ids themselves (T rows of k)
Routing = Union[None, str, tuple[tuple[int, ...], ...]]


@dataclass(frozen=True)
class MoeEdge:
    """A ``moe_ffn`` case: T tokens of width H, E experts of size d_e, top-k."""

    name: str
    T: int
    H: int
    de: int
    E: int
    k: int
    routing: Routing = None
    quick: bool = False

    @property
    def empty(self) -> bool:
        """Every sum is empty: y and every gradient are exactly zero."""
        return self.T == 0 or self.H == 0


@dataclass(frozen=True)
class GroupedEdge:
    """A ``grouped_gemm`` case: ``rows`` rows of A (width K), groups ending at ``ends``
    (rows past the last end belong to none), N outputs per row; ``gather``: that many
    output rows gathered from A's rows (None: A's rows in order)."""

    name: str
    rows: int
    K: int
    N: int
    ends: tuple[int, ...]
    gather: Optional[int] = None
    quick: bool = False


@dataclass(frozen=True)
class RouteEdge:
    """A ``route`` case: T rows of E logits, top-k, renormalised or not."""

    name: str
    T: int
    E: int
    k: int
    renormalize: bool = True
    quick: bool = False


@dataclass(frozen=True)
class AttentionEdge:
    """A ``segment_attention`` case: batch B, Tq queries (the last of Tk positions), Hq
    query and Hkv KV heads of dim D; ``segments``: row 0's segment lengths (summing to Tk)
    or a layout name of :data:`SEGMENT_LAYOUTS` (the other rows mixed), or None for no
    segment ids."""

    name: str
    B: int
    Tq: int
    Tk: int
    Hq: int
    Hkv: int
    D: int
    segments: Union[None, str, tuple[int, ...]] = None
    quick: bool = False

    @property
    def empty(self) -> bool:
        return 0 in (self.B, self.Tq, self.Tk, self.Hq)


@dataclass(frozen=True)
class RotaryEdge:
    """An ``apply_rotary`` case: x (B, T, heads, D); ``per_batch``: tables per batch row."""

    name: str
    B: int
    T: int
    heads: int
    D: int
    per_batch: bool = False
    quick: bool = False


@dataclass(frozen=True)
class NormEdge:
    """An ``rms_norm`` case: x of ``shape`` (normalised over the last dimension)."""

    name: str
    shape: tuple[int, ...]
    quick: bool = False


@dataclass(frozen=True)
class DenseEdge:
    """A ``linear`` case: x of ``shape`` (..., K) against a weight (N, K)."""

    name: str
    shape: tuple[int, ...]
    N: int
    quick: bool = False


#: op name -> its edge cases (the registry's names; ``quick``: the smoke test's one)
EDGES: dict[str, tuple] = {
    "moe_ffn": (
        MoeEdge("T=1", 1, 24, 16, 4, 2),
        MoeEdge("odd H and d_e", 13, 37, 19, 5, 3),
        MoeEdge("experts with no tokens", 9, 32, 24, 6, 2, "first_k"),
        MoeEdge("all tokens on one expert", 11, 16, 8, 4, 1, "one_expert", quick=True),
        MoeEdge("more experts than pairs", 2, 8, 16, 40, 3, ((39, 0, 17), (5, 39, 38))),
        MoeEdge("many rows per expert", 40, 24, 20, 4, 2),
        MoeEdge("T=0", 0, 16, 8, 4, 2),
        MoeEdge("H=0", 5, 0, 8, 4, 2),
        MoeEdge("T=0 and H=0", 0, 0, 8, 4, 2),
    ),
    "grouped_gemm": (
        GroupedEdge("empty group and tail rows", 37, 23, 19, (4, 4, 15, 30, 33)),
        GroupedEdge("gathered rows", 21, 16, 12, (3, 3, 20, 30), gather=30, quick=True),
        GroupedEdge("one group", 9, 8, 5, (9,)),
        GroupedEdge("one row", 1, 13, 7, (0, 1)),
        GroupedEdge("no rows", 0, 8, 4, (0, 0, 0)),
        GroupedEdge("K=0", 6, 0, 5, (2, 4, 6)),
        GroupedEdge("N=0", 6, 4, 0, (2, 4, 6)),
        GroupedEdge("every group empty", 6, 4, 5, (0, 0, 0)),
        GroupedEdge("tail rows past two groups", 7, 3, 2, (0, 3)),
    ),
    "route": (
        RouteEdge("T=1, k=1", 1, 8, 1),
        RouteEdge("odd E, k=4", 17, 33, 4, quick=True),
        RouteEdge("no renormalisation", 6, 12, 3, renormalize=False),
        RouteEdge("k=E", 3, 5, 5),
        RouteEdge("T=0", 0, 8, 2),
    ),
    "segment_attention": (
        AttentionEdge("length-1 segments", 1, 9, 9, 2, 2, 16, "ones"),
        AttentionEdge("one segment filling the context, GQA 2:1", 2, 20, 20, 4, 2, 32),
        AttentionEdge("mixed segments, GQA 6:1", 2, 37, 37, 6, 1, 64, (5, 16, 1, 15)),
        AttentionEdge("decode form Tq=1 < Tk", 2, 1, 19, 4, 2, 16, (7, 12)),
        AttentionEdge(
            "decode form Tq=3 < Tk, GQA 2:1, D=88", 1, 3, 21, 2, 1, 88, (10, 11), quick=True
        ),
        AttentionEdge("odd head dim D=7", 1, 11, 11, 2, 1, 7, (4, 7)),
        AttentionEdge("T=0", 1, 0, 0, 2, 1, 16, ()),
        AttentionEdge("no queries", 1, 0, 5, 2, 1, 16, "one"),
        AttentionEdge("no batch", 0, 4, 4, 2, 1, 16, "one"),
        AttentionEdge("no query heads", 2, 3, 3, 0, 1, 16, "one"),
    ),
    "rotary": (
        RotaryEdge("one position, D=2", 1, 1, 1, 2),
        RotaryEdge("odd heads and positions, D=10", 2, 7, 3, 10, quick=True),
        RotaryEdge("several vector widths, D=64", 2, 33, 5, 64),
        RotaryEdge("per-batch tables", 3, 5, 2, 96, per_batch=True),
        RotaryEdge("T=0", 2, 0, 2, 8),
    ),
    "rms_norm": (
        NormEdge("one row", (1, 8)),
        NormEdge("odd width", (3, 37), quick=True),
        NormEdge("rows across weight-gradient blocks", (130, 320)),
        NormEdge("leading batch dims", (2, 65, 96)),
        NormEdge("H=1", (4, 1)),
        NormEdge("width 7 under two leading dims of 1", (1, 1, 7)),
        NormEdge("no rows", (0, 16)),
    ),
    "linear": (
        DenseEdge("one row", (1, 13), 7),
        DenseEdge("odd sizes", (37, 29), 19, quick=True),
        DenseEdge("rows for several threads, wide output", (300, 64), 130),
        DenseEdge("one output", (5, 16), 1),
        DenseEdge("leading batch dims", (2, 9, 24), 40),
        DenseEdge("no rows", (0, 8), 4),
        DenseEdge("K=0", (6, 0), 5),
        DenseEdge("N=0", (6, 4), 0),
    ),
}


def moe_ids(
    T: int, E: int, k: int, routing: Routing = None, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """int32 (T, k) expert ids of a routing (see :class:`MoeEdge`; random ones drawn from
    ``generator``)."""
    if routing is None:
        return torch.argsort(torch.rand(T, E, generator=generator), dim=1)[:, :k].to(torch.int32)
    if routing == "first_k":
        return torch.arange(k, dtype=torch.int32).flip(0).repeat(T, 1)
    if routing == "one_expert":
        return torch.full((T, k), E - 1, dtype=torch.int32)
    if isinstance(routing, str):
        raise ValueError(f"moe_ids: unknown routing {routing!r}")
    return torch.tensor(routing, dtype=torch.int32).reshape(T, k)


# ----------------------------------------------------------------------------- segments
#: named segment layouts of one row of T positions: "one" segment filling the context;
#: length-1 segments ("ones"); random lengths ("mixed"); boundaries inside 16- and 64-wide
#: tiles ("inside"); boundaries exactly on tile edges ("edge")
SEGMENT_LAYOUTS = ("one", "ones", "mixed", "inside", "edge")


def ids_from_lengths(lengths, first: int = -3, step: int = 2) -> torch.Tensor:
    """Non-decreasing ids of segments of these lengths (labels ``first``, ``first + step``...:
    any labels will do, so they are not 0, 1, 2...)."""
    labels = torch.arange(len(lengths)) * step + first
    return torch.repeat_interleave(labels, torch.tensor(list(lengths), dtype=torch.long))


def _cuts(T: int, boundaries) -> list[int]:
    cuts = [0] + [b for b in boundaries if 0 < b < T] + [T]
    return [b - a for a, b in zip(cuts, cuts[1:])]


def _random_lengths(T: int, gen: torch.Generator) -> list[int]:
    lens, s = [], 0
    while s < T:
        n = min(int(torch.randint(1, max(2, T // 2) + 1, (1,), generator=gen)), T - s)
        lens.append(n)
        s += n
    return lens


def segment_ids(
    segments: Union[None, str, tuple[int, ...], list[int]], B: int, T: int, seed: int = 0
) -> Optional[torch.Tensor]:
    """(B, T) int64 segment ids: row 0 from ``segments`` (a layout of
    :data:`SEGMENT_LAYOUTS`, or lengths summing to T), the other rows random lengths; None
    for ``segments`` None or "none" (no ids: one segment per row)."""
    if segments is None or segments == "none":
        return None
    gen = torch.Generator().manual_seed(seed)
    if isinstance(segments, str):
        lengths = {
            "one": lambda: [T] if T else [],
            "ones": lambda: [1] * T,
            "mixed": lambda: _random_lengths(T, gen),
            "inside": lambda: _cuts(T, [5, 21, 40, 100]),
            "edge": lambda: _cuts(T, [16, 32, 64, 128]),
        }
        if segments not in lengths:
            raise ValueError(f"segment_ids: unknown layout {segments!r} (one of {SEGMENT_LAYOUTS})")
        first = lengths[segments]()
    else:
        first = list(segments)
        if sum(first) != T:
            raise ValueError(f"segment_ids: lengths {first} do not sum to T={T}")
    rows = [ids_from_lengths(first)]
    rows += [ids_from_lengths(_random_lengths(T, gen), first=b) for b in range(1, B)]
    return torch.stack(rows)[:B] if B else torch.zeros(0, T, dtype=torch.long)
