"""What a run's collectives put on the wire: the byte recorder of the SMELT runs on torchtitan.

:data:`RECORDER` is on when the environment variable ``SMELT_TITAN_COMM`` names a folder
(read at first use) or after :func:`enable`; each rank then writes ``comm_rank<R>.json`` there
when the process exits (or on :func:`write`). :func:`read` loads a folder back;
:func:`routing_matrices` and :func:`token_rank_matrices` stack the ranks' records into the
matrices :func:`smelt_model.cluster.comm` takes (``routing=``, ``token_ranks=``). The
dispatchers of :mod:`smelt_model.titan.moe.dispatch` and the FSDP collectives of
:mod:`smelt_model.titan.parallel.parallelize` report here; nothing is recorded while it is off.

Definitions (one rank, one expert-parallel group of ``ep`` ranks, rows of ``D`` elements):

* ``calls``: one entry per executed MoE call on an ``ep`` layer (in execution order: a looped
  layer once per visit; with the chunked overlap, once per chunk), with ``routing`` (how many
  (token, slot) pairs this rank sent to each of the ``E`` experts), ``token_ranks`` (how many
  distinct tokens of this rank have at least one of their experts on each EP rank, its own
  included), ``dedup`` (whether a row was a (token, rank) pair), ``chunk`` (which part of
  the batch it carried: 0, or 0 to chunks - 1 with the chunked overlap) and ``recompute``
  (whether it was a recomputed forward, run inside the backward; the matrices below leave
  those out: they repeat the forward's routing).
* token all-to-all events (``dispatch`` / ``combine``, ``forward`` / ``backward``) keep
  ``rows_to`` (rows sent to each EP rank, this rank's own entry included) and ``row_bytes``
  (``D`` times the element size). ``dispatch`` / ``forward`` sends this rank's routed rows
  out ((token, slot) rows, or (token, rank) rows with de-duplication); ``combine`` /
  ``forward`` returns the rows the rank received; the backward of each sends the gradients
  the opposite way; a recomputed forward's exchanges have the phase ``recompute``.
  ``bytes_to_others`` excludes the rank's own split (it never leaves the rank),
  ``bytes_total`` includes it.
* ``counts`` / ``forward``: the small exchange of per-expert counts before each dispatch
  (int64; de-duplicating, with the number of rows), the ledger's ``Comm.ep.counts_*``;
  ``slots`` / ``forward``: with de-duplication, each row's local expert ids (int32) and
  routing scores (fp32, ``top_k`` each), and ``slots`` / ``backward`` the scores'
  gradients: the ledger's ``Comm.ep.slots_*``.
* ``fsdp``: every FSDP all-gather and reduce-scatter (and the all-reduce between replicas of
  an HSDP group) of a parameter group that holds the expert weights of a ``gather`` layer,
  with its process group (``group``: the mesh's dimension names, ``group_size``), its phase,
  ``bytes_to_others`` (ring convention: ``(n - 1) x`` the padded shard a rank holds, ``2 (n
  - 1) / n x`` the shard for the all-reduce) and ``expert_bytes_to_others`` (the part that
  is gather-layer expert weights).
* ``steps``: per training step (torchtitan's, 1-based) the totals ``<kind>_<phase>`` (bytes
  to others) and ``<kind>_<phase>_including_self`` of the token exchanges, and
  ``gather_all_gather_forward``, ``gather_all_gather_backward``, ``gather_reduce_scatter``
  and ``gather_all_reduce`` (the expert part of the FSDP collectives), named as the fields
  of :class:`smelt_model.cluster.Comm` that predict them (``Comm.gather.all_gather_forward``
  for ``gather_all_gather_forward``; ``Comm.ep.dispatch_forward`` for ``dispatch_forward``).

A recomputed forward (activation checkpointing) runs and counts its exchanges again, as
``dispatch_recompute`` and ``combine_recompute`` (the fields of the same names of
:class:`smelt_model.cluster.Comm`'s ``ep``).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from smelt_kernels.families import env

__all__ = [
    "Recorder",
    "RECORDER",
    "enable",
    "write",
    "read",
    "check_folder",
    "routing_matrices",
    "token_rank_matrices",
    "ENV",
    "FORMAT",
]

ENV = "SMELT_TITAN_COMM"
FORMAT = "smelt-titan-comm/2"

DEFINITION = (
    "rows_to[j]: rows this rank sent to EP rank j in the all-to-all (own rank "
    "included); bytes_to_others excludes the own split, bytes_total includes it; "
    "row_bytes = hidden size x element size; fsdp bytes follow the ring convention"
)

#: per-step keys of the gather layers' expert weights, by FSDP collective and phase
FSDP_KEYS = {
    ("all_gather", "forward"): "gather_all_gather_forward",
    ("all_gather", "backward"): "gather_all_gather_backward",
    ("reduce_scatter", "backward"): "gather_reduce_scatter",
    ("all_reduce", "backward"): "gather_all_reduce",
}


def _step() -> Optional[int]:
    # torchtitan only while a run records: reading a folder back needs none
    from torchtitan.observability import structured_logger as sl

    step = sl.get_step()
    return None if step is None else int(step)


class Recorder:
    """The events of this process (see the module docstring)."""

    def __init__(self) -> None:
        self.folder: Optional[Path] = None
        self.events: list[dict[str, Any]] = []
        self.calls: list[dict[str, Any]] = []
        self.fsdp: list[dict[str, Any]] = []
        self.ep_rank: Optional[int] = None
        self.ep_size: Optional[int] = None
        self.rank = 0
        self._resolved = False
        self._registered = False

    @property
    def enabled(self) -> bool:
        if not self._resolved:  # the environment is read once, at first use
            self._resolved = True
            folder = env(ENV)
            if folder:
                self.enable(folder)
        return self.folder is not None

    def enable(self, folder: str | os.PathLike) -> None:
        self._resolved = True
        self.folder = Path(folder)
        if not self._registered:
            atexit.register(self.write)
            self._registered = True

    def call(
        self,
        routing: list[int],
        token_ranks: list[int],
        ep_rank: int,
        ep_size: int,
        dedup: bool,
        chunk: int = 0,
    ) -> int:
        """Record one MoE call on an ``ep`` layer (of batch chunk ``chunk``); returns its index."""
        self.ep_rank, self.ep_size = ep_rank, ep_size
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        index = len(self.calls)
        self.calls.append(
            {
                "call": index,
                "step": _step(),
                "routing": [int(c) for c in routing],
                "token_ranks": [int(c) for c in token_ranks],
                "dedup": bool(dedup),
                "chunk": int(chunk),
                "recompute": _phase() == "backward",
            }
        )
        return index

    def add(self, kind: str, phase: str, rows_to: list[int], row_bytes: int, call: int) -> None:
        """Record one exchange: ``rows_to[j]`` rows of ``row_bytes`` sent to EP rank j (a
        forward exchange run inside the backward is a recomputed one)."""
        if phase == "forward" and _phase() == "backward":
            phase = "recompute"
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

    def add_fsdp(
        self,
        kind: str,
        phase: str,
        group: str,
        group_size: int,
        bytes_to_others: float,
        expert_bytes_to_others: float,
    ) -> None:
        """Record one FSDP collective of a parameter group holding gather-layer experts."""
        self.fsdp.append(
            {
                "step": _step(),
                "kind": kind,
                "phase": phase,
                "group": group,
                "group_size": int(group_size),
                "bytes_to_others": bytes_to_others,
                "expert_bytes_to_others": expert_bytes_to_others,
            }
        )

    def steps(self) -> dict[str, dict[str, float]]:
        """Per-step byte totals (see the module docstring)."""
        out: dict[str, dict[str, float]] = {}
        for e in self.events:
            row = out.setdefault(str(e["step"]), {})
            key = f"{e['kind']}_{e['phase']}"
            row[key] = row.get(key, 0) + e["bytes_to_others"]
            row[key + "_including_self"] = row.get(key + "_including_self", 0) + e["bytes_total"]
        for e in self.fsdp:
            row = out.setdefault(str(e["step"]), {})
            key = FSDP_KEYS[(e["kind"], e["phase"])]
            row[key] = row.get(key, 0) + e["expert_bytes_to_others"]
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
            "fsdp": self.fsdp,
            "steps": self.steps(),
        }

    def write(self) -> Optional[Path]:
        """Write ``comm_rank<R>.json`` into the folder (when recording is on)."""
        if self.folder is None or not (self.events or self.calls or self.fsdp):
            return None
        if dist.is_initialized():
            self.rank = dist.get_rank()
        data = self.to_dict()
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"comm_rank{data['rank']}.json"
        path.write_text(json.dumps(data) + "\n")
        return path


RECORDER = Recorder()


def check_folder(folder: str | os.PathLike) -> Path:
    """Make sure the ranks can write their files into ``folder``: create it (and its parents)
    if it is missing, then create and remove a file in it. ``ValueError`` naming the folder
    and the reason otherwise (a file, a place this process may not write). The check writes
    for real: permission bits say nothing to a process that runs as root."""
    path = Path(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".comm-check-"):
            pass
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise ValueError(f"{ENV}={folder}: cannot write records there ({reason})") from None
    return path


def enable(folder: str | os.PathLike) -> None:
    """Turn recording on for this process; files go to ``folder``."""
    RECORDER.enable(folder)


def write() -> Optional[Path]:
    return RECORDER.write()


#: the name the recorder gives each rank's file; other names in the folder are not read
FILE_NAME = re.compile(r"comm_rank(\d+)\.json")

#: the fields every record holds, with their types (``ep_rank``/``ep_size`` may be null)
FIELDS = {"rank": int, "calls": list, "events": list, "fsdp": list, "steps": dict}


def read(folder: str | os.PathLike) -> list[dict[str, Any]]:
    """The per-rank records in ``folder``, ordered by rank.

    Only files named as the recorder names them (``comm_rank<R>.json``, R a number) are read;
    any other file is left alone. ``ValueError`` naming the folder if there are none, or
    naming the file and what is wrong with it if one is not a record of this format (not JSON,
    not an object, another format, a missing or mistyped field, a rank other than its name's).
    """
    ranks = {}
    for path in Path(folder).glob("comm_rank*.json"):
        match = FILE_NAME.fullmatch(path.name)
        if match:
            ranks[int(match.group(1))] = path
    if not ranks:
        raise ValueError(f"{folder}: no comm_rank<R>.json files")
    return [_record(ranks[rank], rank) for rank in sorted(ranks)]


def _record(path: Path, rank: int) -> dict[str, Any]:
    """One rank's record, checked (see :func:`read`)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: holds a {type(data).__name__}, not a {FORMAT} record")
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} file (format {data.get('format')!r})")
    for key, kind in FIELDS.items():
        value = data.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(f"{path}: {key!r} must be {kind.__name__}, got {value!r:.60}")
    for key in ("ep_rank", "ep_size"):
        value = data.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ValueError(f"{path}: {key!r} must be an int or null, got {value!r:.60}")
    for i, call in enumerate(data["calls"]):
        if not isinstance(call, dict) or not all(
            isinstance(call.get(key), list) and all(type(n) is int for n in call[key])
            for key in ("routing", "token_ranks")
        ):
            raise ValueError(f"{path}: calls[{i}] lacks integer lists 'routing' and 'token_ranks'")
    if data["rank"] != rank:
        raise ValueError(f"{path}: records rank {data['rank']}, its name says rank {rank}")
    return data


