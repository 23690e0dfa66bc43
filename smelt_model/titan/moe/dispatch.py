"""The expert-parallel token dispatchers of the SMELT runs, on torchtitan's dispatcher seam.

* :class:`CountingAllToAllTokenDispatcher` is torchtitan's ``AllToAllTokenDispatcher``: one
  row per (token, slot) pair goes to the EP rank that holds the slot's expert. Its blocking
  ``dispatch`` / ``combine`` are the stock ones (the combine's weighting as below); it adds
  byte recording (:mod:`smelt_model.titan.moe.traffic`) and the same exchanges split in phases.
* :class:`DedupAllToAllTokenDispatcher` sends a token **once** to each EP rank that holds any
  of its ``k`` experts: one row per (token, destination rank) pair, with the row's local
  expert ids and routing scores beside it (``k`` int32 and ``k`` fp32). On arrival each row
  is expanded into one row per local slot, in the expert-major order the grouped experts
  expect (by local expert, then source rank, then token: the order of the stock
  dispatcher). The combine weights each expert output by its score in fp32 and sums a
  row's slots on the expert's rank, so the same (token, rank) rows travel back, and the
  source scatter-adds them onto the tokens. Under uniform routing a rank sends ``R (1 -
  C(E - E/R, k) / C(E, k)) / k`` of the stock rows (0.66 at E 192 or 288, k 8, R 8).
  It needs no DeepEP build: plain all-to-alls, on NCCL and gloo.

Both, and :class:`ScaledLocalTokenDispatcher` (the local one, for layers whose experts are
gathered), weight the expert outputs by their routing scores with :func:`scale_rows` (in fp32,
keeping the outputs for the scores' gradient in their own dtype, where the stock combine
keeps an fp32 copy: 2·D bytes per bf16 row less).

Both dispatchers run locally (no exchange) when no EP mesh is wired, and both offer the
phased form that the chunked overlap uses: :meth:`~CountingAllToAllTokenDispatcher.dispatch_phases`
and :meth:`~CountingAllToAllTokenDispatcher.combine_phases` are generators that start their
token exchange, ``yield`` the tensors they hold (their *carry*), and on resumption (the same
tensors sent back, possibly replaced by equal ones) wait for the exchange and finish. The
split sizes come from an exchange of counts first, which the host must wait for before it
can size the token exchange: the dispatch starts it and pauses, so that the other chunks
issue their own compute before this chunk's host waits (with the overlap only the last
chunk of a layer leaves the GPU idle while its counts travel). The token exchanges run on
:attr:`exchange_group` when one is set (a process group of their own,
:func:`smelt_model.titan.moe.exchange.dedicated_group`), so that they do not queue behind the
counts of the other chunks.

Stock torchtitan MoE models take either through ``--override.imports``:
:func:`count_all_to_all` (recording only) and :func:`dedup_all_to_all`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generator, Optional

import torch
from torch.distributed._functional_collectives import all_to_all_single
from torchtitan.config.override import derive, override
from torchtitan.models.common.token_dispatcher import (
    AllToAllDispatchMetadata,
    AllToAllTokenDispatcher,
    LocalTokenDispatcher,
)
from torchtitan.ops.scatter_add import deterministic_scatter_add

from smelt_model.titan.moe.exchange import Flight, start, start_plain, wait, wait_plain
from smelt_model.titan.moe.traffic import RECORDER

__all__ = [
    "CountingAllToAllTokenDispatcher",
    "DedupAllToAllTokenDispatcher",
    "DedupDispatchMetadata",
    "PhasedDispatchMetadata",
    "count_all_to_all",
    "dedup_all_to_all",
    "scale_rows",
    "ScaledLocalTokenDispatcher",
    "token_ranks",
    "pause",
    "run_phases",
]

Carry = tuple[torch.Tensor, ...]


def pause(keep: Carry, own: Carry) -> Generator[Carry, Carry, tuple[Carry, Carry]]:
    """Yield ``keep + own`` (the tensors a suspended phase holds) and return them, as sent
    back by the driver, split the same way."""
    got = yield (*keep, *own)
    got = tuple(got)
    return got[: len(keep)], got[len(keep) :]


def run_phases(gen: Generator[Carry, Carry, Any]) -> Any:
    """Run a phased generator to its end, resuming each pause at once (no overlap)."""
    try:
        carry = next(gen)
        while True:
            carry = gen.send(carry)
    except StopIteration as stop:
        return stop.value


def token_ranks(topk_expert_ids_TK: torch.Tensor, ep: int, n_experts: int) -> torch.Tensor:
    """(ep,) int64: how many tokens have at least one of their experts on each EP rank
    (experts placed contiguously, ``n_experts / ep`` per rank)."""
    _, has = _destinations(topk_expert_ids_TK, ep, n_experts)
    return has.sum(0)


def _destinations(topk_expert_ids_TK: torch.Tensor, ep: int, n_experts: int):
    """(the EP rank of each slot's expert (T, K) int64, whether each token has an expert on
    each rank (T, ep) bool), experts placed contiguously, ``n_experts / ep`` per rank."""
    dest = topk_expert_ids_TK.long() // (n_experts // ep)
    has = torch.zeros(dest.shape[0], ep, dtype=torch.bool, device=dest.device)
    return dest, has.scatter_(1, dest, True)


def _sum_rows(out: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``out`` with each of ``rows`` added onto its row ``index[i]`` (deterministic)."""
    return deterministic_scatter_add(out, index.reshape(-1, 1).expand(-1, out.shape[-1]), rows)


