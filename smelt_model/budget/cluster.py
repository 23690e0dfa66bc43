"""A projected training-step time on a GPU cluster, from the ledger and the communication
ledger. It is a model on paper, not a measurement.

    from smelt_model import budget, presets
    cluster = budget.parse_cluster("h100-64")            # or "gpus=64,inter=200Gb/s,..."
    p = budget.project_pair(*presets.pair("200M-S95"), cluster)
    p.looped.serial_s, p.gap("overlapped")

A cluster SPEC is comma-separated ``key=value`` pairs, optionally after a preset name
(``h100-64,ep=16``). What is omitted takes the defaults of an H100-class node:

=================  ===========  ==========================================================
key                default      meaning
=================  ===========  ==========================================================
``gpus``           8            GPUs in the job; all of them are FSDP ranks (``dp_shard``)
``gpus_per_node``  8            GPUs joined by the fast in-node links
``intra``          450 GB/s     in-node bandwidth per GPU and direction (NVLink 4: 900 GB/s
                                both ways); a bare number is GB/s
``inter``          400 Gb/s     inter-node bandwidth per GPU and direction (one 400 Gb/s
                                NIC per GPU); a bare number is Gb/s
``peak``           989 TFLOP/s  dense bf16 peak per GPU; a bare number is TFLOP/s
``mfu``            0.40         the fraction of ``peak`` the step's FLOPs run at
``ep``             8            expert-parallel degree (consecutive ranks form a group)
=================  ===========  ==========================================================

Bandwidths also take a unit: ``GB/s``, ``Gb/s``, ``TB/s`` or ``Tb/s`` (decimal units).
Presets: ``h100-8`` (one node, EP 8) and ``h100-64`` (8 nodes, EP 8 inside each node).

The projection, per rank and per step (``tokens_per_step`` split over ``gpus``):

* **compute** = the ledger's training FLOPs per token x tokens per rank / (peak x mfu); the
  same MFU for both architectures, so any kernel-level gap is left out.
* **EP** = the uniform-routing EP bytes of :func:`smelt_model.budget.comm` at the nominal
  link bandwidth. An EP group of ``ep`` consecutive ranks lives inside one node when
  ``ep <= gpus_per_node``; otherwise it spans ``ep / gpus_per_node`` nodes, and the bytes
  bound for the ``ep - gpus_per_node`` peers on other nodes leave through the GPU's NIC
  while the rest cross the in-node links, both at once (the slower of the two sets the time).
* **FSDP** = the FSDP bytes of :func:`~smelt_model.budget.comm` at the in-node bandwidth
  when the job fits one node, else at the inter-node bandwidth (a ring over nodes is paced
  by its inter-node hops).
* Step times: ``serial`` = compute + EP + FSDP (no overlap); ``fsdp_overlapped`` =
  max(compute, FSDP) + EP (FSDP2 prefetches the next unit's all-gather behind compute while
  the dispatch and combine sit on the MoE layer's critical path, as with a plain all-to-all
  dispatcher); ``overlapped`` = max(compute, EP + FSDP) (all communication hidden, e.g. by
  interleaving two micro-batches).
* The projected gap of a pair = (looped step time / baseline step time) / F ratio: 1.00
  means the looped model costs in time exactly what its FLOPs say.

Latency, congestion, stragglers, load imbalance and activation recompute are not modelled;
nominal bandwidths overstate what an all-to-all reaches, so put measured bus bandwidths in
the SPEC to move the projection closer to a real cluster.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any, Optional

from ..config import ModelConfig
from .comm import Comm, comm
from .ledger import compare, ledger

__all__ = [
    "CLUSTER_PRESETS",
    "TOKENS_PER_GPU",
    "Cluster",
    "Projection",
    "PairProjection",
    "parse_cluster",
    "project",
    "project_pair",
]

#: default tokens per GPU and step: one 32k-token micro-batch, the paper-shape benchmark's
TOKENS_PER_GPU = 32768

#: named cluster SPECs (see the module docstring)
CLUSTER_PRESETS = {
    "h100-8": "gpus=8,gpus_per_node=8,ep=8",
    "h100-64": "gpus=64,gpus_per_node=8,ep=8",
}

_BANDWIDTH_UNITS = {"GB/s": 1e9, "TB/s": 1e12, "Gb/s": 1e9 / 8, "Tb/s": 1e12 / 8}
_MODES = ("serial", "fsdp_overlapped", "overlapped")


@dataclass(frozen=True)
class Cluster:
    """A cluster for :func:`project`; bandwidths in bytes/s per GPU and direction, ``peak``
    in FLOP/s per GPU (see the module docstring for the meaning and the defaults)."""

    gpus: int = 8
    gpus_per_node: int = 8
    intra: float = 450e9
    inter: float = 400e9 / 8
    peak: float = 989e12
    mfu: float = 0.40
    ep: int = 8

    def __post_init__(self) -> None:
        for name in ("gpus", "gpus_per_node", "ep"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"cluster {name} must be a positive int, got {v!r}")
        for name in ("intra", "inter", "peak"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                raise ValueError(f"cluster {name} must be positive and finite, got {v!r}")
        if (
            isinstance(self.mfu, bool)
            or not isinstance(self.mfu, (int, float))
            or not 0 < self.mfu <= 1
        ):
            raise ValueError(f"cluster mfu must lie in (0, 1], got {self.mfu!r}")
        g, n, ep = self.gpus, self.gpus_per_node, self.ep
        if g > n and g % n:
            raise ValueError(f"cluster gpus ({g}) must fill whole nodes of gpus_per_node ({n})")
        if g % ep:
            raise ValueError(
                f"cluster ep ({ep}) must divide gpus ({g}): every GPU is a "
                f"data-parallel rank and EP groups are carved out of them"
            )
        if (ep <= n and n % ep) or (ep > n and ep % n):
            raise ValueError(
                f"cluster ep ({ep}) and gpus_per_node ({n}) must divide one "
                f"another, so that an EP group fills whole nodes or sits in one"
            )

    @property
    def nodes(self) -> int:
        return max(1, self.gpus // self.gpus_per_node)

    def ep_peers(self) -> tuple[int, int]:
        """(peers of a rank in its EP group on the same node, peers on other nodes)."""
        inside = min(self.ep, self.gpus_per_node) - 1
        return inside, self.ep - 1 - inside

    def describe(self) -> str:
        inside, outside = self.ep_peers()
        where = "in one node" if outside == 0 else f"over {self.ep // self.gpus_per_node} nodes"
        return (
            f"{self.gpus} GPUs ({self.gpus_per_node} per node), intra "
            f"{self.intra / 1e9:g} GB/s, inter {self.inter * 8 / 1e9:g} Gb/s, peak "
            f"{self.peak / 1e12:g} TFLOP/s, MFU {self.mfu:g}, EP {self.ep} ({where})"
        )


def _number(key: str, text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise ValueError(f"cluster {key} must be a number, got {text!r}") from None
    if not 0 < v < float("inf"):
        raise ValueError(f"cluster {key} must be positive and finite, got {text!r}")
    return v


def _bandwidth(key: str, text: str, bare: float) -> float:
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([A-Za-z/]*)\s*", text)
    if m is None:
        raise ValueError(f"cluster {key} must be a bandwidth such as 400Gb/s, got {text!r}")
    unit = m.group(2)
    if not unit:
        return _number(key, m.group(1)) * bare
    scale = _BANDWIDTH_UNITS.get(unit)  # case matters: B is bytes, b is bits
    if scale is None:
        raise ValueError(f"cluster {key}: unknown unit {unit!r} (use GB/s, Gb/s, TB/s or Tb/s)")
    return _number(key, m.group(1)) * scale


def _integer(key: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"cluster {key} must be an int, got {text!r}") from None


def _items(spec: str, what: str) -> dict[str, str]:
    keys = [f.name for f in fields(Cluster)]
    out: dict[str, str] = {}
    for item in spec.split(","):
        key, sep, text = (s.strip() for s in item.partition("="))
        if not sep or key not in keys:
            raise ValueError(
                f"{what} item {item.strip()!r}: expected key=value with key one of "
                f"{', '.join(keys)}"
            )
        if key in out:
            raise ValueError(f"{what} gives {key} twice")
        out[key] = text
    return out


def _value(key: str, text: str) -> Any:
    if key in ("gpus", "gpus_per_node", "ep"):
        return _integer(key, text)
    if key == "intra":
        return _bandwidth(key, text, 1e9)
    if key == "inter":
        return _bandwidth(key, text, 1e9 / 8)
    if key == "peak":
        return _number(key, text.removesuffix("TFLOP/s").strip()) * 1e12
    return _number(key, text)


def parse_cluster(spec: Any) -> Cluster:
    """A :class:`Cluster` from a SPEC string (see the module docstring); ValueError naming
    the bad key. A :class:`Cluster` passes through."""
    if isinstance(spec, Cluster):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"cluster spec must be a str, got {type(spec).__name__}")
    spec = spec.strip()
    if not spec:
        raise ValueError("cluster spec is empty")
    head, comma, rest = spec.partition(",")
    given: dict[str, str] = {}
    if "=" not in head:
        if head.strip() not in CLUSTER_PRESETS:
            raise ValueError(
                f"unknown cluster preset {head.strip()!r}; presets: "
                f"{', '.join(CLUSTER_PRESETS)}, or key=value pairs"
            )
        given = _items(CLUSTER_PRESETS[head.strip()], "cluster preset")
        if not comma:
            return Cluster(**{key: _value(key, text) for key, text in given.items()})
        spec = rest
    given.update(_items(spec, "cluster spec"))
    return Cluster(**{key: _value(key, text) for key, text in given.items()})


@dataclass(frozen=True)
class Projection:
    """A projected step of one architecture on one cluster (seconds per step)."""

    cluster: Cluster
    comm: Comm
    compute_s: float
    ep_s: float
    fsdp_s: float

    @property
    def serial_s(self) -> float:
        """No overlap: compute, then every collective."""
        return self.compute_s + self.ep_s + self.fsdp_s

    @property
    def fsdp_overlapped_s(self) -> float:
        """FSDP hidden behind compute, the all-to-alls on the critical path."""
        return max(self.compute_s, self.fsdp_s) + self.ep_s

    @property
    def overlapped_s(self) -> float:
        """All communication hidden behind compute where it fits."""
        return max(self.compute_s, self.ep_s + self.fsdp_s)

    def step_s(self, mode: str) -> float:
        """The step time of ``mode``: ``serial``, ``fsdp_overlapped`` or ``overlapped``."""
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {', '.join(_MODES)}, got {mode!r}")
        return getattr(self, f"{mode}_s")


@dataclass(frozen=True)
class PairProjection:
    """Projections of a baseline and its looped model on one cluster, with the F ratio."""

    baseline: Projection
    looped: Projection
    flops_ratio: float

    def gap(self, mode: str = "serial") -> float:
        """(looped step time / baseline step time) / F ratio under ``mode``."""
        return self.looped.step_s(mode) / self.baseline.step_s(mode) / self.flops_ratio


def _tokens(cluster: Cluster, tokens_per_step: Optional[int]) -> int:
    return TOKENS_PER_GPU * cluster.gpus if tokens_per_step is None else tokens_per_step


def project(
    cfg: ModelConfig,
    cluster: Any,
    tokens_per_step: Optional[int] = None,
    *,
    dtype: Any = "bfloat16",
    reduce_dtype: Any = "float32",
    reshard_after_forward: bool = True,
    mean_doc_len: float = 800,
    seq_len: int = 4096,
) -> Projection:
    """The projected step of ``cfg`` on ``cluster`` (a :class:`Cluster` or a SPEC string);
    ``tokens_per_step`` defaults to :data:`TOKENS_PER_GPU` per GPU. The other arguments go
    to :func:`smelt_model.budget.comm` and :func:`smelt_model.budget.ledger`."""
    cl = parse_cluster(cluster)
    c = comm(
        cfg,
        _tokens(cl, tokens_per_step),
        ep=cl.ep,
        dp_shard=cl.gpus,
        dtype=dtype,
        reduce_dtype=reduce_dtype,
        reshard_after_forward=reshard_after_forward,
    )
    flops = ledger(cfg, mean_doc_len, seq_len).flops_per_token * c.tokens_per_rank
    inside, outside = cl.ep_peers()
    peers = inside + outside
    ep_s = (
        0.0
        if peers == 0
        else max(c.ep_bytes * inside / peers / cl.intra, c.ep_bytes * outside / peers / cl.inter)
    )
    fsdp_link = cl.intra if cl.gpus <= cl.gpus_per_node else cl.inter
    return Projection(
        cluster=cl,
        comm=c,
        compute_s=flops / (cl.peak * cl.mfu),
        ep_s=ep_s,
        fsdp_s=c.fsdp_bytes / fsdp_link,
    )


def project_pair(
    baseline_cfg: ModelConfig,
    looped_cfg: ModelConfig,
    cluster: Any,
    tokens_per_step: Optional[int] = None,
    **kwargs: Any,
) -> PairProjection:
    """:func:`project` for both models of a pair (same arguments), with the F ratio of
    :func:`smelt_model.budget.compare`."""
    cl = parse_cluster(cluster)
    a = project(baseline_cfg, cl, tokens_per_step, **kwargs)
    b = project(looped_cfg, cl, tokens_per_step, **kwargs)
    doc = kwargs.get("mean_doc_len", 800), kwargs.get("seq_len", 4096)
    return PairProjection(
        baseline=a, looped=b, flops_ratio=compare(baseline_cfg, looped_cfg, *doc).flops
    )