def _layer_calls(record: dict[str, Any], step: Optional[int], key: str) -> list[list[int]]:
    """One rank's ``key`` vectors per executed layer: the i-th call of every chunk summed."""
    chunks: dict[int, list[list[int]]] = {}
    for c in record["calls"]:
        if (step is None or c["step"] == step) and not c.get("recompute"):
            chunks.setdefault(c.get("chunk", 0), []).append(c[key])
    if not chunks:
        return []
    n = {len(v) for v in chunks.values()}
    if len(n) != 1:
        raise ValueError(f"rank {record['rank']}: the chunks recorded different numbers of calls")
    parts = list(chunks.values())
    return [[sum(vals) for vals in zip(*(p[i] for p in parts))] for i in range(n.pop())]


def _per_call(records: list[dict[str, Any]], step: Optional[int], key: str) -> list:
    by_rank = sorted((r for r in records if r["ep_rank"] is not None), key=lambda r: r["ep_rank"])
    if not by_rank:
        raise ValueError("no rank recorded an expert-parallel MoE call")
    per_rank = [_layer_calls(r, step, key) for r in by_rank]
    n = {len(calls) for calls in per_rank}
    if len(n) != 1:
        raise ValueError(f"the ranks recorded different numbers of MoE calls: {sorted(n)}")
    return [[calls[i] for calls in per_rank] for i in range(n.pop())]