class ScaledLocalTokenDispatcher(LocalTokenDispatcher):
    """torchtitan's ``LocalTokenDispatcher`` (no exchange: a layer whose experts are all on
    this rank) with :func:`scale_rows` in its combine."""

    @dataclass(kw_only=True, slots=True)
    class Config(LocalTokenDispatcher.Config):
        pass

    def combine(self, routed_output_RD, metadata, x_TD):
        return _local_combine(routed_output_RD, metadata, x_TD)


class CountingAllToAllTokenDispatcher(AllToAllTokenDispatcher):
    """torchtitan's all-to-all token dispatcher, with byte recording and phases.

    Without recording, ``dispatch`` / ``combine`` are exactly the stock ones; with it, each
    dispatch also reads this rank's routing back to the host (the split sizes already are).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(AllToAllTokenDispatcher.Config):
        pass

    #: rows are (token, rank) pairs (see DedupAllToAllTokenDispatcher)
    dedup = False

    def __init__(self, config: Config):
        super().__init__(config)
        #: process group of the token exchanges in the phased form (None: the EP mesh's)
        self.exchange_group = None
        self._call: Optional[int] = None

    # ------------------------------------------------------------------ recording
    def _record_call(self, counts_E: torch.Tensor, ids_TK: torch.Tensor, chunk: int) -> int:
        ep = self.ep_mesh.size()
        ranks = token_ranks(ids_TK, ep, counts_E.shape[0])
        call = RECORDER.call(
            counts_E.tolist(),
            ranks.tolist(),
            self.ep_mesh.get_local_rank(),
            ep,
            self.dedup,
            chunk,
        )
        RECORDER.add("counts", "forward", self._count_rows(counts_E), counts_E.element_size(), call)
        return call

    def _count_rows(self, counts_E: torch.Tensor) -> list[int]:
        ep = self.ep_mesh.size()
        return [counts_E.shape[0] // ep] * ep

    def _maybe_record(self, counts_E, ids_TK, chunk: int) -> Optional[int]:
        if RECORDER.enabled and self.ep_mesh is not None:
            return self._record_call(counts_E, ids_TK, chunk)
        return None

    # ------------------------------------------------------------------ blocking (stock)
    def dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E):
        self._call = self._maybe_record(num_local_tokens_per_expert_E, topk_expert_ids_TK, 0)
        return super().dispatch(
            x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E
        )

    def combine(self, routed_output_RD, metadata, x_TD):
        """torchtitan's combine (unpermute, all-to-all back, weight, scatter-add) with
        :func:`scale_rows` weighting the rows that came back."""
        if self.ep_mesh is None:
            return _local_combine(routed_output_RD, metadata, x_TD)
        pg, _ = self._groups()
        rows = self._unpermute(routed_output_RD, metadata.input_shape, metadata.permuted_indices)
        rows = self._combine_token_exchange(rows, pg, metadata.input_splits, metadata.output_splits)
        return _local_combine(rows, metadata, x_TD)

    def _dispatch_token_exchange(self, routed_input_ND, pg, output_splits, input_splits):
        out = super()._dispatch_token_exchange(routed_input_ND, pg, output_splits, input_splits)
        return self._count("dispatch", routed_input_ND, out, input_splits, output_splits)

    def _combine_token_exchange(self, routed_output_RD, pg, input_splits, output_splits):
        out = super()._combine_token_exchange(routed_output_RD, pg, input_splits, output_splits)
        return self._count("combine", routed_output_RD, out, output_splits, input_splits)

    def _count(self, kind, sent, out, sent_splits, received_splits):
        """Record one stock exchange's forward rows and, through ``out``'s gradient, its
        backward (the rows received, sent back)."""
        if self._call is None or not RECORDER.enabled:
            return out
        row = sent.shape[-1] * sent.element_size()
        RECORDER.add(kind, "forward", sent_splits, row, self._call)
        if out.requires_grad:
            out = _CountBackward.apply(out, kind, list(received_splits), self._call)
        return out

    # ------------------------------------------------------------------ phases
    def _groups(self) -> tuple[Any, Any]:
        pg = self.ep_mesh.get_group()
        return pg, self.exchange_group if self.exchange_group is not None else pg

    def dispatch_phases(
        self,
        x_TD: torch.Tensor,
        topk_scores_TK: torch.Tensor,
        topk_expert_ids_TK: torch.Tensor,
        num_local_tokens_per_expert_E: torch.Tensor,
        keep: Carry = (),
        chunk: int = 0,
    ):
        """Generator form of ``dispatch`` (module docstring); returns ``(keep, routed rows,
        counts per local expert, metadata)``."""
        counts_E = num_local_tokens_per_expert_E
        if self.ep_mesh is None:
            rows, counts, meta = LocalTokenDispatcher.dispatch(
                self, x_TD, topk_scores_TK, topk_expert_ids_TK, counts_E
            )
            return keep, rows, counts, meta
        ep = self.ep_mesh.size()
        call = self._maybe_record(counts_E, topk_expert_ids_TK, chunk)
        pg, xg = self._groups()
        with torch.no_grad():
            received = self._token_count_exchange(counts_E, pg, ep)
        # the counts travel while the other chunks compute; the host waits for them after
        keep, (x_TD, topk_scores_TK) = yield from pause(keep, (x_TD, topk_scores_TK))
        with torch.no_grad():
            received_E, in_splits, out_splits = self._sync_token_count_exchange(
                counts_E, received, ep
            )
        routed_ND, token_idx_N, scores_N = self._local_reorder(
            x_TD, topk_scores_TK, topk_expert_ids_TK
        )
        flight = Flight(xg, in_splits, out_splits, "dispatch", call)
        (buf,) = start(flight, routed_ND)
        keep, (buf, scores_N) = yield from pause(keep, (buf, scores_N))
        (rows,) = wait(flight, buf)
        shape, rows, permuted, counts_e = self._permute(rows, received_E)
        meta = PhasedDispatchMetadata(
            token_indices_experts_sorted_N=token_idx_N,
            topk_scores_experts_sorted_N=scores_N,
            input_shape=shape,
            permuted_indices=permuted,
            input_splits=in_splits,
            output_splits=out_splits,
            call=call,
        )
        return keep, rows, counts_e, meta

    def combine_phases(
        self, routed_output_RD: torch.Tensor, metadata: Any, x_TD: torch.Tensor, keep: Carry = ()
    ):
        """Generator form of ``combine``; returns ``(keep, out_TD)``. Only ``x_TD``'s shape,
        dtype and device are used."""
        if self.ep_mesh is None:
            return keep, _local_combine(routed_output_RD, metadata, x_TD)
        _, xg = self._groups()
        rows = self._unpermute(routed_output_RD, metadata.input_shape, metadata.permuted_indices)
        flight = Flight(xg, metadata.output_splits, metadata.input_splits, "combine", metadata.call)
        (buf,) = start(flight, rows)
        scores = metadata.topk_scores_experts_sorted_N
        keep, (buf, scores) = yield from pause(keep, (buf, scores))
        (back,) = wait(flight, buf)
        return keep, _weighted_sum(back, scores, metadata.token_indices_experts_sorted_N, x_TD)


class _ScaleRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, scores, dtype):
        ctx.save_for_backward(rows, scores)
        return (rows.to(torch.float32) * scores.reshape(-1, 1)).to(dtype)

    @staticmethod
    def backward(ctx, grad):
        rows, scores = ctx.saved_tensors
        grad = grad.to(torch.float32)
        d_rows = d_scores = None
        if ctx.needs_input_grad[0]:
            d_rows = (grad * scores.reshape(-1, 1)).to(rows.dtype)
        if ctx.needs_input_grad[1]:
            d_scores = (grad * rows.to(torch.float32)).sum(-1).reshape(scores.shape)
            d_scores = d_scores.to(scores.dtype)
        return d_rows, d_scores, None


def scale_rows(rows: torch.Tensor, scores: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(rows.float() * scores[:, None]).to(dtype)`` -- each expert output row times its
    routing score, in fp32 -- keeping ``rows`` in their own dtype for the scores' gradient
    (autograd on that expression keeps the fp32 copy)."""
    if rows.dim() != 2 or scores.numel() != rows.shape[0]:
        raise ValueError(
            f"scale_rows: rows must be (R, D) and scores hold R={rows.shape[0]} scores, got "
            f"{tuple(rows.shape)} and {tuple(scores.shape)}"
        )
    return _ScaleRows.apply(rows, scores, dtype)


