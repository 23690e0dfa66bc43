"""The timing, machine-description and command-line helpers every smelt benchmark shares.

* :func:`measure` times a callable with warm-up and repeats and returns a :class:`Timing`
  (median and 20/80 percentiles, in milliseconds). On CUDA it uses CUDA events around each
  call (after a synchronising warm-up); on the CPU, ``time.perf_counter``.
* :func:`measure_interleaved` times several callables round-robin;
  :func:`measure_parts` times a step and its components round-robin and checks that the
  components add up to the step (repeating the measurement when they exceed it).
* each ``measure*`` takes ``watch=`` (a :class:`smelt_tools.watch.Watch`): the timing's
  ``load`` then says what the machine did while it was measured, and whether the process
  got its cores. Wall-clock stays the measured quantity; the load only flags interference.
* :func:`environment` describes the machine, device, library versions and the date
  (:func:`cpu_name`: the processor's model name).
* :func:`result_row` gives a timing's columns in a benchmark's result row (median, p20, p80,
  spread, TFLOP/s, ratio to another timing); :func:`write_results` writes ``<name>.json``
  (every number plus the environment) and ``<name>.md`` (a Markdown table) under a folder.
* :func:`check_device`: a benchmark's ``--device`` as a device it can run on, or a
  :class:`~smelt_tools.cli.UsageError` naming the option.

This module needs only torch; it imports nothing from the model layer.
"""

from __future__ import annotations

import ctypes
import datetime as _dt
import gc
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

from .cli import UsageError

if TYPE_CHECKING:
    from .watch import Load, Watch

__all__ = [
    "Timing",
    "PartsTiming",
    "measure",
    "measure_interleaved",
    "measure_parts",
    "merge",
    "quantile",
    "release_memory",
    "environment",
    "cpu_name",
    "write_results",
    "result_row",
    "markdown_table",
    "tflops",
    "check_device",
]


