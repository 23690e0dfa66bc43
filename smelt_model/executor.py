"""The persistent looped-block executor.

A looped model executes ``prelude -> span x r -> coda``. :class:`LoopSchedule` (defined in
:mod:`smelt_model.schedule`, re-exported here) turns that recipe into a static sequence of
:class:`Step` s (physical layer, visit, KV-cache slot, residual scale); this module runs any
stack of blocks along it:

* :class:`LoopedSpan` holds the shared span layers and runs all ``r`` visits in one
  ``forward`` call, so a sharding wrapper (FSDP2 ``fully_shard``) can treat the span as one
  unit that is gathered once and used r times; gradients of every visit accumulate into the
  shared weights through ordinary autograd.
* :class:`Interleaved` runs several chunks of a batch through the blocks at once, switching
  between them where a block waits on an exchange (chunked overlap of expert-parallel
  all-to-alls with compute): a block that offers ``phases`` is run as a generator.
* :class:`Executor` runs the schedule with an activation policy (``recompute``): ``"none"``
  keeps every activation, ``"visit1"`` recomputes the span's first visit in backward (its
  activations are the ones held longest), ``"all"`` recomputes every executed layer,
  ``"all-but-N"`` every one but the last N (:meth:`LoopSchedule.recomputed` says which).
  Recomputation uses non-reentrant activation checkpointing, run to the end of the layer
  (no early stop: a recomputed layer runs every exchange of its forward again). Chunks of
  an :class:`Interleaved` batch are recomputed together: they meet before the layer
  (each finishes the step it is in), run it interleaved under one checkpoint, and meet
  after it; the backward's recompute runs them interleaved again.
* :func:`activation_memory` measures the bytes a step saves for backward (any device),
  and the peak allocated memory on CUDA.
* :class:`CapturedCall` captures a static-shape, sync-free callable (a forward, or a whole
  training step) into a CUDA graph once and replays it; :func:`maybe_capture` falls back to
  eager with a clear message when capture is impossible (no CUDA, or capture failed).

A block is any module called as ``block(x, ctx, step) -> (x, extra)``: ``ctx`` is the
per-forward context the model passes through (rotary tables, segment ids, KV cache...),
``extra`` a scalar tensor to sum over executed layers (e.g. a router loss) or None.
Returning it, rather than stashing it in ``ctx``, keeps the step a pure function, as
activation checkpointing and torch.compile need.

**Phases.** A block may also offer ``block.phases(x, ctx, step)``: a generator that does
the same work, pausing where it has started an exchange whose result it needs later. At
each pause it yields its *carry* (the tensors it holds across the pause, those that need
gradients among them) and is resumed with the same tensors sent back; it returns ``(x,
extra)``. :class:`Interleaved` drives such generators, one per chunk, round-robin: chunk
a runs to its next pause, then chunk b, then a again... so one chunk's exchange is in flight
while the other computes. Passed between sharded units in place of ``x``, an ``Interleaved``
keeps every carried tensor in its ``carries`` field, where FSDP2's hooks see them (their
gradients trigger the unit's backward gather and gradient reduction as ``x``'s would).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from smelt_model.schedule import RECOMPUTE_POLICIES, LoopSchedule, Step

__all__ = [
    "Step",
    "LoopSchedule",
    "LoopedSpan",
    "Interleaved",
    "Executor",
    "RECOMPUTE_POLICIES",
    "activation_memory",
    "ActivationMemory",
    "CapturedCall",
    "maybe_capture",
]


class Executor:
    """Runs blocks along a :class:`LoopSchedule` with an activation-recompute policy."""

    def __init__(self, schedule: LoopSchedule, recompute: str = "none"):
        self.schedule = schedule
        self.recompute = recompute

    @property
    def recompute(self) -> str:
        return self._recompute

    @recompute.setter
    def recompute(self, policy: str) -> None:
        self._slots = self.schedule.recomputed(policy)
        self._recompute = policy

    def should_recompute(self, step: Step) -> bool:
        return step.slot in self._slots

    def run_step(
        self, block: nn.Module, x: torch.Tensor, ctx: Any, step: Step
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        if torch.is_grad_enabled() and self.should_recompute(step):
            if isinstance(x, Interleaved):
                return x.checkpointed(block, step), None
            return checkpoint(block, x, ctx, step, use_reentrant=False, early_stop=False)
        return block(x, ctx, step)

    def run(
        self,
        blocks: Callable[[int], nn.Module],
        x: torch.Tensor,
        ctx: Any,
        steps: Optional[Iterable[Step]] = None,
        extra: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Run ``steps`` (default: the whole schedule); ``blocks(layer)`` gives a physical layer.

        Returns the final ``x`` and the sum of the blocks' extras (added to ``extra``).
        """
        for step in self.schedule.steps if steps is None else steps:
            x, e = self.run_step(blocks(step.layer), x, ctx, step)
            if e is not None:
                extra = e if extra is None else extra + e
        return x, extra