def _weighted_sum(rows, scores, token_of_row, x_TD) -> torch.Tensor:
    """Each row times its score (:func:`scale_rows`), summed onto its token: a (T, D) tensor
    like ``x_TD``."""
    return _sum_rows(torch.zeros_like(x_TD), token_of_row, scale_rows(rows, scores, rows.dtype))


def _local_combine(routed_output_RD, metadata, x_TD) -> torch.Tensor:
    """torchtitan's local combine (no EP) with :func:`scale_rows`."""
    return _weighted_sum(
        routed_output_RD,
        metadata.topk_scores_experts_sorted_N,
        metadata.token_indices_experts_sorted_N,
        x_TD,
    )


@dataclass(frozen=True, kw_only=True)
class PhasedDispatchMetadata(AllToAllDispatchMetadata):
    """The stock metadata, and the recorder's index of the call (None: not recorded)."""

    call: Optional[int] = None


class _CountBackward(torch.autograd.Function):
    """Identity whose backward records the exchange that is about to carry the gradient."""

    @staticmethod
    def forward(ctx, x, kind, rows_to, call):
        ctx.info = (kind, rows_to, call)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        kind, rows_to, call = ctx.info
        RECORDER.add(kind, "backward", rows_to, grad.shape[-1] * grad.element_size(), call)
        return grad, None, None, None