# ----------------------------------------------------------------------------- timing
@dataclass
class Timing:
    """Wall-clock of repeated calls, in milliseconds."""

    median_ms: float
    p20_ms: float
    p80_ms: float
    min_ms: float
    repeats: int
    samples_ms: list[float] = field(default_factory=list, repr=False)
    #: what the machine did while these samples were taken (when measured with a Watch)
    load: Optional["Load"] = field(default=None, repr=False, compare=False)

    @property
    def spread(self) -> float:
        """(p80 - p20) / median: the relative spread of the samples."""
        return (self.p80_ms - self.p20_ms) / self.median_ms if self.median_ms > 0 else 0.0

    @classmethod
    def of(cls, samples: Sequence[float]) -> "Timing":
        """The timing of ``samples`` (milliseconds, at least one)."""
        if not samples:
            raise ValueError("a timing needs at least one sample")
        xs = list(samples)
        return cls(
            median_ms=statistics.median(xs),
            p20_ms=quantile(xs, 0.2),
            p80_ms=quantile(xs, 0.8),
            min_ms=min(xs),
            repeats=len(xs),
            samples_ms=xs,
        )

    def to_dict(self, samples: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not samples:
            d.pop("samples_ms")
        d["spread"] = self.spread
        d["load"] = self.load.to_dict() if self.load is not None else None
        return d


def quantile(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (linear between order statistics)."""
    if not xs:
        raise ValueError("quantile needs at least one value")
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def measure(
    fn: Callable[[], Any],
    *,
    device: Optional[torch.device | str] = None,
    warmup: int = 2,
    repeats: int = 5,
    min_time_s: float = 0.0,
    max_repeats: int = 1000,
    setup: Optional[Callable[[], Any]] = None,
    watch: Optional["Watch"] = None,
) -> Timing:
    """Time ``fn()``: ``warmup`` untimed calls, then at least ``repeats`` timed calls.

    More calls are made (up to ``max_repeats``) until ``min_time_s`` seconds have been
    timed. ``setup`` runs before each call, outside the timed region (e.g. zeroing grads).
    With a ``watch``, the timing's :attr:`~Timing.load` says what the machine did while the
    timed calls ran (the warm-up is not watched).
    """
    dev = torch.device(device) if device is not None else torch.device("cpu")
    cuda = dev.type == "cuda"
    for _ in range(max(0, warmup)):
        if setup is not None:
            setup()
        fn()
    if cuda:
        torch.cuda.synchronize(dev)
    mark = watch.start() if watch is not None else None
    samples: list[float] = []
    total = 0.0
    while len(samples) < repeats or (total < min_time_s and len(samples) < max_repeats):
        if setup is not None:
            setup()
        ms = _time_call(fn, cuda)
        samples.append(ms)
        total += ms / 1e3
    t = _timing(samples)
    if watch is not None:
        t.load = watch.stop(mark)
    return t


def _time_call(fn: Callable[[], Any], cuda: bool) -> float:
    if cuda:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _timing(samples: list[float]) -> Timing:
    return Timing.of(samples)


def merge(timings: Sequence[Timing]) -> Timing:
    """One :class:`Timing` from the samples of several (e.g. blocks of one measurement)."""
    samples = [x for t in timings for x in t.samples_ms]
    if not samples:
        raise ValueError("merge needs at least one timing with samples")
    return _timing(samples)


def measure_interleaved(
    fns: dict[Any, Callable[[], Any]],
    *,
    device: Optional[torch.device | str] = None,
    warmup: int = 2,
    repeats: int = 5,
    min_time_s: float = 0.0,
    max_repeats: int = 1000,
    on_round: Optional[Callable[[int], None]] = None,
    watch: Optional["Watch"] = None,
) -> dict[Any, Timing]:
    """Time several callables round-robin: warm each up, then call A, B, A, B, ...

    Drift of a shared machine (other load, clocks) then hits every callable alike, so the
    ratios of their medians are far steadier than those of back-to-back :func:`measure` runs.
    At least ``repeats`` rounds run, more (up to ``max_repeats``) until every callable has
    been timed for ``min_time_s`` seconds. ``on_round(r)`` is called after round ``r``
    (1-based) completes, e.g. to show progress. With a ``watch``, every timing's
    :attr:`~Timing.load` is that of the whole timed loop.
    """
    dev = torch.device(device) if device is not None else torch.device("cpu")
    cuda = dev.type == "cuda"
    for fn in fns.values():
        for _ in range(max(0, warmup)):
            fn()
    if cuda:
        torch.cuda.synchronize(dev)
    mark = watch.start() if watch is not None else None
    samples: dict[Any, list[float]] = {name: [] for name in fns}
    r = 0
    while r < repeats or (
        r < max_repeats and min((sum(xs) for xs in samples.values()), default=0) < min_time_s * 1e3
    ):
        for name, fn in fns.items():
            samples[name].append(_time_call(fn, cuda))
        r += 1
        if on_round is not None:
            on_round(r)
    load = watch.stop(mark) if watch is not None else None
    out = {name: _timing(xs) for name, xs in samples.items()}
    for t in out.values():
        t.load = load
    return out


@dataclass
class PartsTiming:
    """A step and its components, timed in one round-robin loop (:func:`measure_parts`)."""

    step: Timing
    parts: dict[str, Timing]
    counts: dict[str, int]
    #: sum over parts of median x count, divided by the step's median
    parts_fraction: float
    tolerance: float
    #: how many times the whole measurement ran (1 when the first one added up)
    tries: int

    @property
    def parts_ms(self) -> dict[str, float]:
        """Milliseconds per step of each part (its median times how often a step runs it)."""
        return {k: t.median_ms * self.counts[k] for k, t in self.parts.items()}

    @property
    def adds_up(self) -> bool:
        """False when the parts take longer than the step containing them (by > tolerance)."""
        return self.parts_fraction <= 1.0 + self.tolerance

    @property
    def note(self) -> Optional[str]:
        if self.adds_up:
            return None
        return (
            f"components sum to {100 * self.parts_fraction:.0f}% of the step (tolerance "
            f"{100 * self.tolerance:.0f}%) after {self.tries} tries: a shared or throttled "
            f"machine; treat this row's components as unreliable"
        )


def measure_parts(
    step: Callable[[], Any],
    parts: dict[str, tuple[Callable[[], Any], int]],
    *,
    device: Optional[torch.device | str] = None,
    warmup: int = 1,
    repeats: int = 5,
    tolerance: float = 0.15,
    max_tries: int = 3,
    watch: Optional["Watch"] = None,
) -> PartsTiming:
    """Time ``step`` and each part (``name -> (fn, times a step runs it)``) round-robin.

    Every repeat calls the step, then each part once, so load on a shared machine, clock
    changes and cache state hit the step and its parts alike: timed at different moments,
    their medians need not add up at all. Each part must run at the step's shapes and thread
    count. The parts cannot take longer than the step that contains them: when their sum
    exceeds the step by more than ``tolerance``, the whole measurement is repeated, up to
    ``max_tries`` times, and the last result says so (:attr:`PartsTiming.note`). With a
    ``watch``, the step's :attr:`~Timing.load` is that of the last measurement's loop.
    """
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must lie in [0, 1), got {tolerance!r}")
    if not isinstance(max_tries, int) or max_tries < 1:
        raise ValueError(f"max_tries must be a positive int, got {max_tries!r}")
    fns = {"__step__": step, **{k: fn for k, (fn, _) in parts.items()}}
    counts = {k: n for k, (_, n) in parts.items()}
    for tries in range(1, max_tries + 1):
        t = measure_interleaved(
            fns, device=device, warmup=warmup if tries == 1 else 0, repeats=repeats, watch=watch
        )
        st = t.pop("__step__")
        total = sum(t[k].median_ms * counts[k] for k in t)
        res = PartsTiming(
            st, t, counts, total / st.median_ms if st.median_ms > 0 else 0.0, tolerance, tries
        )
        if res.adds_up:
            break
    return res


def release_memory() -> None:
    """Collect garbage and hand freed heap pages back to the system (the native kernels'
    block pool, then glibc ``malloc_trim``), so that the next model built does not sit on
    top of the last one's freed memory."""
    gc.collect()
    try:
        # the kernels load their extensions: this module needs only torch (module docstring)
        from smelt_kernels.moe_gemm import release_cpu_pool

        release_cpu_pool()  # the native kernels' unused output blocks
    except ImportError:
        pass
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def tflops(flops: float, ms: float) -> float:
    """Achieved TFLOP/s for ``flops`` useful operations in ``ms`` milliseconds."""
    return flops / (ms * 1e-3) / 1e12 if ms > 0 else float("nan")


# ----------------------------------------------------------------------------- the machine
def cpu_name() -> str:
    """The processor's model name (``/proc/cpuinfo``, else what the platform reports)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment(device: Optional[torch.device | str] = None) -> dict[str, Any]:
    """Machine, device, versions and date, for the record beside every result."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    env: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "processor": cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average": round(os.getloadavg()[0], 1) if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(dev),
    }
    try:
        # optional (Linux only): the record says None without it
        import triton

        env["triton"] = triton.__version__
    except Exception:
        env["triton"] = None
    if dev.type == "cuda" and torch.cuda.is_available():
        env["device_name"] = torch.cuda.get_device_name(dev)
        env["cuda"] = torch.version.cuda
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(dev)))
    else:
        env["device_name"] = env["processor"]
    return env


