"""Counting the bytes that go through the expert-parallel all-to-alls of a run.

:class:`CountingAllToAllTokenDispatcher` is torchtitan's ``AllToAllTokenDispatcher``
(the SMELT models use it; :func:`count_all_to_all` puts it into a stock model) that, when
counting is on, records every token all-to-all it runs and the routing that caused it.
Counting is on when the environment variable ``SMELT_TITAN_COMM`` names a folder (or after
:func:`enable`); each rank then writes ``comm_rank<R>.json`` there when the process exits
(or on :func:`write`). :func:`read` loads a folder back.

Definitions (one rank, one EP group of ``ep`` ranks, rows of ``D`` elements):

* ``dispatch`` / ``forward``: the all-to-all that sends this rank's routed (token, slot)
  rows to the ranks owning their experts: ``input_splits[j]`` rows to EP rank j.
* ``combine`` / ``forward``: the reverse all-to-all that returns the expert outputs:
  ``output_splits[j]`` rows to rank j (the rows j had sent here).
* ``dispatch`` / ``backward`` sends the gradients of the received rows back
  (``output_splits[j]`` rows to j); ``combine`` / ``backward`` sends the gradients of the
  returned rows (``input_splits[j]`` rows to j). Both are recorded when autograd reaches
  them.
* Every event keeps ``rows_to`` (rows sent to each EP rank, this rank's own entry
  included) and ``row_bytes`` (``D`` times the element size of the tensor sent).
  ``bytes_to_others`` excludes this rank's own split (it never leaves the rank);
  ``bytes_total`` includes it. Per-step totals (``steps``) give both.
* ``counts`` / ``forward``: the small all-to-all of per-expert token counts that precedes
  each dispatch (``E / ep`` int64 per destination).
* ``calls``: one entry per executed MoE layer (in execution order, so a looped layer
  appears once per visit) with ``routing``: how many (token, slot) pairs this rank sent to
  each of the ``E`` experts. Stacking the ``routing`` rows of one call over the EP ranks
  gives the (ep, E) routing matrix (:func:`routing_matrices`).

Steps are torchtitan's training steps (1-based); a recomputed forward (activation
checkpointing) runs and counts its all-to-alls again.
"""

from __future__ import annotations

import atexit
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torchtitan.config.override import derive, override
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

__all__ = [
    "CountingAllToAllTokenDispatcher",
    "Recorder",
    "RECORDER",
    "enable",
    "write",
    "read",
    "routing_matrices",
    "count_all_to_all",
    "ENV",
    "FORMAT",
]

ENV = "SMELT_TITAN_COMM"
FORMAT = "smelt-titan-comm/1"
PHASES = ("forward", "backward")
KINDS = ("dispatch", "combine")

DEFINITION = (
    "rows_to[j]: rows this rank sent to EP rank j in the all-to-all (own rank "
    "included); bytes_to_others excludes the own split, bytes_total includes it; "
    "row_bytes = hidden size x element size"
)


def _step() -> Optional[int]:
    from torchtitan.observability import structured_logger as sl

    step = sl.get_step()
    return None if step is None else int(step)


class Recorder:
    """The events of this process (see the module docstring)."""

    def __init__(self) -> None:
        self.folder: Optional[Path] = None
        self.events: list[dict[str, Any]] = []
        self.calls: list[dict[str, Any]] = []
        self.ep_rank: Optional[int] = None
        self.ep_size: Optional[int] = None
        self.rank = 0
        self._registered = False

    @property
    def enabled(self) -> bool:
        return self.folder is not None

    def enable(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        if not self._registered:
            atexit.register(self.write)
            self._registered = True

    def add(self, kind: str, phase: str, rows_to: list[int], row_bytes: int, call: int) -> None:
        mine = self.ep_rank if self.ep_rank is not None else 0
        total = int(sum(rows_to)) * row_bytes
        self.events.append(
            {
                "call": call,
                "step": _step(),
                "kind": kind,
                "phase": phase,
                "rows_to": [int(r) for r in rows_to],
                "row_bytes": int(row_bytes),
                "bytes_total": total,
                "bytes_to_others": total - int(rows_to[mine]) * row_bytes,
            }
        )

    def steps(self) -> dict[str, dict[str, int]]:
        """Per-step byte totals: ``<kind>_<phase>`` (to others) and ``..._including_self``."""
        out: dict[str, dict[str, int]] = {}
        for e in self.events:
            row = out.setdefault(str(e["step"]), {})
            key = f"{e['kind']}_{e['phase']}"
            row[key] = row.get(key, 0) + e["bytes_to_others"]
            row[key + "_including_self"] = row.get(key + "_including_self", 0) + e["bytes_total"]
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "definition": DEFINITION,
            "rank": self.rank,
            "ep_rank": self.ep_rank,
            "ep_size": self.ep_size,
            "calls": self.calls,
            "events": self.events,
            "steps": self.steps(),
        }

    def write(self) -> Optional[Path]:
        """Write ``comm_rank<R>.json`` into the folder (when counting is on)."""
        if self.folder is None or not (self.events or self.calls):
            return None
        data = self.to_dict()
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"comm_rank{data['rank']}.json"
        path.write_text(json.dumps(data) + "\n")
        return path


