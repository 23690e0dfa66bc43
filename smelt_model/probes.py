"""Probe hooks: record per executed layer and visit what the analysis tools need.

    with smelt_model.capture(model, what=["router_ids", "q", "k", "v", "sink"]) as rec:
        model(input_ids, segment_ids)
    rec[(layer, visit)]["q"]        # (B, T, n_heads, head_dim), detached

Names that can be recorded (:data:`PROBES`):

* ``x``: the block input (residual stream); ``x_out``: the block output
* ``attn_write``, ``moe_write``: the residual updates of the two sublayers as added
  (already scaled by 1/r inside the span); the whole layer's update is their sum
* ``q``, ``k``, ``v``: the attention inputs after RoPE (k, v for this call's tokens)
* ``pv``: the attention output before the output projection; ``o``: after it
* ``sink``: per-head mass on the segment's first token, (B, n_heads), from the attention op
* ``router_ids``, ``router_weights``: the top-k routing, (B, T, k)

When no capture is active the model does no recording work at all (one ``is None`` test per
block). Records are detached; with activation recomputation a recomputed layer overwrites its
record with identical values.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, Optional

import torch

__all__ = ["PROBES", "Recorder", "capture"]

PROBES = ("x", "x_out", "attn_write", "moe_write", "q", "k", "v", "pv", "o", "sink",
          "router_ids", "router_weights")


class Recorder:
    """Records keyed by (physical layer, visit), then by probe name."""

    def __init__(self, what: Optional[Iterable[str]] = None, to_cpu: bool = False):
        names = PROBES if what is None else tuple(what)
        unknown = sorted(set(names) - set(PROBES))
        if unknown:
            raise ValueError(f"unknown probe(s) {unknown}; choose from {PROBES}")
        self.what = frozenset(names)
        self.to_cpu = to_cpu
        self.records: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.order: list[tuple[int, int]] = []

    def wants(self, name: str) -> bool:
        return name in self.what

    def record(self, step, name: str, value: torch.Tensor) -> None:
        if name not in self.what:
            return
        key = (step.layer, step.visit)
        if key not in self.records:
            self.records[key] = {}
            self.order.append(key)
        t = value.detach()
        self.records[key][name] = t.cpu() if self.to_cpu else t

    def __getitem__(self, key: tuple[int, int]) -> dict[str, torch.Tensor]:
        return self.records[key]

    def __contains__(self, key) -> bool:
        return key in self.records

    def keys(self) -> list[tuple[int, int]]:
        """(layer, visit) keys in execution order."""
        return list(self.order)

    def get(self, name: str) -> list[torch.Tensor]:
        """One probe over all executed layers, in execution order."""
        return [self.records[k][name] for k in self.order if name in self.records[k]]

    def clear(self) -> None:
        self.records.clear()
        self.order.clear()


@contextlib.contextmanager
def capture(model, what: Optional[Iterable[str]] = None, to_cpu: bool = False) -> Iterator[Recorder]:
    """Record probes from every forward of ``model`` inside the ``with`` block."""
    if getattr(model, "_recorder", None) is not None:
        raise RuntimeError("a capture is already active on this model")
    rec = Recorder(what, to_cpu=to_cpu)
    model._recorder = rec
    try:
        yield rec
    finally:
        model._recorder = None
