"""The self-test's runner: which implementations run on a device (:func:`units`), and one
implementation in one dtype over its op's cases against the float64 reference
(:func:`run_unit`). :func:`run` does both; the command line drives the same two steps from
a worker process.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch

from smelt_kernels import backends, testing

from .cases import CASES, Case
from .results import FAIL, PASS, SKIPPED, Result

__all__ = [
    "Unit",
    "DTYPES",
    "LOST",
    "resolve_device",
    "units",
    "run_unit",
    "run",
    "device_lost",
    "tolerances",
    "poisoned",
]

#: the dtypes every implementation is tried in (float16 where it takes it)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: (backend, dtype) rows that TRITON_INTERPRET=1 cannot stand in for: the interpreter's tl.dot
#: mishandles bfloat16, so the kernels compute bfloat16 in float32 there and a pass would say
#: nothing of the GPU's path
INTERPRETER_SKIPS = {
    ("triton", torch.bfloat16): "the Triton interpreter has no bfloat16 tl.dot (the kernels "
    "compute bfloat16 in float32 there, so a pass would not test "
    "the GPU's path)",
}


@dataclass(frozen=True)
class Unit:
    """One row to produce: ``op`` by ``backend`` in ``dtype`` (None when the backend cannot
    run at all), or skipped with ``skip`` (the reason)."""

    op: str
    backend: str
    dtype: Optional[torch.dtype]
    skip: Optional[str] = None

    @property
    def dtype_name(self) -> str:
        return "-" if self.dtype is None else str(self.dtype).replace("torch.", "")


def resolve_device(device) -> torch.device:
    """``device`` as a torch.device the self-test can run on; ValueError naming it if not."""
    try:
        dev = device if isinstance(device, torch.device) else torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device: {device!r} is not a device ({e})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device: {device} asked for, but no CUDA GPU is available "
                "(torch.cuda.is_available() is False)"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"device: {device} asked for, but there are only "
                f"{torch.cuda.device_count()} CUDA devices"
            )
    elif dev.type != "cpu":
        raise ValueError(f"device: the self-test runs on cpu or cuda, got {device!r}")
    return dev


def _names(what: str, asked: Optional[Sequence[str]], known: Sequence[str]) -> list[str]:
    if asked is None:
        return list(known)
    if isinstance(asked, str) or not all(isinstance(a, str) for a in asked):
        raise TypeError(f"{what}: give a list of names, got {asked!r}")
    unknown = [a for a in asked if a not in known]
    if unknown:
        raise ValueError(f"{what}: unknown {unknown[0]!r} (choose from {', '.join(known)})")
    return [k for k in known if k in asked]


def units(
    device="cpu",
    ops: Optional[Sequence[str]] = None,
    backend_names: Optional[Sequence[str]] = None,
    quick: bool = False,
) -> list[Unit]:
    """Every (op, backend, dtype) the self-test produces a row for on ``device``, in order:
    the shipped ops, then any registered later; backends in the order ``"auto"`` tries them
    (the reference last); dtypes. An implementation that cannot run on the device is one
    skipped row; a dtype it refuses, or one the Triton interpreter cannot stand in for, a
    skipped row of that dtype. ``quick`` leaves float16 out (on a GPU every dtype is a
    kernel compile). Bad names or devices, or an environment variable with a value smelt
    refuses: ValueError / TypeError."""
    dev = resolve_device(device)
    report = backends.report(dev)
    if report.problems:  # every row would fail on it: say so once, before any runs
        raise ValueError("; ".join(report.problems.values()))
    # the shipped ops in the order of their cases, then any registered later
    op_names = _names(
        "ops", ops, [op for op in CASES if op in report] + [op for op in report if op not in CASES]
    )
    chosen = _names("backends", backend_names, [f.name for f in backends.families()])
    units = []
    for op in op_names:
        for impl in (i for i in backends.implementations(op) if i.backend in chosen):
            name = impl.backend
            why = report[op][name]
            if why is None and op not in CASES:
                why = f"the self-test has no cases for op {op!r}"
            if why is not None:
                units.append(Unit(op, name, None, why))
                continue
            for dtype in DTYPES:
                if dtype == torch.float16 and (quick or impl.dtype_reason(dtype) is not None):
                    continue  # float16 only where a backend takes it
                skip = impl.dtype_reason(dtype)
                if skip is None and backends.triton_interpret():
                    skip = INTERPRETER_SKIPS.get((name, dtype))
                units.append(Unit(op, name, dtype, skip))
    return units


# ----------------------------------------------------------------------------- comparing
class Refused(Exception):
    """The op refuses a case's inputs (its reference raises ValueError or TypeError): the
    case is not defined, and is skipped."""


def _upstream(case: Case, outs: Sequence[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """The random upstream gradient of each differentiable output, rounded to ``dtype``
    (every path then gets the same values), on the CPU."""
    g = torch.Generator().manual_seed(1000 + case.seed)
    return [torch.randn(o.shape, generator=g).to(dtype) for o in outs[: case.grad_outputs]]


def _with_grads(
    case: Case, t: dict, outs: Sequence[torch.Tensor], upstream: Sequence[torch.Tensor]
) -> dict:
    """{name: tensor}: the outputs ``outs`` of a call on ``t`` and the gradients of the
    differentiable inputs (``d<name>``) through ``upstream``."""
    leaves = [t[n] for n in case.differentiable]
    heads = outs[: case.grad_outputs]
    ups = [u.to(device=o.device, dtype=o.dtype) for u, o in zip(upstream, heads)]
    grads = torch.autograd.grad(heads, leaves, ups, allow_unused=True)
    got = dict(zip(case.outputs, (o.detach() for o in outs)))
    for name, leaf, gr in zip(case.differentiable, leaves, grads):
        got[f"d{name}"] = torch.zeros_like(leaf) if gr is None else gr
    return got


def _leaves(case: Case, t: dict) -> dict:
    return {n: v.detach().requires_grad_(n in case.differentiable) for n, v in t.items()}


def _evaluate(case: Case, backend: str, dtype: torch.dtype, device) -> tuple[dict, dict, dict]:
    """(got, reference, plain), each {output or gradient name: tensor}: ``backend`` on
    ``device`` (with a second forward without autograd, ``<name> (no grad)``), the op's
    "torch" backend in float64 from the same inputs rounded to ``dtype``, and plain PyTorch
    in ``dtype`` (both on the CPU)."""
    low = case.inputs(dtype, "cpu", grad=False)
    ref_in = _leaves(case, {n: v.double() if v.is_floating_point() else v for n, v in low.items()})
    try:
        ref_outs = case.call("torch", ref_in)
    except (ValueError, TypeError) as e:
        raise Refused(str(e)) from None
    upstream = _upstream(case, ref_outs, dtype)
    ref = _with_grads(case, ref_in, ref_outs, upstream)
    plain_in = _leaves(case, low)
    plain_outs = case.plain(plain_in) if case.plain is not None else case.call("torch", plain_in)
    plain = _with_grads(case, plain_in, plain_outs, upstream)
    t = case.inputs(dtype, device, grad=True)
    got = _with_grads(case, t, case.call(backend, t), upstream)
    with torch.no_grad():
        outs = case.call(backend, {n: v.detach() for n, v in t.items()})
    for name, o in zip(case.outputs, outs):
        key = f"{name} (no grad)"
        got[key], ref[key], plain[key] = o, ref[name], plain[name]
    return got, ref, plain


def tolerances() -> dict:
    """The tolerance table the comparisons use, as plain data (what the JSON records)."""
    return {k: asdict(v) for k, v in testing.TOLERANCES.items()}


#: what a row's failures say when its device became unusable (a new process must go on)
LOST = "the device is unusable after this error"


def device_lost(e: BaseException) -> bool:
    """Whether ``e`` leaves the CUDA context unusable for this process (an illegal memory
    access or another sticky error: every later call would fail with it)."""
    accel = getattr(torch, "AcceleratorError", None)
    return (accel is not None and isinstance(e, accel)) or "CUDA error" in str(e)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def run_case(
    case: Case, backend: str, dtype: torch.dtype, device: torch.device
) -> tuple[float, list[str]]:
    """(worst normalised error, failures) of one case on ``backend`` in ``dtype``."""
    got, ref, plain = _evaluate(case, backend, dtype, device)
    worst, failures = 0.0, []
    for name, r in ref.items():
        if name not in got:
            worst = math.inf
            failures.append(f"case {case.name!r}: {name}: missing from the outputs")
            continue
        output = name.split(" ")[0]
        norm, why = testing.compare(
            name,
            got[name],
            r,
            plain[name],
            dtype,
            exact=output in case.exact,
            floor_dtype=torch.float32 if output in case.float32_outputs else None,
        )
        worst = max(worst, norm)
        if why is not None:
            failures.append(f"case {case.name!r}: {why}")
    return worst, failures


def run_unit(
    unit: Unit, device, quick: bool = False, on_case: Optional[Callable[[str, Result], None]] = None
) -> Result:
    """The row of ``unit``: its op's cases (``quick``: the marked few) on its backend in its
    dtype, each against the float64 reference, forward (with and without autograd) and
    backward. ``on_case(name, row)`` is called before each case runs, with the row so far
    (that case counted)."""
    dev = resolve_device(device)
    row = Result(unit.op, unit.backend, unit.dtype_name, SKIPPED, reason=unit.skip or "")
    if unit.skip is not None:
        return row
    t0 = time.perf_counter()
    variants: list[str] = []
    skipped: dict[str, int] = {}
    worst = 0.0
    for case in CASES[unit.op]():
        if quick and not case.quick:
            continue
        try:  # whether the backend takes these inputs at all, and the variant it runs
            choice = backends.select(
                unit.op,
                *case.select(case.inputs(unit.dtype, dev, grad=False)),
                backend=unit.backend,
            )
        except (TypeError, ValueError, backends.BackendUnavailableError) as e:
            reason = str(e).split(": ", 1)[-1]
            skipped[reason] = skipped.get(reason, 0) + 1
            continue
        row.cases += 1
        try:
            variant = choice.variant
        except Exception as e:  # what select() tells a user must not raise either
            variant = None
            row.failures.append(f"case {case.name!r}: select(...).variant raised {_first_line(e)}")
            worst = math.inf
        if variant and variant not in variants:
            variants.append(variant)
            row.variant = ",".join(variants)
        if on_case is not None:
            on_case(case.name, row)
        lost = False
        try:
            norm, failures = run_case(case, unit.backend, unit.dtype, dev)
        except Refused as e:
            row.cases -= 1
            reason = f"the op refuses them ({str(e).splitlines()[0]})"
            skipped[reason] = skipped.get(reason, 0) + 1
            continue
        except Exception as e:  # a kernel that raises fails its case; the run goes on
            norm, failures = math.inf, [f"case {case.name!r}: raised {_first_line(e)}"]
            lost = device_lost(e)
            if lost:
                failures.append(f"{LOST}: the rest of this row did not run")
        worst = max(worst, norm)
        row.failures.extend(failures)
        if lost:
            break
    row.seconds = time.perf_counter() - t0
    notes = [f"{n} case{'s' if n > 1 else ''} skipped: {why}" for why, n in skipped.items()]
    row.reason = "; ".join(notes)
    if row.cases == 0:
        row.verdict = SKIPPED
        row.reason = row.reason or "no cases"
        return row
    row.worst = worst
    row.verdict = FAIL if row.failures or not worst <= 1.0 else PASS
    return row


@contextlib.contextmanager
def poisoned() -> Iterator[None]:
    """SMELT_POISON=1 for the duration: every kernel output starts as NaN, so an element a
    kernel forgets to write fails instead of passing by luck."""
    old = os.environ.get("SMELT_POISON")
    os.environ["SMELT_POISON"] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ["SMELT_POISON"]
        else:
            os.environ["SMELT_POISON"] = old


def run(
    device="cpu",
    quick: bool = False,
    ops: Optional[Sequence[str]] = None,
    backends: Optional[Sequence[str]] = None,
    progress: Optional[Callable[[Unit], None]] = None,
) -> list[Result]:
    """Every registered implementation that can run on ``device`` against its op's
    reference; one :class:`~smelt_tools.selftest.results.Result` per op, backend and
    dtype (see :func:`units`). ``progress(unit)`` is called before each row runs."""
    todo = units(device, ops, backends, quick)
    out = []
    with poisoned():
        for unit in todo:
            if progress is not None:
                progress(unit)
            out.append(run_unit(unit, device, quick))
    return out