RECORDER = Recorder()
if os.environ.get(ENV):
    RECORDER.enable(os.environ[ENV])


def enable(folder: str | os.PathLike) -> None:
    """Turn counting on for this process; files go to ``folder``."""
    RECORDER.enable(folder)


def write() -> Optional[Path]:
    return RECORDER.write()


class _CountBackward(torch.autograd.Function):
    """Identity whose backward records the all-to-all that is about to carry the gradient."""

    @staticmethod
    def forward(ctx, x, kind, rows_to, call):
        ctx.info = (kind, rows_to, call)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        kind, rows_to, call = ctx.info
        RECORDER.add(kind, "backward", rows_to, grad.shape[-1] * grad.element_size(), call)
        return grad, None, None, None


class CountingAllToAllTokenDispatcher(AllToAllTokenDispatcher):
    """torchtitan's all-to-all token dispatcher, recording its traffic when counting is on.

    Without counting it is exactly the stock dispatcher. With counting, each dispatch also
    reads this rank's per-expert counts back to the host (the split sizes already are).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(AllToAllTokenDispatcher.Config):
        pass

    def _record_call(self, num_local_tokens_per_expert_E: torch.Tensor) -> int:
        RECORDER.ep_size, RECORDER.ep_rank = self.ep_mesh.size(), self.ep_mesh.get_local_rank()
        RECORDER.rank = torch.distributed.get_rank()
        call = len(RECORDER.calls)
        RECORDER.calls.append(
            {
                "call": call,
                "step": _step(),
                "routing": [int(c) for c in num_local_tokens_per_expert_E.tolist()],
            }
        )
        e = num_local_tokens_per_expert_E.shape[0] // RECORDER.ep_size
        RECORDER.add(
            "counts",
            "forward",
            [e] * RECORDER.ep_size,
            num_local_tokens_per_expert_E.element_size(),
            call,
        )
        return call

    def dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E):
        if RECORDER.enabled and self.ep_mesh is not None:
            self._call = self._record_call(num_local_tokens_per_expert_E)
        return super().dispatch(
            x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E
        )

    def _dispatch_token_exchange(self, routed_input_ND, pg, output_splits, input_splits):
        out = super()._dispatch_token_exchange(routed_input_ND, pg, output_splits, input_splits)
        return self._count("dispatch", routed_input_ND, out, input_splits, output_splits)

    def _combine_token_exchange(self, routed_output_RD, pg, input_splits, output_splits):
        out = super()._combine_token_exchange(routed_output_RD, pg, input_splits, output_splits)
        return self._count("combine", routed_output_RD, out, output_splits, input_splits)

    def _count(self, kind, sent, out, sent_splits, received_splits):
        """Record one exchange's forward bytes (``sent_splits`` rows of ``sent``'s width) and,
        through ``out``'s gradient, its backward (the rows received, sent back)."""
        if not RECORDER.enabled:
            return out
        row = sent.shape[-1] * sent.element_size()
        RECORDER.add(kind, "forward", sent_splits, row, self._call)
        if out.requires_grad:
            out = _CountBackward.apply(out, kind, list(received_splits), self._call)
        return out


@override(
    target=AllToAllTokenDispatcher.Config,
    exact=True,
    description="count the bytes of the expert-parallel all-to-alls",
)
def count_all_to_all(cfg: AllToAllTokenDispatcher.Config) -> CountingAllToAllTokenDispatcher.Config:
    """A stock model's all-to-all dispatcher -> the counting one (set ``SMELT_TITAN_COMM``)."""
    return derive(cfg, CountingAllToAllTokenDispatcher.Config)


def read(folder: str | os.PathLike) -> list[dict[str, Any]]:
    """The per-rank records in ``folder``, ordered by rank; ``ValueError`` if there are none."""
    files = sorted(
        Path(folder).glob("comm_rank*.json"), key=lambda p: int(p.stem[len("comm_rank") :])
    )
    if not files:
        raise ValueError(f"{folder}: no comm_rank*.json files")
    records = []
    for f in files:
        data = json.loads(f.read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"{f}: not a {FORMAT} file")
        records.append(data)
    return records


def routing_matrices(
    records: list[dict[str, Any]], step: Optional[int] = None
) -> list[list[list[int]]]:
    """The (ep, E) routing matrix of every executed MoE layer, in execution order.

    ``records``: the files of one EP group (as :func:`read` returns them); ``step``: only
    the calls of that training step. Row i is what EP rank i sent to each expert.
    """
    by_rank = sorted(records, key=lambda r: r["ep_rank"])
    per_rank = [[c for c in r["calls"] if step is None or c["step"] == step] for r in by_rank]
    n = {len(calls) for calls in per_rank}
    if len(n) != 1:
        raise ValueError(f"the ranks recorded different numbers of MoE calls: {sorted(n)}")
    return [[calls[i]["routing"] for calls in per_rank] for i in range(n.pop())]
