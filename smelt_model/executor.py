"""The persistent looped-block executor.

A looped model executes ``prelude -> span x r -> coda``. :class:`LoopPlan` (defined in
:mod:`smelt_model.plan`, re-exported here) turns that recipe into a static sequence of
:class:`Step` s (physical layer, visit, KV-cache slot, residual scale); this module runs any
stack of blocks along it:

* :class:`LoopedSpan` holds the shared span layers and runs all ``r`` visits in one
  ``forward`` call, so a sharding wrapper (FSDP2 ``fully_shard``) can treat the span as one
  unit that is gathered once and used r times; gradients of every visit accumulate into the
  shared weights through ordinary autograd.
* :class:`Executor` runs the plan with an activation policy (``recompute``): ``"none"``
  keeps every activation, ``"visit1"`` recomputes the span's first visit in backward (its
  activations are the ones held longest), ``"all"`` recomputes every executed layer.
  Recomputation uses non-reentrant activation checkpointing.
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
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .plan import LoopPlan, Step

__all__ = [
    "Step",
    "LoopPlan",
    "LoopedSpan",
    "Executor",
    "RECOMPUTE_POLICIES",
    "activation_memory",
    "ActivationMemory",
    "CapturedCall",
    "maybe_capture",
]

RECOMPUTE_POLICIES = ("none", "visit1", "all")


class Executor:
    """Runs blocks along a :class:`LoopPlan` with an activation-recompute policy."""

    def __init__(self, plan: LoopPlan, recompute: str = "none"):
        self.plan = plan
        self.recompute = recompute

    @property
    def recompute(self) -> str:
        return self._recompute

    @recompute.setter
    def recompute(self, policy: str) -> None:
        if policy not in RECOMPUTE_POLICIES:
            raise ValueError(f"recompute must be one of {RECOMPUTE_POLICIES}, got {policy!r}")
        self._recompute = policy

    def should_recompute(self, step: Step) -> bool:
        if self._recompute == "all":
            return True
        if self._recompute == "visit1":
            return step.in_span and step.visit == 0 and self.plan.count > 1
        return False

    def run_step(
        self, block: nn.Module, x: torch.Tensor, ctx: Any, step: Step
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        if torch.is_grad_enabled() and self.should_recompute(step):
            return checkpoint(block, x, ctx, step, use_reentrant=False)
        return block(x, ctx, step)

    def run(
        self,
        blocks: Callable[[int], nn.Module],
        x: torch.Tensor,
        ctx: Any,
        steps: Optional[Iterable[Step]] = None,
        extra: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Run ``steps`` (default: the whole plan); ``blocks(layer)`` gives a physical layer.

        Returns the final ``x`` and the sum of the blocks' extras (added to ``extra``).
        """
        for step in self.plan.steps if steps is None else steps:
            x, e = self.run_step(blocks(step.layer), x, ctx, step)
            if e is not None:
                extra = e if extra is None else extra + e
        return x, extra


class LoopedSpan(nn.Module):
    """The shared span: its layers, executed ``plan.count`` times in one forward call."""

    def __init__(self, layers: Sequence[nn.Module], executor: Executor):
        super().__init__()
        if len(layers) != executor.plan.length:
            raise ValueError(
                f"the span has {executor.plan.length} layers in the plan, got {len(layers)}"
            )
        self.layers = nn.ModuleList(layers)
        self.executor = executor

    def forward(
        self, x: torch.Tensor, ctx: Any, extra: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        start = self.executor.plan.start
        return self.executor.run(
            lambda layer: self.layers[layer - start], x, ctx, self.executor.plan.span, extra
        )


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
