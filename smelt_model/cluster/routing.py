"""Rows an EP layer's all-to-alls move: under uniform routing, and for a realised routing.

A *row* is one ``hidden_size`` vector. Torchtitan's stock dispatcher sends one row per
(token, slot) pair routed to an expert on another rank; a de-duplicating dispatcher sends one
per (token, destination rank) pair, however many of the token's ``top_k`` experts that rank
holds, and its combine returns the same rows (a token's outputs summed on the expert rank).

Two kinds of count matrices describe a realised step, one per executed EP layer:

* ``routing``: ``(ep, n_experts)``; entry ``[i][e]`` is how many (token, slot) pairs rank
  ``i`` routes to expert ``e``. Each row sums to ``tokens x top_k``.
* ``token_ranks``: ``(ep, ep)``; entry ``[i][j]`` is how many of rank ``i``'s tokens have
  at least one of their experts on EP rank ``j`` (own rank included: the diagonal never
  crosses a link). Each row lies between ``tokens`` and ``tokens x min(top_k, ep)``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional

from smelt_model.cluster.units import ring_fraction

__all__ = ["dedup_factor", "uniform_rows", "realised_rows", "check_counts"]


def _miss(n_experts: int, top_k: int, ep: int) -> float:
    """The chance that a uniformly routed token has none of its ``top_k`` distinct experts
    on a given EP rank (which holds ``n_experts / ep``)."""
    return math.comb(n_experts - n_experts // ep, top_k) / math.comb(n_experts, top_k)


def dedup_factor(n_experts: int, top_k: int, ep: int) -> float:
    """Rows a de-duplicating dispatch sends over the rows the stock one sends, under uniform
    routing: ``ep * (1 - C(E - E/ep, k) / C(E, k)) / k`` (0.66 at E 192 or 288, k 8, ep 8;
    0.82 at ep 16). The same ratio holds for the rows sent to other ranks."""
    return ep * (1.0 - _miss(n_experts, top_k, ep)) / top_k


def uniform_rows(tokens: int, n_experts: int, top_k: int, ep: int, dedup: bool) -> float:
    """Rows one rank sends to other ranks in one dispatch under uniform routing (its combine
    sends as many)."""
    if ep == 1:
        return 0.0
    if dedup:
        return tokens * (ep - 1) * (1.0 - _miss(n_experts, top_k, ep))
    return tokens * top_k * ring_fraction(ep)


def _counts(row: Any, where: str, i: int, most: int) -> list[int]:
    for v in row:
        if (
            isinstance(v, bool)
            or not isinstance(v, numbers.Real)
            or not math.isfinite(v)
            or v < 0
            or v != math.floor(v)
        ):
            raise ValueError(f"{where} must hold non-negative integer counts, got {v!r} in row {i}")
    for v in row:
        if v > most:
            raise ValueError(
                f"{where} row {i} holds {v!r}, more than the {most} a rank can have there"
            )
    return [int(v) for v in row]


def _checked(value: Any, name: str, layers: int, shape: tuple, most: int, check_row) -> list:
    """``value``: ``layers`` matrices of ``shape``, each holding counts of at most ``most``,
    as nested lists of ints; ``check_row(where, layer, i, row)`` checks each row further."""
    label = f"({', '.join(n for n, _ in shape)})"
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise TypeError(
            f"{name} must be a sequence of {label} count matrices, got {type(value).__name__}"
        )
    if len(value) != layers:
        raise ValueError(
            f"{name} must hold one matrix per executed EP MoE layer ({layers}), got {len(value)}"
        )
    (_, rows), (_, cols) = shape
    out = []
    for li, m in enumerate(value):
        where = f"{name}[{li}]"
        m = m.tolist() if hasattr(m, "tolist") else m
        if not (
            isinstance(m, (list, tuple))
            and len(m) == rows
            and all(isinstance(r, (list, tuple)) and len(r) == cols for r in m)
        ):
            raise ValueError(f"{where} must be an {label} = ({rows}, {cols}) matrix")
        counted = [_counts(r, where, i, most) for i, r in enumerate(m)]
        for i, r in enumerate(counted):
            check_row(where, li, i, r)
        out.append(counted)
    return out


def check_counts(
    routing: Any,
    token_ranks: Any,
    *,
    layers: int,
    ep: int,
    n_experts: int,
    top_k: int,
    tokens: int,
) -> tuple[Optional[list], Optional[list]]:
    """``routing`` and ``token_ranks`` (either may be None) as nested lists of ints,
    checked (see the module docstring); ValueError / TypeError naming the argument."""
    slots = tokens * top_k
    per_rank, reach = n_experts // ep, min(top_k, ep)

    def routed_row(where, li, i, r):
        if sum(r) != slots:
            raise ValueError(
                f"{where} row {i} routes {sum(r)} (token, slot) pairs; a rank holding "
                f"tokens_per_step / dp_shard tokens routes tokens x top_k = {slots}"
            )

    def ranked_row(where, li, i, r):
        if not tokens <= sum(r) <= tokens * reach:
            raise ValueError(
                f"{where} row {i} sums to {sum(r)}; each of the rank's {tokens} tokens "
                f"reaches between 1 and min(top_k, ep) = {reach} EP ranks"
            )
        for j, n in enumerate(r if routed is not None else ()):
            sent = sum(routed[li][i][j * per_rank : (j + 1) * per_rank])
            if not n <= sent <= n * min(top_k, per_rank):
                raise ValueError(
                    f"{where}[{i}][{j}] = {n} tokens cannot carry the {sent} (token, slot) "
                    f"pairs routing[{li}] sends from rank {i} to rank {j}"
                )

    routed = ranked = None
    if routing is not None:
        shape = (("ep", ep), ("n_experts", n_experts))
        routed = _checked(routing, "routing", layers, shape, slots, routed_row)
    if token_ranks is not None:
        shape = (("ep", ep), ("ep", ep))
        ranked = _checked(token_ranks, "token_ranks", layers, shape, tokens, ranked_row)
    return routed, ranked


def realised_rows(m: list, ep: int, n_experts: int, by_expert: bool) -> tuple[list, list]:
    """Rows each rank sends to other ranks in one layer's forward dispatch and combine, from
    one checked matrix: ``routing`` counts (``by_expert``) or ``token_ranks`` counts."""
    per_rank = n_experts // ep if by_expert else 1
    # to[i][j]: rows rank i sends to rank j
    to = [[sum(m[i][j * per_rank : (j + 1) * per_rank]) for j in range(ep)] for i in range(ep)]
    # out[i]: rows rank i sends away; back[i]: rows it received, which its combine returns
    out = [sum(to[i][j] for j in range(ep) if j != i) for i in range(ep)]
    back = [sum(to[j][i] for j in range(ep) if j != i) for i in range(ep)]
    return out, back
