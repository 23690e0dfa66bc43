"""What the machine did while something was timed: whether the process got its cores.

A benchmark on a shared machine measures wall-clock, and wall-clock is what other work
disturbs: another process running on the same cores, the hypervisor taking a virtual CPU
away (steal), a container's CPU quota throttling the process. :class:`Watch` reads the
machine before and after a timed region and returns a :class:`Load`; a region in which
others held more than :data:`CONTENTION_LIMIT` of the cores the process's threads needed is
*contended*, and a benchmark repeats it or leaves it out rather than report through it.
CPU time only flags interference here; it is never the measured quantity.

``smelt_tools.timing.measure`` and its siblings take ``watch=`` and put the reading on the
timing (``Timing.load``). This module needs only the standard library and torch.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import torch

__all__ = ["CONTENTION_LIMIT", "Load", "Watch"]

#: a timed region is *contended* when other processes, the hypervisor (steal) and a CPU
#: quota took more than this fraction of the cores the process's threads needed
CONTENTION_LIMIT = 0.10


@dataclass
class Load:
    """What the machine did while a region was timed (a :class:`Watch` reading).

    ``cpu_s`` is the process's CPU time (all its threads); ``threads`` how many threads its
    work runs on and ``cores`` how many cores it may run on (its CPU affinity);
    ``others_cores`` and ``steal_cores`` how many of those cores, on average, other processes
    and the hypervisor kept busy; ``throttled_s`` how long a CPU quota (cgroup) held the
    process back. None where the platform does not say. ``slack_cores`` is what counting
    CPU time in clock ticks can misread over so short a region; it is taken off before
    judging.
    """

    wall_s: float
    cpu_s: float
    threads: int
    cores: int
    others_cores: Optional[float] = None
    steal_cores: Optional[float] = None
    throttled_s: Optional[float] = None
    load_average: Optional[float] = None
    slack_cores: float = 0.0

    @property
    def share(self) -> float:
        """CPU time over wall-clock times the cores the threads could use: about 1 when every
        thread was busy all along; lower for serial work, or when the cores were taken."""
        need = max(1, min(self.threads, self.cores))
        return self.cpu_s / (self.wall_s * need) if self.wall_s > 0 else 0.0

    @property
    def lost(self) -> Optional[float]:
        """The fraction of the cores the threads needed that others held (other processes,
        steal, a CPU quota): 0 on an idle machine; None when the platform does not say."""
        if self.others_cores is None and self.throttled_s is None:
            return None
        need = max(1, min(self.threads, self.cores))
        taken = max(0.0, (self.others_cores or 0.0) + (self.steal_cores or 0.0) - self.slack_cores)
        lost = max(0.0, need - (self.cores - taken)) / need
        if self.throttled_s and self.wall_s > 0:
            lost = max(lost, min(1.0, self.throttled_s / self.wall_s))
        return min(1.0, lost)

    def contended(self, limit: float = CONTENTION_LIMIT) -> bool:
        """True when others held more than ``limit`` of the cores the process needed."""
        lost = self.lost
        return lost is not None and lost > limit

    def describe(self) -> str:
        """What the machine did, in one line."""
        seen = []
        if self.others_cores is not None:
            seen.append(f"other processes busy on {self.others_cores:.2f} of {self.cores} cores")
        if self.steal_cores and self.steal_cores >= 0.005:
            seen.append(f"steal {self.steal_cores:.2f} cores")
        if self.throttled_s and self.throttled_s >= 0.005:
            seen.append(f"CPU quota throttled {self.throttled_s:.2f} s")
        wall = self.wall_s if self.wall_s > 0 else float("nan")
        seen.append(f"this process ran {self.cpu_s / wall:.2f} cores on {self.threads} threads")
        if self.load_average is not None:
            seen.append(f"load average {self.load_average:.1f}")
        return ", ".join(seen)

    def to_dict(self) -> dict[str, Any]:
        return dict(asdict(self), share=self.share, lost=self.lost, contended=self.contended())


class Watch:
    """Reads the machine around a timed region: ``mark = watch.start()``, the timed work,
    ``load = watch.stop(mark)`` (a :class:`Load`).

    On Linux it reads ``/proc/stat`` (busy and steal time of each core the process may run
    on), ``/proc/self/stat`` (the process's own CPU time in the same clock ticks, taken off
    the busy time: the rest is other processes'), the cgroup's ``cpu.stat`` (time a CPU
    quota throttled it) and ``/proc/loadavg``; elsewhere only the process's CPU time, and
    :attr:`Load.lost` is None. ``threads``: the threads the timed work runs on (default:
    torch's). ``proc`` and ``cgroup`` are where those files live (tests point them at
    synthetic ones).
    """

    def __init__(
        self,
        threads: Optional[int] = None,
        proc: str | os.PathLike = "/proc",
        cgroup: str | os.PathLike = "/sys/fs/cgroup",
    ):
        self.threads = threads if threads is not None else torch.get_num_threads()
        self.proc, self.cgroup = Path(proc), Path(cgroup)
        if hasattr(os, "sched_getaffinity"):
            self.cpus = sorted(os.sched_getaffinity(0))
        else:  # pragma: no cover - not Linux
            self.cpus = list(range(os.cpu_count() or 1))
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def _text(self, path: Path) -> Optional[str]:
        try:
            return path.read_text()
        except OSError:
            return None

    def _cores(self) -> tuple[Optional[int], Optional[int]]:
        """Busy and steal clock ticks, summed over the process's cores."""
        text = self._text(self.proc / "stat")
        if text is None:
            return None, None
        want = {f"cpu{i}" for i in self.cpus}
        busy = steal = 0
        for line in text.splitlines():
            f = line.split()
            if f and f[0] in want:
                v = [int(x) for x in f[1:9]]  # user nice system idle iowait irq softirq steal
                busy += v[0] + v[1] + v[2] + v[5] + v[6]
                steal += v[7]
        return busy, steal

    def _own_ticks(self) -> Optional[int]:
        text = self._text(self.proc / "self" / "stat")
        if text is None:
            return None
        f = text[text.rindex(")") + 2 :].split()  # the fields after "pid (comm) "
        return int(f[11]) + int(f[12])  # utime, stime

    def _throttled_s(self) -> Optional[float]:
        # cgroup v2 reports throttled_usec, v1 (the cpu controller) throttled_time in ns
        where = []
        for line in (self._text(self.proc / "self" / "cgroup") or "").splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":
                where.append(self.cgroup / path.lstrip("/") / "cpu.stat")
            elif "cpu" in controllers.split(","):
                where.append(self.cgroup / controllers / path.lstrip("/") / "cpu.stat")
        where += [self.cgroup / "cpu.stat", self.cgroup / "cpu" / "cpu.stat"]
        for path in where:
            for line in (self._text(path) or "").splitlines():
                key, _, value = line.partition(" ")
                if key == "throttled_usec":
                    return int(value) / 1e6
                if key == "throttled_time":
                    return int(value) / 1e9
        return None

    def start(self) -> dict[str, Any]:
        """A reading of the machine now (pass it to :meth:`stop`)."""
        busy, steal = self._cores()
        text = self._text(self.proc / "loadavg")
        return dict(
            wall=time.perf_counter(),
            cpu=time.process_time(),
            busy=busy,
            steal=steal,
            own=self._own_ticks(),
            throttled=self._throttled_s(),
            loadavg=float(text.split()[0]) if text else None,
        )

    def stop(self, mark: dict[str, Any]) -> Load:
        """What the machine did since ``mark`` (a :meth:`start` reading)."""
        now = self.start()
        wall = now["wall"] - mark["wall"]
        load = Load(
            wall_s=wall,
            cpu_s=now["cpu"] - mark["cpu"],
            threads=self.threads,
            cores=len(self.cpus),
            load_average=now["loadavg"],
        )
        if wall <= 0:
            return load
        if None not in (mark["busy"], now["busy"], mark["own"], now["own"]):
            others = (now["busy"] - mark["busy"]) - (now["own"] - mark["own"])
            load.others_cores = max(0.0, others / self.hz / wall)
            load.steal_cores = (now["steal"] - mark["steal"]) / self.hz / wall
            load.slack_cores = 2 * len(self.cpus) / self.hz / wall
        if None not in (mark["throttled"], now["throttled"]):
            load.throttled_s = now["throttled"] - mark["throttled"]
        return load