class LoopedSpan(nn.Module):
    """The shared span: its layers, executed ``schedule.count`` times in one forward call."""

    def __init__(self, layers: Sequence[nn.Module], executor: Executor):
        super().__init__()
        if len(layers) != executor.schedule.length:
            raise ValueError(
                f"the span has {executor.schedule.length} layers in the schedule, got {len(layers)}"
            )
        self.layers = nn.ModuleList(layers)
        self.executor = executor

    def forward(
        self, x: torch.Tensor, ctx: Any, extra: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        start, span = self.executor.schedule.start, self.executor.schedule.span
        return self.executor.run(lambda layer: self.layers[layer - start], x, ctx, span, extra)


# ----------------------------------------------------------------------------- interleaving
class _Chunk:
    """One chunk's program: its context, its paused generator (None between steps), the
    step that generator runs, and the extras of its finished steps."""

    __slots__ = ("ctx", "gen", "step", "extras")

    def __init__(self, ctx: Any):
        self.ctx = ctx
        self.gen: Any = None
        self.step: Optional[Step] = None
        self.extras: list[Any] = []


@dataclass
class Interleaved:
    """Chunks of a batch in flight through a stack of blocks (see the module docstring).

    ``carries[c]``: the tensors chunk c holds: ``(x,)`` between steps, its paused block's
    carry inside one. Make one with :meth:`start`, pass it to each sharded unit in place of
    ``x`` (a block's ``forward`` and :class:`LoopedSpan` hand it to :meth:`advance`), and end
    with :meth:`finish`.
    """

    carries: list[tuple[torch.Tensor, ...]]
    chunks: list[_Chunk]  # not a container FSDP looks into
    #: every chunk finishes the steps of each :meth:`advance` (none left paused in them)
    meet: bool = False

    @classmethod
    def start(
        cls, xs: Sequence[torch.Tensor], ctxs: Sequence[Any], meet: bool = False
    ) -> "Interleaved":
        """The chunks ``xs`` (one context each), before the first step."""
        if len(xs) != len(ctxs) or not xs:
            raise ValueError(f"need one context per chunk, got {len(xs)} chunks, {len(ctxs)}")
        return cls([(x,) for x in xs], [_Chunk(c) for c in ctxs], meet)

    def _resume(self, c: int, blocks: Callable[[int], nn.Module], todo: list[Step]) -> bool:
        """Run chunk c to its next pause (True) or until ``todo`` is done (False)."""
        chunk = self.chunks[c]
        while True:
            if chunk.gen is None:
                if not todo:
                    return False
                step = chunk.step = todo.pop(0)
                chunk.gen = blocks(step.layer).phases(self.carries[c][0], chunk.ctx, step)
                send = None
            else:
                send = self.carries[c]
            try:
                self.carries[c] = tuple(chunk.gen.send(send))
                return True
            except StopIteration as stop:
                x, extra = stop.value
                self.carries[c], chunk.gen = (x,), None
                chunk.extras.append(extra)

    def advance(self, blocks: Callable[[int], nn.Module], steps: Sequence[Step]) -> "Interleaved":
        """Run every chunk through ``steps`` (``blocks(layer)`` gives a physical layer), in
        turns; chunk 0 finishes them all, the others may stay paused inside the last one (an
        exchange left in flight while the next unit's first chunk computes)."""
        steps = list(steps)
        n = len(self.chunks)
        todo = [list(steps) for _ in range(n)]  # a chunk may first finish its previous step
        running = [True] * n
        while running[0]:
            for c in range(n):
                running[c] = running[c] and self._resume(c, blocks, todo[c])
                if not running[0]:
                    break  # the others stay paused where chunk 0's compute covered them
        last = steps[-1] if steps else None
        for c in range(1, n):
            while running[c] and (todo[c] or self.chunks[c].step is not last or self.meet):
                running[c] = self._resume(c, blocks, todo[c])
        return Interleaved(list(self.carries), self.chunks, self.meet)

    def drained(self) -> "Interleaved":
        """Every chunk finished with the step it is in (its exchanges waited for)."""
        for c in range(len(self.chunks)):
            while self._resume(c, None, []):  # type: ignore[arg-type]
                pass
        return Interleaved(list(self.carries), self.chunks, self.meet)

    def checkpointed(self, block: nn.Module, step: Step) -> "Interleaved":
        """Every chunk through ``step`` of ``block`` under one activation checkpoint: the
        chunks meet before and after it, and run it interleaved, in the forward and in the
        backward's recompute (``block(chunks, None, step)``, as an unchecked step is run)."""
        state = self.drained()
        ctxs = [chunk.ctx for chunk in state.chunks]

        def run(*xs: torch.Tensor):
            inner, _ = block(Interleaved.start(xs, ctxs, meet=True), None, step)
            return tuple(c[0] for c in inner.carries), [ch.extras[-1] for ch in inner.chunks]

        ys, extras = checkpoint(
            run, *(c[0] for c in state.carries), use_reentrant=False, early_stop=False
        )
        for chunk, extra in zip(state.chunks, extras):
            chunk.extras.append(extra)
        return Interleaved([(y,) for y in ys], state.chunks)

    def finish(self, fn: Callable[[torch.Tensor], Any]) -> list[Any]:
        """Finish every chunk in turn and return ``fn(x)`` of each: chunk 0's ``fn`` runs
        while the others' last exchanges are still in flight."""
        out = []
        for c in range(len(self.chunks)):
            while self._resume(c, None, []):  # type: ignore[arg-type]
                pass
            out.append(fn(self.carries[c][0]))
        return out

    def extras(self) -> list[list[Any]]:
        """Per executed step (in order), the extra each chunk's block returned."""
        per_chunk = [chunk.extras for chunk in self.chunks]
        if len({len(e) for e in per_chunk}) != 1:
            raise RuntimeError("the chunks did not run the same steps")
        return [list(e) for e in zip(*per_chunk)]


# ----------------------------------------------------------------------------- memory
@dataclass
class ActivationMemory:
    """What a step kept for backward, and (on CUDA) its peak allocation."""

    saved_bytes: int
    saved_tensors: int
    peak_allocated_bytes: Optional[int]

    def to_dict(self) -> dict[str, Optional[int]]:
        return {
            "saved_bytes": self.saved_bytes,
            "saved_tensors": self.saved_tensors,
            "peak_allocated_bytes": self.peak_allocated_bytes,
        }


def activation_memory(
    fn: Callable[[], Any],
    device: Optional[torch.device] = None,
    exclude: Iterable[torch.Tensor] = (),
) -> tuple[Any, ActivationMemory]:
    """Run ``fn()`` (a forward) and measure the activation memory it keeps for backward.

    Saved tensors are counted once per storage (views share it); tensors in ``exclude``
    (typically the parameters) do not count. On CUDA the peak allocated bytes during the
    call, above what was allocated before it, are reported too.
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}
    count = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        count[0] += 1
        try:
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr not in skip and ptr not in seen:
                seen[ptr] = st.nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. fake)
            pass
        # an alias without autograd history: handing back t itself makes a saved output
        # refer to its own grad_fn, a cycle through the C++ graph that the garbage collector
        # cannot see, and the whole graph (parameters and activations) would never be freed
        return t.detach()

    cuda = device is not None and torch.device(device).type == "cuda"
    base = 0
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    peak = None
    if cuda:
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    return out, ActivationMemory(sum(seen.values()), count[0], peak)


# ----------------------------------------------------------------------------- CUDA graphs
class CapturedCall:
    """A callable captured once into a CUDA graph and replayed with static buffers.

    ``fn(*static_inputs)`` must have static shapes and no host synchronisation. Inputs are
    copied into the static buffers on each call; the returned tensors are the graph's static
    outputs (overwritten by the next replay: clone them to keep them).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        example_inputs: Sequence[torch.Tensor],
        warmup: int = 3,
        pool: Any = None,
    ):
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA graph capture needs a CUDA device")
        if any(not isinstance(t, torch.Tensor) or t.device.type != "cuda" for t in example_inputs):
            raise ValueError("every example input must be a CUDA tensor")
        self.fn = fn
        self.static_inputs = [t.detach().clone() for t in example_inputs]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(max(1, warmup)):
                fn(*self.static_inputs)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.static_outputs = fn(*self.static_inputs)

    def __call__(self, *inputs: torch.Tensor) -> Any:
        if len(inputs) != len(self.static_inputs):
            raise ValueError(f"expected {len(self.static_inputs)} inputs, got {len(inputs)}")
        for buf, t in zip(self.static_inputs, inputs):
            if t.shape != buf.shape or t.dtype != buf.dtype:
                raise ValueError(
                    f"captured with input {tuple(buf.shape)} {buf.dtype}, got "
                    f"{tuple(t.shape)} {t.dtype}: capture again for new shapes"
                )
            buf.copy_(t, non_blocking=True)
        self.graph.replay()
        return self.static_outputs


