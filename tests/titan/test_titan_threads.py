"""A titan run records its threads per process beside its checkpoints, and a resume at
another count says, in one line, that its losses will not be exactly the uninterrupted
run's (the CPU's reductions depend on the thread count)."""

import json

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install -e '.[titan]')")

from smelt_model.titan.checkpoint.resume import THREADS_FILE, thread_check  # noqa: E402


def test_a_fresh_run_records_its_count_and_only_rank_zero_writes(tmp_path):
    folder = tmp_path / "checkpoint"
    assert thread_check(folder, resuming=False, threads=2, rank=1) is None
    assert not (folder / THREADS_FILE).exists()
    assert thread_check(folder, resuming=False, threads=2) is None
    assert json.loads((folder / THREADS_FILE).read_text()) == {"threads_per_process": 2}


def test_a_resume_at_the_same_count_says_nothing_and_at_another_says_so(tmp_path):
    thread_check(tmp_path, resuming=False, threads=1)
    assert thread_check(tmp_path, resuming=True, threads=1) is None
    line = thread_check(tmp_path, resuming=True, threads=2)
    assert "resuming at 2 threads per process a run started at 1" in line
    assert "OMP_NUM_THREADS=1" in line and "\n" not in line
    # the record is the started run's: a resume does not overwrite it
    assert json.loads((tmp_path / THREADS_FILE).read_text()) == {"threads_per_process": 1}


@pytest.mark.parametrize("text", ["", "{", "[1]", '{"threads_per_process": "2"}', "{}"])
def test_an_unreadable_record_is_named(tmp_path, text):
    (tmp_path / THREADS_FILE).write_text(text)
    line = thread_check(tmp_path, resuming=True, threads=2)
    assert (
        line == f"{tmp_path / THREADS_FILE}: unreadable, the thread count of the run is not checked"
    )


def test_checkpoints_without_a_record_are_not_checked(tmp_path):
    assert thread_check(tmp_path, resuming=True, threads=2) is None
    assert not (tmp_path / THREADS_FILE).exists()


def test_the_checked_load_records_and_checks(tmp_path, monkeypatch, caplog):
    """The wiring: checked_load writes the record on a fresh start and warns on a resume
    at another count, before it loads anything."""
    import types

    import torch

    from smelt_model.checkpoint import dcp
    from smelt_model.titan.checkpoint import resume

    monkeypatch.setattr(resume, "STOCK_LOAD", lambda manager, step: False)
    monkeypatch.setattr(resume, "_attempt", lambda manager, n, path: (None, True))
    manager = types.SimpleNamespace(folder=str(tmp_path / "ckpt"), initial_load_path=None)
    threads = torch.get_num_threads()
    assert resume.checked_load(manager) is False
    assert json.loads((tmp_path / "ckpt" / THREADS_FILE).read_text()) == {
        "threads_per_process": threads
    }
    step = tmp_path / "ckpt" / "step-2"
    step.mkdir()
    (step / dcp.METADATA).write_bytes(b"")
    (tmp_path / "ckpt" / THREADS_FILE).write_text('{"threads_per_process": %d}' % (threads + 1))
    monkeypatch.setattr(resume.logger, "propagate", True)
    with caplog.at_level("WARNING"):
        assert resume.checked_load(manager) is True
    assert any(f"run started at {threads + 1}" in r.getMessage() for r in caplog.records)
