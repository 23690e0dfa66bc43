"""Where a step's time goes, part by part, measured inside the step itself.

:func:`account` runs a step under ``torch.profiler`` (CPU activity only, no shapes) with a
record-function scope around every module the caller names, and attributes every profiled
event of the step to one *part*:

- a forward op to the part of the innermost named module it ran in, unless its name starts
  with one of ``ops`` (an op that is a part of its own wherever it runs, such as a fused
  expert kernel inside a module that is otherwise routing);
- a backward node (``autograd::engine::evaluate_function: ...``) to the part of the forward
  op that recorded it: autograd gives the node that op's sequence number, so the backward
  of a projection is the projection's, the backward of a residual add the block's;
- any other top-level event (the optimizer's step, gradient accumulation, ...) by the
  prefixes in ``named``, else to ``default``;
- the time inside a module's scope that no op covers (Python between the ops) to that
  module's part, and the step's time that no event covers to :attr:`StepAccount.untraced`.

The parts then add up to the profiled step by construction; what the account is worth is
how close the profiled step stays to the step timed without the profiler
(:attr:`Account.overhead`), which :func:`account` measures around it in the same loop. On
the CPU the backward runs on the calling thread, so one thread's events hold the whole step.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import torch
from torch import nn

__all__ = ["StepAccount", "Account", "account"]

_SCOPE = "smelt.part:"
_STEP = "smelt.step"
_BACKWARD = "autograd::engine::evaluate_function: "


@dataclass
class StepAccount:
    """One profiled step: its wall-clock, each part's milliseconds, and the step's time no
    profiled event covered."""

    wall_ms: float
    parts_ms: dict[str, float]
    untraced_ms: float

    @property
    def total_ms(self) -> float:
        return sum(self.parts_ms.values()) + self.untraced_ms


@dataclass
class Account:
    """Per part the median over the profiled steps, with the step timed without the
    profiler in the same loop (``plain_ms``)."""

    parts_ms: dict[str, float]
    untraced_ms: float
    profiled_ms: float
    plain_ms: float
    steps: list[StepAccount] = field(default_factory=list)

    @property
    def overhead(self) -> float:
        """The profiled step's time over the plain step's, less one: what the profiler and
        the scopes added (the account describes a step this much slower)."""
        return self.profiled_ms / self.plain_ms - 1.0 if self.plain_ms > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "parts_ms": dict(self.parts_ms),
            "untraced_ms": self.untraced_ms,
            "profiled_ms": self.profiled_ms,
            "plain_ms": self.plain_ms,
            "overhead": self.overhead,
            "steps": len(self.steps),
        }


def _install(scopes: Mapping[nn.Module, str]) -> list:
    """A record-function scope around each named module's forward; the handles to remove."""
    handles = []
    for module, part in scopes.items():
        label = _SCOPE + part
        open_: list = []

        def pre(_m, _a, _label=label, _open=open_):
            rf = torch.autograd.profiler.record_function(_label)
            rf.__enter__()
            _open.append(rf)

        def post(_m, _a, _o, _open=open_):
            _open.pop().__exit__(None, None, None)

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post, always_call=True))
    return handles


@contextlib.contextmanager
def _quiet_stderr():
    """Send file descriptor 2 to the null device for the block: torch's profiler library
    writes a line to it at every start and stop (``USDT: ... profiler_start``) whatever its
    log level, which would interleave with the caller's own output."""
    sys.stderr.flush()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


class _Profile:
    """``torch.profiler.profile`` over CPU activity, started and stopped with its lines to
    stderr silenced; the step between runs with stderr as it was."""

    def __enter__(self):
        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        with _quiet_stderr():
            self.prof.__enter__()
        return self.prof

    def __exit__(self, *exc):
        with _quiet_stderr():
            return self.prof.__exit__(*exc)


def _us(e) -> float:
    return e.time_range.elapsed_us()