class _Eager:
    def __init__(self, fn: Callable[..., Any], reason: str):
        self.fn = fn
        self.reason = reason
        self.graph = None

    def __call__(self, *inputs: torch.Tensor) -> Any:
        return self.fn(*inputs)


def maybe_capture(
    fn: Callable[..., Any],
    example_inputs: Sequence[torch.Tensor],
    capture: bool = True,
    warmup: int = 3,
) -> Callable[..., Any]:
    """:class:`CapturedCall` when ``capture`` and possible, else ``fn`` run eagerly.

    Falling back emits a ``RuntimeWarning`` that says why; the returned object's ``graph``
    attribute is None in that case and ``reason`` holds the message.
    """
    if not capture:
        return _Eager(fn, "capture not requested")
    if not torch.cuda.is_available() or any(t.device.type != "cuda" for t in example_inputs):
        reason = "CUDA graph capture needs CUDA tensors; running eagerly"
        warnings.warn(reason, RuntimeWarning, stacklevel=2)
        return _Eager(fn, reason)
    try:
        return CapturedCall(fn, example_inputs, warmup=warmup)
    except Exception as e:  # capture is impossible: data-dependent shapes, host syncs, ...
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()
        reason = f"CUDA graph capture failed ({type(e).__name__}: {e}); running eagerly"
        warnings.warn(reason, RuntimeWarning, stacklevel=2)
        return _Eager(fn, reason)
