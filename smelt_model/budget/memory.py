"""How much memory a model needs, how much the machine has, and the refusal between them.

The main benchmark and the trainer both ask here before they build anything:

    parts = memory.estimate(cfg, tokens=4096, seq_len=4096, train=True)
    memory.check({"smelt": parts}, memory.available(device), what="--preset 200M-S95")

:func:`estimate` adds up weights, gradients, optimizer state, the activations kept for
backward, the KV cache, a workspace and the runtime itself. :func:`available` reads what a
new allocation may still use: a CUDA device's free memory, or on the CPU the smallest of the
kernel's ``MemAvailable``, what the process's cgroup (``memory.max`` less
``memory.current``, or cgroup v1's limit less usage) still allows and, under an
address-space limit (``RLIMIT_AS``, ``ulimit -v``), that limit less the process's virtual
size; it says which one bound it, and so does a refusal. :func:`check` refuses with
one :class:`MemoryRefusal` (a ``ValueError``) when the estimate, with :data:`MARGIN` on top,
exceeds it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional

from smelt_model.budget.ledger import embedding_params, layer_params
from smelt_model.config import ModelConfig

__all__ = [
    "GiB",
    "RUNTIME_BYTES",
    "MARGIN",
    "MemoryRefusal",
    "Available",
    "estimate",
    "available",
    "check",
    "peak_rss",
]

GiB = 2**30
#: torch, its libraries and smelt's extensions, resident before any model exists
RUNTIME_BYTES = 3 * GiB // 4
#: headroom on top of an estimate before it is compared with what is available: the estimate
#: is calibrated on the tiny and 100M pairs (it sat 6-8% below the measured peak of a whole
#: benchmark run of the 100M pair), and the allocator fragments
MARGIN = 0.10


class MemoryRefusal(ValueError):
    """A run that would not fit: raised before anything is built."""


def estimate(
    cfg: ModelConfig,
    *,
    tokens: int,
    seq_len: int,
    train: bool,
    forward: bool = True,
    decode_batch: int = 0,
    decode_len: int = 0,
    param_bytes: int = 4,
    act_bytes: Optional[int] = None,
    optimizer_states: int = 2,
) -> dict[str, int]:
    """Bytes one model of ``cfg`` needs at its peak, by part (an estimate).

    ``tokens``: tokens of one forward (a micro-batch); ``train``: with gradients, optimizer
    state (``optimizer_states`` copies of the weights: AdamW's two moments) and the
    activations kept for backward over every executed layer (calibrated on the tiny pair
    against ``executor.activation_memory``, about 1.4x the saved bytes, to cover the
    temporaries beside them) with the logits and their fp32 copies; ``forward`` without
    ``train``: one layer's activations and the logits; ``decode_batch`` x ``decode_len``:
    the KV cache of a decode; ``param_bytes`` / ``act_bytes``: element sizes of the weights
    and of the activations (default: the weights').
    """
    act = param_bytes if act_bytes is None else act_bytes
    p = layer_params(cfg)
    H, k = cfg.hidden_size, cfg.top_k
    n = (
        cfg.n_layers * (p["attention"] + p["router"] + p["norms"] + p["experts_total"])
        + H
        + embedding_params(cfg)
    )
    per_layer = (
        4 * H + 2 * cfg.q_dim + 4 * cfg.kv_dim + 2 * cfg.n_experts + k * (H + 2 * cfg.expert_size)
    )
    live = tokens if train or forward else 0
    layers = cfg.executed_layers if train else 1
    logits = live * cfg.vocab_size * (act + (12 if train else 4))
    kv = decode_batch * decode_len * 2 * cfg.executed_layers * cfg.kv_dim * act
    return {
        "weights": n * param_bytes,
        "gradients": n * param_bytes if train else 0,
        "optimizer": optimizer_states * n * param_bytes if train else 0,
        "activations": live * layers * per_layer * act + logits,
        "kv_cache": kv,
        # the MoE backward's expert gradients before they accumulate, the optimizer's
        # temporaries
        "workspace": 4 * p["experts_total"] * param_bytes if train else 0,
        "runtime": RUNTIME_BYTES,
    }


def _read_int(path: Path) -> Optional[int]:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        return int(text.split()[0])
    except ValueError:
        return None


def _proc_kib(path: str, field: str) -> Optional[int]:
    """The ``field:`` line of a /proc file given in kB, in bytes; None where it is absent."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_dirs() -> list[Path]:
    """The cgroup folders of this process: v2's unified one, v1's memory controller's."""
    found = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        rel = rel.lstrip("/")
        if controllers == "":
            found.append(Path("/sys/fs/cgroup") / rel)
        elif "memory" in controllers.split(","):
            found.append(Path("/sys/fs/cgroup/memory") / rel)
    return found


def _cgroup_headroom(dirs: Optional[list[Path]] = None) -> Optional[int]:
    """Bytes this process's cgroup still allows (the smallest over the hierarchy), or None
    when no limit is set."""
    best: Optional[int] = None
    for d in _cgroup_dirs() if dirs is None else dirs:
        # walk up: a parent's limit binds too
        for folder in (d, *d.parents):
            if folder == folder.parent or not str(folder).startswith("/sys/fs/cgroup"):
                break
            limit = _read_int(folder / "memory.max")
            used = _read_int(folder / "memory.current")
            if limit is None:  # cgroup v1
                limit = _read_int(folder / "memory.limit_in_bytes")
                used = _read_int(folder / "memory.usage_in_bytes")
                if limit is not None and limit >= 2**60:  # v1's "no limit"
                    limit = None
            if limit is not None:
                room = max(0, limit - (used or 0))
                best = room if best is None else min(best, room)
    return best


class Available(int):
    """Bytes a new allocation may still use, with the ``limit`` that bounds them (what a
    refusal names)."""

    limit: str

    def __new__(cls, value: int, limit: str) -> "Available":
        out = super().__new__(cls, value)
        out.limit = limit
        return out


def _address_space_headroom() -> Optional[int]:
    """Bytes of address space this process may still map under its ``RLIMIT_AS`` (``ulimit
    -v``, what batch schedulers set): the limit less the current virtual size; None when
    no limit is set."""
    try:
        # POSIX only: elsewhere there is no address-space limit to read
        import resource
    except ImportError:  # not a POSIX platform
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY or soft < 0:
        return None
    used = _proc_kib("/proc/self/status", "VmSize") or 0
    return max(0, soft - used)


def available(device=None, *, processes: int = 1) -> Optional[Available]:
    """Bytes a new allocation may still use on ``device`` (default the CPU), as an int
    whose ``limit`` says what bounds it: a CUDA device's free memory; on the CPU the
    smallest of ``MemAvailable``, the cgroup's headroom and, under an address-space limit
    (``RLIMIT_AS``), that limit less the process's virtual size. ``processes``: how many
    processes of this machine (a run's local ranks) share the CPU's memory; each gets an
    equal share of ``MemAvailable`` and the cgroup's headroom, while ``RLIMIT_AS`` is every
    process's own. None when the platform says none of them."""
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise ValueError(f"processes must be a positive int, got {processes!r}")
    if device is not None and str(device).split(":")[0] != "cpu":
        # only a device's own memory needs torch: the budgets import none (test_layering)
        import torch

        dev = torch.device(device)
        free, _ = torch.cuda.mem_get_info(dev)
        return Available(int(free), f"the free memory of {dev}")
    shared = f" shared by {processes} processes" if processes > 1 else ""
    machine = _proc_kib("/proc/meminfo", "MemAvailable")
    found = [
        (x, limit)
        for x, limit in (
            (_share(machine, processes), "MemAvailable" + shared),
            (_share(_cgroup_headroom(), processes), "the cgroup's memory limit" + shared),
            (_address_space_headroom(), "RLIMIT_AS (ulimit -v) less this process's virtual size"),
        )
        if x is not None
    ]
    return Available(*min(found)) if found else None


def _share(nbytes: Optional[int], processes: int) -> Optional[int]:
    return None if nbytes is None else nbytes // processes


def check(
    estimates: Mapping[str, Mapping[str, int]],
    available_bytes: Optional[int],
    *,
    what: str,
    where: str = "this machine",
    hint: str = "",
) -> str:
    """The name of the largest of ``estimates`` (name -> parts); :class:`MemoryRefusal` when
    it, with :data:`MARGIN` on top, exceeds ``available_bytes`` (None: the platform does not
    say, so nothing is refused). ``what`` names the request in the message, ``hint`` says
    what to change."""
    worst = max(estimates, key=lambda name: sum(estimates[name].values()))
    need = sum(estimates[worst].values())
    if available_bytes is not None and need * (1 + MARGIN) > available_bytes:
        parts = ", ".join(f"{k} {v / GiB:.1f}" for k, v in estimates[worst].items() if v)
        raise MemoryRefusal(
            f"{what} needs an estimated {need / GiB:.1f} GiB for its {worst} model ({parts} "
            f"GiB; {MARGIN:.0%} more with the margin) but {available_bytes / GiB:.1f} GiB are "
            f"available on {where}"
            + (
                f" (bound by {available_bytes.limit})"
                if isinstance(available_bytes, Available)
                else ""
            )
            + (f": {hint}" if hint else "")
        )
    return worst


def peak_rss() -> Optional[int]:
    """This process's peak resident memory so far (bytes; Linux ``VmHWM``), else None."""
    return _proc_kib("/proc/self/status", "VmHWM")