class _Attributor:
    def __init__(self, ops: Mapping[str, str], named: Mapping[str, str], default: str):
        self.ops, self.named, self.default = ops, named, default
        self.by_seq: dict[int, str] = {}
        self.us: dict[str, float] = {}

    def _add(self, part: str, us: float) -> None:
        self.us[part] = self.us.get(part, 0.0) + us

    def _op_part(self, name: str, part: str) -> str:
        for prefix, p in self.ops.items():
            if name.startswith(prefix):
                return p
        return part

    def _remember(self, e, part: str) -> None:
        if e.sequence_nr is not None and e.sequence_nr >= 0:
            # an op that records no node peeks the next number: the last op to carry a
            # number before it is taken is the one whose node the backward runs
            self.by_seq[e.sequence_nr] = part
        for c in e.cpu_children:
            self._remember(c, part)

    def event(self, e, part: Optional[str]) -> None:
        """Attribute ``e`` (inside the scope of ``part``; None: at the step's top level)."""
        name = e.name
        if name.startswith(_SCOPE):
            inner = name[len(_SCOPE) :]
            kids = sorted(e.cpu_children, key=lambda c: c.time_range.start)
            self._add(inner, max(0.0, _us(e) - sum(_us(c) for c in kids)))
            for c in kids:
                self.event(c, inner)
            return
        if name.startswith(_BACKWARD):
            seq = e.sequence_nr
            p = self.by_seq.get(seq) if seq is not None else None
            if p is None:
                p = self._named(name[len(_BACKWARD) :])
            self._add(p, _us(e))
            return
        if part is None:
            p = self._op_part(name, self._named(name))
        else:
            p = self._op_part(name, part)
        self._remember(e, p)
        self._add(p, _us(e))

    def _named(self, name: str) -> str:
        for prefix, p in self.named.items():
            if name.startswith(prefix):
                return p
        return self.default


def _attribute(step_event, ops, named, default) -> tuple[dict[str, float], float]:
    at = _Attributor(ops, named, default)
    kids = sorted(step_event.cpu_children, key=lambda c: c.time_range.start)
    for c in kids:
        at.event(c, None)
    untraced = max(0.0, _us(step_event) - sum(_us(c) for c in kids))
    return {k: v / 1e3 for k, v in at.us.items()}, untraced / 1e3


def account(
    step: Callable[[], Any],
    scopes: Mapping[nn.Module, str],
    *,
    ops: Optional[Mapping[str, str]] = None,
    named: Optional[Mapping[str, str]] = None,
    default: str = "rest",
    steps: int = 2,
    parts: Optional[tuple[str, ...]] = None,
) -> Account:
    """Profile ``steps`` calls of ``step`` (already warmed up) and attribute each one's time
    to parts (module docstring); between profiled calls, and once before, the step runs
    without the profiler and is timed, so the account says how much the profiler added.

    ``scopes`` maps modules to parts; ``ops`` op-name prefixes to parts (overriding the
    scope); ``named`` prefixes of other top-level events (``"Optimizer."``,
    ``"torch::autograd::AccumulateGrad"``) to parts; ``parts`` the parts to report, in
    order (every one present, at 0.0 when the step had none of it; others are added to
    ``default``, which must be one of them). CPU steps only: a CUDA step's time is on the
    device, not in these events.
    """
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if parts is not None and default not in parts:
        raise ValueError(f"parts must hold the default part {default!r}, got {parts!r}")
    ops, named = dict(ops or {}), dict(named or {})
    plain, runs = [], []
    t0 = time.perf_counter()
    step()
    plain.append((time.perf_counter() - t0) * 1e3)
    handles = _install(scopes)
    try:
        for _ in range(steps):
            with _Profile() as prof:
                t0 = time.perf_counter()
                with torch.autograd.profiler.record_function(_STEP):
                    step()
                wall = (time.perf_counter() - t0) * 1e3
            tops = [e for e in prof.events() if e.name == _STEP]
            if len(tops) != 1:
                raise RuntimeError(f"the profiler recorded {len(tops)} step scopes, not 1")
            by_part, untraced = _attribute(tops[0], ops, named, default)
            runs.append(StepAccount(wall, by_part, untraced))
            for h in handles:  # the plain step runs without the scopes
                h.remove()
            t0 = time.perf_counter()
            step()
            plain.append((time.perf_counter() - t0) * 1e3)
            handles = _install(scopes)
    finally:
        for h in handles:
            h.remove()
    names = list(parts) if parts is not None else []
    for r in runs:
        for k in list(r.parts_ms):
            if parts is not None and k not in names:
                r.parts_ms[default] = r.parts_ms.get(default, 0.0) + r.parts_ms.pop(k)
            elif k not in names:
                names.append(k)
    med = {k: statistics.median(r.parts_ms.get(k, 0.0) for r in runs) for k in names}
    return Account(
        parts_ms=med,
        untraced_ms=statistics.median(r.untraced_ms for r in runs),
        profiled_ms=statistics.median(r.wall_ms for r in runs),
        plain_ms=statistics.median(plain),
        steps=runs,
    )
