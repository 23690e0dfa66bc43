"""A GPU cluster for the projected step time (:mod:`.projection`): a SPEC string, checked.

    from smelt_model import cluster
    c = cluster.parse_cluster("h100-64")                  # or "gpus=64,inter=200Gb/s,..."
    c = cluster.parse_cluster("h100-64,ep=16,memory=141GB")

A cluster SPEC is comma-separated ``key=value`` pairs, optionally after a preset name
(``h100-64,ep=16``). What is omitted takes the defaults of an H100-class node. Every value
must lie within the range below (a value outside it is not a cluster the model can say
anything useful about, and is refused with a ValueError naming the key):

=================  ===========  ===================  =========================================
key                default      range                meaning
=================  ===========  ===================  =========================================
``gpus``           8            1 .. 1,000,000       GPUs in the job; all are FSDP ranks
``gpus_per_node``  8            1 .. 1,024           GPUs joined by the fast in-node links
``intra``          450 GB/s     1 GB/s .. 100 TB/s   in-node bandwidth per GPU and direction
                                                     (NVLink 4: 900 GB/s both ways); a bare
                                                     number is GB/s
``inter``          400 Gb/s     1 Gb/s .. 100 Tb/s   inter-node bandwidth per GPU and
                                                     direction (one 400 Gb/s NIC per GPU); a
                                                     bare number is Gb/s
``peak``           989 TFLOP/s  1 .. 100,000 TFLOP/s dense bf16 peak per GPU; a bare number
                                                     is TFLOP/s
``mfu``            0.40         0.01 .. 1            the fraction of ``peak`` the FLOPs run at
``ep``             8            1 .. gpus            expert-parallel degree (consecutive ranks
                                                     form a group)
``memory``         80 GB        1 GB .. 10 TB        memory per GPU a plan must fit in; a bare
                                                     number is GB
``latency``        20 us        0 .. 10 ms           what every collective takes before its
                                                     bytes move (start-up and
                                                     synchronisation); a bare number is us
=================  ===========  ===================  =========================================

Bandwidths take a unit: ``GB/s``, ``Gb/s``, ``TB/s`` or ``Tb/s``; memory ``GB``, ``GiB``
or ``TB`` (decimal units except GiB); latency ``us``, ``ms`` or ``s``. Presets: ``h100-8``
(one node, EP 8) and ``h100-64`` (8 nodes, EP 8 inside each node).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from typing import Any, Optional

__all__ = ["CLUSTER_PRESETS", "TOKENS_PER_GPU", "Cluster", "parse_cluster"]

#: default tokens per GPU and step: one 32k-token micro-batch, the paper-shape benchmark's
TOKENS_PER_GPU = 32768

#: named cluster SPECs (see the module docstring)
CLUSTER_PRESETS = {
    "h100-8": "gpus=8,gpus_per_node=8,ep=8",
    "h100-64": "gpus=64,gpus_per_node=8,ep=8",
}

_BANDWIDTH_UNITS = {"GB/s": 1e9, "TB/s": 1e12, "Gb/s": 1e9 / 8, "Tb/s": 1e12 / 8}
_MEMORY_UNITS = {"GB": 1e9, "GiB": 2**30, "TB": 1e12}
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}

#: per key: (lowest, highest, the unit it is shown in, that unit's size)
_RANGES = {
    "gpus": (1, 1_000_000, "", 1),
    "gpus_per_node": (1, 1024, "", 1),
    "intra": (1e9, 1e14, "GB/s", 1e9),
    "inter": (1e9 / 8, 1e14 / 8, "Gb/s", 1e9 / 8),
    "peak": (1e12, 1e17, "TFLOP/s", 1e12),
    "mfu": (0.01, 1.0, "", 1),
    "memory": (1e9, 1e13, "GB", 1e9),
    "latency": (0.0, 1e-2, "us", 1e-6),
}


def _shown(key: str, v: float) -> str:
    _, _, unit, scale = _RANGES[key]
    if key in ("gpus", "gpus_per_node"):
        return str(v)
    return f"{v / scale:.6g}" + (f" {unit}" if unit else "")


@dataclass(frozen=True)
class Cluster:
    """A cluster for :func:`~smelt_model.cluster.project`; bandwidths in bytes/s per GPU and
    direction, ``peak`` in FLOP/s per GPU, ``memory`` in bytes per GPU, ``latency`` in
    seconds (the module docstring has the meaning, the defaults and the ranges)."""

    gpus: int = 8
    gpus_per_node: int = 8
    intra: float = 450e9
    inter: float = 400e9 / 8
    peak: float = 989e12
    mfu: float = 0.40
    ep: int = 8
    memory: float = 80e9
    latency: float = 20e-6

    def __post_init__(self) -> None:
        for name, (lo, hi, _, _) in _RANGES.items():
            v = getattr(self, name)
            integral = name in ("gpus", "gpus_per_node")
            if isinstance(v, bool) or not isinstance(v, int if integral else (int, float)):
                what = "an int" if integral else "a number"
                raise ValueError(f"cluster {name} must be {what}, got {v!r}")
            if not (math.isfinite(v) and lo <= v <= hi):
                raise ValueError(
                    f"cluster {name} must lie between {_shown(name, lo)} and "
                    f"{_shown(name, hi)}, got {_shown(name, v) if math.isfinite(v) else v}"
                )
        g, n, ep = self.gpus, self.gpus_per_node, self.ep
        if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
            raise ValueError(f"cluster ep must be a positive int, got {ep!r}")
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

    @property
    def node_size(self) -> int:
        """Ranks per node in this job (``gpus_per_node``, or ``gpus`` when fewer)."""
        return min(self.gpus, self.gpus_per_node)

    def ep_peers(self, ep: Optional[int] = None) -> tuple[int, int]:
        """(peers of a rank in its EP group of ``ep`` ranks (default: the cluster's) on the
        same node, peers on other nodes)."""
        ep = self.ep if ep is None else ep
        inside = min(ep, self.gpus_per_node) - 1
        return inside, ep - 1 - inside

    def describe(self) -> str:
        inside, outside = self.ep_peers()
        where = "in one node" if outside == 0 else f"over {self.ep // self.gpus_per_node} nodes"
        return (
            f"{self.gpus} GPUs ({self.gpus_per_node} per node), intra "
            f"{_shown('intra', self.intra)}, inter {_shown('inter', self.inter)}, peak "
            f"{_shown('peak', self.peak)}, MFU {self.mfu:g}, EP {self.ep} ({where}), "
            f"{_shown('memory', self.memory)} per GPU, {_shown('latency', self.latency)} per "
            f"collective"
        )


def _number(key: str, text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise ValueError(f"cluster {key} must be a number, got {text!r}") from None
    if not math.isfinite(v):
        raise ValueError(f"cluster {key} must be finite, got {text!r}")
    return v


def _with_unit(key: str, text: str, units: dict[str, float], bare: float) -> float:
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([A-Za-z/]*)\s*", text)
    if m is None:
        raise ValueError(
            f"cluster {key} must be a number with a unit ({', '.join(units)}), got {text!r}"
        )
    unit = m.group(2)
    if not unit:
        return _number(key, m.group(1)) * bare
    scale = units.get(unit)  # case matters: B is bytes, b is bits
    if scale is None:
        raise ValueError(f"cluster {key}: unknown unit {unit!r} (use {', '.join(units)})")
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
        return _with_unit(key, text, _BANDWIDTH_UNITS, 1e9)
    if key == "inter":
        return _with_unit(key, text, _BANDWIDTH_UNITS, 1e9 / 8)
    if key == "memory":
        return _with_unit(key, text, _MEMORY_UNITS, 1e9)
    if key == "latency":
        return _with_unit(key, text, _TIME_UNITS, 1e-6)
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
