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

The recorder attaches with forward hooks on the model's blocks and their layers (the
parameter-free ``SegmentAttention.core`` and ``MoE.topk`` submodules expose q/k/v, the
attention output and the routing); only the hooks the requested names need are registered,
and all are removed when the ``with`` block ends, so outside a capture the model runs no
recording code at all. Records are detached; with activation recomputation a recomputed
layer overwrites its record with identical values.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterable, Iterator, Optional

import torch

from smelt_model.block import Block

__all__ = ["PROBES", "Recorder", "capture"]

PROBES = (
    "x",
    "x_out",
    "attn_write",
    "moe_write",
    "q",
    "k",
    "v",
    "pv",
    "o",
    "sink",
    "router_ids",
    "router_weights",
)


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


_ACTIVE: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def _attach(block, rec: Recorder) -> list:
    """Register the hooks ``rec`` needs on one :class:`smelt_model.block.Block`."""
    state: dict = {}
    handles = []
    w = rec.wants

    def block_pre(_, args):
        x, _ctx, step = args
        state["step"], state["shape"] = step, x.shape[:-1]
        rec.record(step, "x", x)

    handles.append(block.register_forward_pre_hook(block_pre))
    if w("x_out"):
        handles.append(
            block.register_forward_hook(
                lambda _, args, out: rec.record(state["step"], "x_out", out[0])
            )
        )

    def write(name):
        def hook(_, args, out):
            step = state["step"]
            out = out[0] if isinstance(out, tuple) else out  # MoE(..., return_aux=True)
            rec.record(step, name, out * step.scale if step.scale != 1.0 else out)

        return hook

    if w("attn_write"):
        handles.append(block.attn.register_forward_hook(write("attn_write")))
    if w("o"):
        handles.append(
            block.attn.register_forward_hook(
                lambda _, args, out: rec.record(state["step"], "o", out)
            )
        )
    if w("moe_write"):
        handles.append(block.moe.register_forward_hook(write("moe_write")))
    if any(w(n) for n in ("q", "k", "v", "pv", "sink")):

        def attend(_, args, out):
            q, k, v = args[:3]
            step, T = state["step"], q.shape[1]
            for name, t in (("q", q), ("k", k[:, -T:]), ("v", v[:, -T:]), ("pv", out[0])):
                rec.record(step, name, t)
            if out[1] is not None:
                rec.record(step, "sink", out[1])

        handles.append(block.attn.core.register_forward_hook(attend))
    if w("router_ids") or w("router_weights"):

        def route(_, args, out):
            weights, ids = out
            lead = tuple(state["shape"])
            rec.record(state["step"], "router_ids", ids.view(*lead, -1))
            rec.record(state["step"], "router_weights", weights.view(*lead, -1))

        handles.append(block.moe.topk.register_forward_hook(route))
    return handles


@contextlib.contextmanager
def capture(
    model, what: Optional[Iterable[str]] = None, to_cpu: bool = False
) -> Iterator[Recorder]:
    """Record probes from every forward of ``model`` inside the ``with`` block.

    ``model`` is a :class:`smelt_model.SmeltLM` (any module whose blocks are
    :class:`smelt_model.block.Block`); records are keyed by (physical layer, visit).
    """
    if model in _ACTIVE:
        raise RuntimeError("a capture is already active on this model")
    rec = Recorder(what, to_cpu=to_cpu)
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    if not blocks:
        raise ValueError(
            f"capture needs a model built of smelt_model.block.Block, got {type(model).__name__}"
        )
    handles, sinks = [], []
    _ACTIVE.add(model)
    try:
        for blk in blocks:
            handles += _attach(blk, rec)
            if rec.wants("sink"):
                sinks.append((blk.attn.core, blk.attn.core.keep_sink))
                blk.attn.core.keep_sink = True
        yield rec
    finally:
        for h in handles:
            h.remove()
        for core, keep in sinks:
            core.keep_sink = keep
        _ACTIVE.discard(model)
