"""The machine watch: a contended region is told from synthetic CPU, wall-clock, steal and
quota readings, and from synthetic /proc and cgroup files. Nothing is timed for speed."""

import pytest
from helpers_lvb import load

from smelt_tools import timing
from smelt_tools.watch import CONTENTION_LIMIT, Load, Watch


@pytest.mark.parametrize(
    "load, lost, contended",
    [
        (load(0.03), 0.015, False),  # an idle machine's daemons
        (load(1.0), 0.5, True),  # another process on one of two cores
        (load(0.1, steal=0.2), 0.15, True),  # the hypervisor took a fifth of a core
        (load(0.8, threads=1), 0.0, False),  # one thread, and a core left for it
        (load(1.3, threads=1), 0.3, True),  # one thread, and not a whole core left
        (load(0.25, slack=0.2), 0.025, False),  # within what tick counting can misread
        (load(0.0, throttled=0.3), 0.3, True),  # a CPU quota held it back 30% of the time
        (load(3.0, threads=8, cores=4), 0.75, True),  # more threads than cores: 4 needed
    ],
)
def test_a_contended_region_is_told_from_its_readings(load, lost, contended):
    assert load.lost == pytest.approx(lost)
    assert load.contended() is contended
    assert load.contended(limit=0.99) is False
    assert "other processes busy on" in load.describe()


def test_an_unwatched_region_is_never_called_contended():
    load = Load(wall_s=1.0, cpu_s=2.0, threads=2, cores=2)
    assert load.lost is None and not load.contended() and load.share == pytest.approx(1.0)
    assert 0 < CONTENTION_LIMIT < 1


def _write_proc(root, busy, steal, own, throttled_us, cpu2_busy=100):
    """/proc and a cgroup v2 tree: cpu0 and cpu1 with ``busy`` and ``steal`` ticks each,
    cpu2 (not the process's) with ``cpu2_busy``; the process's own ``own`` ticks."""

    def cpu(name, b, s):
        # user nice system idle iowait irq softirq steal guest guest_nice
        return f"{name} {b - 2} 0 1 500 0 1 0 {s} 0 0"

    (root / "self").mkdir(exist_ok=True)
    (root / "stat").write_text(
        "\n".join(
            [cpu("cpu", 2 * busy + cpu2_busy, 2 * steal), cpu("cpu0", busy, steal)]
            + [cpu("cpu1", busy, steal), cpu("cpu2", cpu2_busy, 0), "procs_running 3"]
        )
        + "\n"
    )
    fields = ["S"] + ["0"] * 10 + [str(own - 5), "5"] + ["0"] * 30  # utime, stime at 14, 15
    (root / "self" / "stat").write_text("4242 (py thon) " + " ".join(fields) + "\n")
    (root / "self" / "cgroup").write_text("0::/job\n")
    (root / "loadavg").write_text("2.50 1.00 0.50 3/120 4242\n")
    cg = root / "cg" / "job"
    cg.mkdir(parents=True, exist_ok=True)
    (cg / "cpu.stat").write_text(f"usage_usec 1\nthrottled_usec {throttled_us}\n")


def test_the_watch_reads_proc_and_the_cgroup(tmp_path, monkeypatch):
    clock = iter([10.0, 12.0])  # two seconds of wall-clock
    cpu = iter([1.0, 2.5])  # 1.5 s of the process's CPU time
    monkeypatch.setattr("smelt_tools.watch.time.perf_counter", lambda: next(clock))
    monkeypatch.setattr("smelt_tools.watch.time.process_time", lambda: next(cpu))
    _write_proc(tmp_path, busy=1000, steal=10, own=300, throttled_us=0)
    w = Watch(threads=2, proc=tmp_path, cgroup=tmp_path / "cg")
    w.cpus, w.hz = [0, 1], 100
    mark = w.start()
    # two seconds later: cores 0 and 1 each 190 ticks busier, 20 more of steal each; the
    # process 150 of the 380 busy ticks; cpu2 (not ours) busy all along; 0.2 s throttled
    _write_proc(tmp_path, busy=1190, steal=30, own=450, throttled_us=200_000, cpu2_busy=300)
    load = w.stop(mark)
    assert load.wall_s == 2.0 and load.cpu_s == 1.5
    assert load.others_cores == pytest.approx((380 - 150) / 100 / 2)  # 1.15 cores
    assert load.steal_cores == pytest.approx(40 / 100 / 2)
    assert load.throttled_s == pytest.approx(0.2) and load.load_average == 2.5
    assert load.slack_cores == pytest.approx(2 * 2 / 100 / 2)
    assert load.contended() and load.lost == pytest.approx((1.15 + 0.2 - 0.02) / 2)
    assert "steal 0.20 cores" in load.describe() and "throttled 0.20 s" in load.describe()


def test_without_proc_the_watch_says_nothing_it_cannot_know(tmp_path):
    w = Watch(threads=1, proc=tmp_path / "missing", cgroup=tmp_path / "missing")
    load = w.stop(w.start())
    assert load.others_cores is None and load.throttled_s is None and load.lost is None
    assert not load.contended()


def test_every_measure_puts_its_load_on_the_timing():
    w = Watch(threads=1)
    t = timing.measure(lambda: sum(range(1000)), warmup=0, repeats=3, watch=w)
    assert t.load is not None and t.load.wall_s > 0 and t.load.threads == 1
    assert t.to_dict()["load"]["wall_s"] == t.load.wall_s
    both = timing.measure_interleaved({"a": lambda: None, "b": lambda: None}, repeats=2, watch=w)
    assert both["a"].load is both["b"].load is not None
    pt = timing.measure_parts(lambda: None, {"p": (lambda: None, 1)}, repeats=2, watch=w)
    assert pt.step.load is not None
    assert timing.measure(lambda: None, repeats=1).load is None  # unwatched: no load
