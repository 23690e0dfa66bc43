"""The memory check reads the address-space limit (``RLIMIT_AS``, ``ulimit -v``, what batch
schedulers set): under it, a training run that would not fit is refused with one line that
names the limit, before any work, instead of dying in an allocation."""

import os
import resource
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GiB = 2**30


def _limit(nbytes):
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    if hard != resource.RLIM_INFINITY:
        nbytes = min(nbytes, hard)
    return lambda: resource.setrlimit(resource.RLIMIT_AS, (nbytes, hard))


def _run(args, limit):
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=_limit(limit),
    )


def test_available_is_bound_by_the_address_space_limit():
    code = textwrap.dedent(
        """
        from smelt_model.budget import memory
        avail = memory.available()
        vm = memory._proc_kib("/proc/self/status", "VmSize")
        assert avail <= 3 * 2**30 - vm, (avail, vm)
        assert avail.limit.startswith("RLIMIT_AS"), avail.limit
        print(int(avail))
        """
    )
    out = _run(["-c", code], 3 * GiB)
    assert out.returncode == 0, out.stderr


def test_a_training_run_over_the_limit_is_refused_before_any_work(tmp_path):
    """100M-S85's SMELT model needs about 12 GiB; under a 6 GB limit the run stops at the
    check, with one line that names the limit (and writes nothing)."""
    out_dir = tmp_path / "run"
    args = ["-m", "smelt_model.train", "--preset", "100M-S85", "--arch", "smelt"]
    args += ["--batch-size", "1", "--seq-len", "256", "--steps", "1", "--out", str(out_dir)]
    out = _run(args, 6 * GiB)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode != 0
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "needs an estimated" in lines[0] and "RLIMIT_AS" in lines[0], lines[0]
    assert not out_dir.exists()


def test_local_ranks_share_the_machine_but_not_the_address_space_limit(monkeypatch):
    """With two ranks on a machine each gets half of MemAvailable and of the cgroup's
    headroom, but RLIMIT_AS bounds every process alone, so it is never halved."""
    import pytest

    from smelt_model.budget import memory

    monkeypatch.setattr(memory, "_proc_kib", lambda path, field: 40 * GiB)
    monkeypatch.setattr(memory, "_cgroup_headroom", lambda: 30 * GiB)
    monkeypatch.setattr(memory, "_address_space_headroom", lambda: 12 * GiB)
    one = memory.available()
    assert one == 12 * GiB and one.limit.startswith("RLIMIT_AS")
    two = memory.available(processes=2)
    assert two == 12 * GiB and two.limit.startswith("RLIMIT_AS")
    four = memory.available(processes=4)
    assert four == 30 * GiB // 4
    assert four.limit == "the cgroup's memory limit shared by 4 processes"
    monkeypatch.setattr(memory, "_address_space_headroom", lambda: None)
    assert memory.available(processes=2) == 15 * GiB
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="processes"):
            memory.available(processes=bad)