def routing_matrices(
    records: list[dict[str, Any]], step: Optional[int] = None
) -> list[list[list[int]]]:
    """The (ep, E) routing matrix of every executed ``ep`` MoE layer, in execution order (the
    chunks of an overlapped run summed).

    ``records``: the files of ONE expert-parallel group (as :func:`read` returns them for a
    run whose EP group is the world; filter by rank otherwise); ``step``: only that
    training step's calls. Row i is what EP rank i sent to each expert.
    """
    return _per_call(records, step, "routing")


def token_rank_matrices(
    records: list[dict[str, Any]], step: Optional[int] = None
) -> list[list[list[int]]]:
    """The (ep, ep) token-rank matrix of every executed ``ep`` MoE layer: entry
    [i][j] is how many of rank i's tokens have at least one expert on EP rank j (the same
    ``records`` and ``step`` as :func:`routing_matrices`)."""
    return _per_call(records, step, "token_ranks")


# ----------------------------------------------------------------------------- FSDP
def _phase() -> str:
    return "backward" if torch._C._current_graph_task_id() != -1 else "forward"


def _group_name(mesh_info: Any) -> str:
    names = mesh_info.mesh.mesh_dim_names or ()
    dim = mesh_info.shard_mesh_dim
    return names[dim] if dim is not None and dim < len(names) else "shard"