@dataclass(frozen=True, kw_only=True)
class DedupDispatchMetadata:
    """What :meth:`DedupAllToAllTokenDispatcher.combine` needs from its dispatch."""

    #: for each expanded row (expert-major), the received row it came from
    row_of_N: torch.Tensor  # noqa: N815
    #: the expanded rows' routing scores (fp32)
    scores_N: torch.Tensor  # noqa: N815
    #: received rows (a (token, rank) pair each)
    received_rows: int
    #: for each sent row (rank-major), the token it carried
    token_of_S: torch.Tensor  # noqa: N815
    input_splits: list[int]
    output_splits: list[int]
    call: Optional[int] = None


class DedupAllToAllTokenDispatcher(CountingAllToAllTokenDispatcher):
    """One row per (token, destination rank): see the module docstring."""

    @dataclass(kw_only=True, slots=True)
    class Config(CountingAllToAllTokenDispatcher.Config):
        pass

    dedup = True

    def _count_rows(self, counts_E: torch.Tensor) -> list[int]:
        ep = self.ep_mesh.size()
        return [counts_E.shape[0] // ep + 1] * ep  # each rank's slot counts and its row count

    def dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E):
        _, rows, counts, meta = run_phases(
            self.dispatch_phases(
                x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E
            )
        )
        return rows, counts, meta

    def combine(self, routed_output_RD, metadata, x_TD):
        _, out = run_phases(self.combine_phases(routed_output_RD, metadata, x_TD))
        return out

    def dispatch_phases(
        self,
        x_TD: torch.Tensor,
        topk_scores_TK: torch.Tensor,
        topk_expert_ids_TK: torch.Tensor,
        num_local_tokens_per_expert_E: torch.Tensor,
        keep: Carry = (),
        chunk: int = 0,
    ):
        if self.ep_mesh is None:
            return (
                yield from super().dispatch_phases(
                    x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E, keep
                )
            )
        counts_E = num_local_tokens_per_expert_E
        T, K = topk_expert_ids_TK.shape
        E, ep = counts_E.shape[0], self.ep_mesh.size()
        e = E // ep
        call = self._maybe_record(counts_E, topk_expert_ids_TK, chunk)
        ids = topk_expert_ids_TK.long()
        dest, has = _destinations(ids, ep, E)
        pg, xg = self._groups()
        with torch.no_grad():
            # per destination rank: the slot count of each of its experts, and the row count
            counts = torch.cat([counts_E.view(ep, e), has.sum(0).view(ep, 1)], dim=1)
            received = all_to_all_single(counts.contiguous(), None, None, group=pg)
        # the counts travel while the other chunks compute; the host waits for them after
        keep, (x_TD, topk_scores_TK) = yield from pause(keep, (x_TD, topk_scores_TK))
        with torch.no_grad():
            received = torch.ops._c10d_functional.wait_tensor(received)
            counts_e = received[:, :e].sum(0)
            in_splits = counts[:, e].tolist()
            table = received.tolist()  # the one wait for the host: the split sizes
            out_splits = [row[e] for row in table]
            n_expanded = sum(sum(row[:e]) for row in table)
        # the rows to send, rank-major, tokens in order within a rank (sizes known: no sync)
        sent = torch.nonzero_static(has.t().reshape(-1), size=sum(in_splits)).squeeze(1)
        token_of_S = sent % T
        dest_of_S = sent // T
        own = dest[token_of_S] == dest_of_S.view(-1, 1)  # (S, K): the slots for that rank
        slot_ids = torch.where(own, ids[token_of_S] % e, -1).to(torch.int32)
        slot_scores = torch.where(own, topk_scores_TK[token_of_S].to(torch.float32), 0.0)
        x_flight = Flight(xg, in_splits, out_splits, "dispatch", call)
        s_flight = Flight(xg, in_splits, out_splits, "slots", call, row_bytes=8 * K)
        i_flight = Flight(xg, in_splits, out_splits)
        (x_buf,) = start(x_flight, x_TD[token_of_S])
        (s_buf,) = start(s_flight, slot_scores)
        i_buf = start_plain(i_flight, slot_ids)
        keep, (x_buf, s_buf) = yield from pause(keep, (x_buf, s_buf))
        (x_rows,) = wait(x_flight, x_buf)
        (s_rows,) = wait(s_flight, s_buf)
        wait_plain(i_flight)
        # expand: one row per local slot, by local expert, then by received row
        flat = i_buf.reshape(-1).long()
        order = torch.argsort(torch.where(flat >= 0, flat, e), stable=True)[:n_expanded]
        row_of_N = order // K
        meta = DedupDispatchMetadata(
            row_of_N=row_of_N,
            scores_N=s_rows.reshape(-1)[order],
            received_rows=x_rows.shape[0],
            token_of_S=token_of_S,
            input_splits=in_splits,
            output_splits=out_splits,
            call=call,
        )
        return keep, x_rows[row_of_N], counts_e, meta

    def combine_phases(
        self, routed_output_RD: torch.Tensor, metadata: Any, x_TD: torch.Tensor, keep: Carry = ()
    ):
        if self.ep_mesh is None:
            return (yield from super().combine_phases(routed_output_RD, metadata, x_TD, keep))
        D = routed_output_RD.shape[-1]
        weighted = scale_rows(routed_output_RD, metadata.scores_N, torch.float32)
        rows = torch.zeros(
            metadata.received_rows, D, dtype=torch.float32, device=routed_output_RD.device
        )
        rows = _sum_rows(rows, metadata.row_of_N, weighted).to(routed_output_RD.dtype)
        _, xg = self._groups()
        flight = Flight(xg, metadata.output_splits, metadata.input_splits, "combine", metadata.call)
        (buf,) = start(flight, rows)
        keep, (buf,) = yield from pause(keep, (buf,))
        (back,) = wait(flight, buf)
        return keep, _sum_rows(x_TD.new_zeros(x_TD.shape), metadata.token_of_S, back)


@override(
    target=AllToAllTokenDispatcher.Config,
    exact=True,
    description="record the bytes of the expert-parallel all-to-alls",
)
def count_all_to_all(cfg: AllToAllTokenDispatcher.Config) -> CountingAllToAllTokenDispatcher.Config:
    """A stock model's all-to-all dispatcher -> the recording one (set ``SMELT_TITAN_COMM``)."""
    return derive(cfg, CountingAllToAllTokenDispatcher.Config)


@override(
    target=AllToAllTokenDispatcher.Config,
    exact=True,
    description="de-duplicated expert-parallel all-to-alls (one row per token and rank)",
)
def dedup_all_to_all(cfg: AllToAllTokenDispatcher.Config) -> DedupAllToAllTokenDispatcher.Config:
    """A stock model's all-to-all dispatcher -> the de-duplicating one (with recording)."""
    return derive(cfg, DedupAllToAllTokenDispatcher.Config)