# ----------------------------------------------------------------------------- results
def markdown_table(
    rows: Sequence[dict[str, Any]], columns: Sequence[str], floatfmt: str = ".3g"
) -> str:
    """A Markdown table of ``rows`` (dicts) with the given ``columns``."""

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return format(v, floatfmt)
        return "" if v is None else str(v)

    out = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for r in rows:
        out.append("| " + " | ".join(fmt(r.get(c)) for c in columns) + " |")
    return "\n".join(out)


def result_row(
    t: Timing,
    prefix: str = "",
    *,
    flops: Optional[float] = None,
    versus: Optional[tuple[str, Timing]] = None,
) -> dict[str, Any]:
    """A timing's columns in a benchmark's result row: ``<prefix>ms`` (the median),
    ``<prefix>p20_ms``, ``<prefix>p80_ms``, ``<prefix>spread``; ``<prefix>tflops`` when
    ``flops`` (useful operations per call) is given; with ``versus=(name, other)``,
    ``<prefix>vs_<name>``: this median over ``other``'s (above 1: ``name`` is faster)."""
    row: dict[str, Any] = {
        f"{prefix}ms": t.median_ms,
        f"{prefix}p20_ms": t.p20_ms,
        f"{prefix}p80_ms": t.p80_ms,
        f"{prefix}spread": t.spread,
    }
    if flops is not None:
        row[f"{prefix}tflops"] = tflops(flops, t.median_ms)
    if versus is not None:
        name, other = versus
        row[f"{prefix}vs_{name}"] = (
            t.median_ms / other.median_ms if other.median_ms > 0 else float("nan")
        )
    return row


def write_results(
    name: str,
    rows: Sequence[dict[str, Any]],
    columns: Sequence[str],
    outdir: str | os.PathLike,
    env: Optional[dict[str, Any]] = None,
    title: Optional[str] = None,
    notes: str = "",
) -> tuple[Path, Path]:
    """Write ``<outdir>/<name>.json`` and ``<outdir>/<name>.md``; returns both paths."""
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    env = env or environment()
    jpath, mpath = out / f"{name}.json", out / f"{name}.md"
    jpath.write_text(
        json.dumps({"environment": env, "rows": list(rows)}, indent=2, default=str) + "\n"
    )
    head = (
        f"# {title or name}\n\n{env.get('date', '')} · {env.get('device_name', '')} · "
        f"torch {env.get('torch')} · triton {env.get('triton')}\n\n"
    )
    mpath.write_text(
        head + markdown_table(rows, columns) + "\n" + (f"\n{notes}\n" if notes else "")
    )
    return jpath, mpath


# ----------------------------------------------------------------------------- command line
def check_device(name: str, option: str = "--device") -> torch.device:
    """``name`` as a device a benchmark can run on: ``cpu``, or ``cuda[:N]`` where CUDA is
    available (a :class:`UsageError` naming ``option`` otherwise)."""
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise UsageError(f"{option} must be cpu or cuda[:N], got {name!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"{option} must be cpu or cuda[:N], got {name!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"{option} {name}, but no CUDA device is available")
    return dev