class _Counted:
    """An FSDP communication (all-gather or reduce-scatter) of one parameter group, passed
    through to the group's own, that reports its bytes (see the module docstring)."""

    def __init__(self, inner: Any, kind: str, group: Any, expert_numel: int, total_numel: int):
        self.inner, self.kind = inner, kind
        self.mesh_info = group.mesh_info
        self.expert_numel, self.total_numel = expert_numel, total_numel
        self.hsdp = hasattr(self.mesh_info, "replicate_process_group")

    def allocate(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.allocate(*args, **kwargs)

    def __call__(self, output_tensor: Any, input_tensor: Any, group: Any, *args: Any, **kw: Any):
        n = group.size()
        elem = input_tensor.element_size()
        shard = input_tensor.numel() if self.kind == "all_gather" else output_tensor.numel()
        part = self.expert_numel / self.total_numel if self.total_numel else 0.0
        name = _group_name(self.mesh_info)
        sent = (n - 1) * shard * elem
        RECORDER.add_fsdp(self.kind, _phase(), name, n, sent, sent * part)
        if self.kind == "reduce_scatter" and self.hsdp:  # the replicas then all-reduce it
            m = self.mesh_info.replicate_process_group.size()
            sent = 2 * (m - 1) / m * shard * elem
            RECORDER.add_fsdp("all_reduce", "backward", name + "_replicas", m, sent, sent * part)
        return self.inner(output_tensor, input_tensor, group, *args, **kw)


def record_fsdp(model: Any, gather_params: set) -> int:
    """Report the FSDP collectives of every parameter group of ``model`` (sharded with FSDP2)
    that holds a parameter of ``gather_params`` (the ``gather`` layers' experts, as the
    sharded parameters); returns how many groups. Nothing happens while recording is off."""
    if not RECORDER.enabled:
        return 0
    # FSDP takes a second to load: only when its collectives are recorded
    from torch.distributed.fsdp import FSDPModule

    ids = {id(p) for p in gather_params}
    count = 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:
            sizes = [(fp.padded_sharded_param_size.numel(), fp) for fp in group.fsdp_params]
            experts = sum(n for n, fp in sizes if id(fp.sharded_param) in ids)
            if not experts:
                continue
            total = sum(n for n, _ in sizes)
            group._all_gather_comm = _Counted(
                group._all_gather_comm, "all_gather", group, experts, total
            )
            group._reduce_scatter_comm = _Counted(
                group._reduce_scatter_comm, "reduce_scatter", group, experts, total
            )
            count += 1
    return count
