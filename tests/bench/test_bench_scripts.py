"""Every benchmark command: bad input is one line on stderr and a non-zero exit before
anything is measured; nothing is written into the repository unless asked; no script or
package touches ``sys.path``. (Timings themselves are not tested.)"""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import bench_attention
import bench_moe_gemm
import bench_peers
import output_paths
import pytest
import time_to_loss
import torch
from lvb import cli

from smelt_kernels.backends import BACKENDS
from smelt_model.executor import RECOMPUTE_POLICIES
from smelt_tools import timing
from smelt_tools.cli import run_cli

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def nothing_runs(monkeypatch):
    """Fail the test if a benchmark gets past its checks."""

    def boom(*a, **k):
        raise AssertionError("the benchmark ran before its options were checked")

    monkeypatch.setattr(bench_attention, "run", boom)
    monkeypatch.setattr(bench_moe_gemm, "make_inputs", boom)
    monkeypatch.setattr(bench_moe_gemm, "decode_rows", boom)
    monkeypatch.setattr(time_to_loss.tempfile, "mkdtemp", boom)
    monkeypatch.setattr(bench_peers, "_moe_cases", boom)


def _one_line(prog, main, argv, capsys):
    # a command made with cli.command runs under the convention itself
    rc = main(argv) if hasattr(main, "__wrapped__") else run_cli(prog, main, argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err and "usage:" not in err, err
    assert err.startswith(f"{prog}: error: ")
    return err


@pytest.mark.parametrize(
    "argv, word",
    [
        (["--device", "tpu"], "--device"),
        (["--device", "nonsense:x"], "--device"),
        (["--dtype", "float8"], "--dtype"),
        (["--batch", "0"], "--batch"),
        (["--repeats", "abc"], "--repeats"),
        (["--warmup", "-1"], "--warmup"),
        (["--methods", "nope"], "--methods"),
        (["--methods", "flx"], "did you mean 'flex'"),
        (["--layouts", "nope"], "--layouts"),
        (["--threads", "0"], "--threads"),
    ],
)
def test_bench_attention_bad_input(argv, word, capsys, nothing_runs):
    assert word in _one_line("bench_attention", bench_attention.main, argv, capsys)


@pytest.mark.parametrize(
    "argv, word",
    [
        (["--device", "tpu"], "--device"),
        (["--dtypes", "float8"], "--dtypes"),
        (["--shapes", "nope"], "shape"),
        (["--modes", "sideways"], "--modes"),
        (["--skip", "nothing"], "--skip"),
        (["--decode-tokens", "1,x"], "--decode-tokens"),
        (["--decode-tokens", "0"], "--decode-tokens"),
        (["--repeats", "0"], "--repeats"),
        (["--backend", "nope"], "--backend"),
        (["--min-time", "nan"], "--min-time"),
        (["--dtypes", "bfloat61"], "did you mean 'bfloat16'"),
        (["--threads", "0"], "--threads"),
    ],
)
def test_bench_moe_gemm_bad_input(argv, word, capsys, nothing_runs):
    assert word in _one_line("bench_moe_gemm", bench_moe_gemm.main, argv, capsys)


@pytest.mark.parametrize(
    "argv, word",
    [
        (["--preset", "nope"], "--preset"),
        (["--preset", "tiny-smelt"], "tiny-smelt is a model; this needs a pair name: tiny (holds"),
        (["--budget-flops", "-1"], "--budget-flops"),
        (["--budget-flops", "inf"], "--budget-flops"),
        (["--seq-len", "1"], "--seq-len"),
        (["--evals", "0"], "--evals"),
        (["--threads", "x"], "--threads"),
        (["--out", "."], "--out"),
    ],
)
def test_time_to_loss_bad_input(argv, word, capsys, nothing_runs):
    assert word in _one_line("time_to_loss", time_to_loss.main, argv, capsys)


@pytest.mark.parametrize(
    "argv, word",
    [
        (["--tokens", "10"], "--tokens"),
        (["--rounds", "x"], "--rounds"),
        (["--device", "cpu"], "--device"),
    ],
)
def test_bench_peers_bad_input(argv, word, capsys, nothing_runs):
    assert word in _one_line("bench_peers", bench_peers.main, argv, capsys)


@pytest.mark.parametrize(
    "prog, module", [("bench_attention", bench_attention), ("bench_moe_gemm", bench_moe_gemm),
                     ("bench_peers", bench_peers), ("looped_vs_baseline", cli)]
)  # fmt: skip
def test_outputs_are_checked_before_anything_runs(prog, module, tmp_path, capsys, nothing_runs):
    """Each command's results go to a file or folder checked before any work: a folder
    where a file is due, or a file where a folder is due, is one line and exit 2."""
    assert module.main.__wrapped__ and module.PROG == prog  # the one convention
    (tmp_path / "file").write_text("")
    option = (
        ["--json", str(tmp_path)]
        if prog == "looped_vs_baseline"
        else ["--out", str(tmp_path / "file")]
    )
    err = _one_line(prog, module.main, option, capsys)
    assert option[0] in err and ("folder" in err), err


OUTPUT_OPTIONS = [
    ("bench_attention", bench_attention, "--out", ""),
    ("bench_moe_gemm", bench_moe_gemm, "--out", ""),
    ("bench_peers", bench_peers, "--out", ""),
    ("time_to_loss", time_to_loss, "--out", ""),
    ("looped_vs_baseline", cli, "--json", ".json"),
    ("looped_vs_baseline", cli, "--markdown", ".md"),
    ("looped_vs_baseline", cli, "--plot", ".png"),
]


@pytest.mark.parametrize("prog, module, option, suffix", OUTPUT_OPTIONS)
def test_an_output_nothing_can_be_written_to_is_refused_first(
    prog, module, option, suffix, tmp_path, capsys, nothing_runs
):
    """Checked by writing, not by asking os.access (which says yes to root for /proc); a
    missing folder is refused and not made."""
    err = _one_line(prog, module.main, [option, f"/proc/smelt-check{suffix}"], capsys)
    assert option in err and "/proc/smelt-check" in err, err
    missing = tmp_path / "missing" / f"r{suffix}"
    err = _one_line(prog, module.main, [option, str(missing)], capsys)
    assert "does not exist" in err and not (tmp_path / "missing").exists(), err


def test_a_writable_output_is_left_as_it_was(tmp_path):
    kept = tmp_path / "r.json"
    kept.write_text("earlier")
    assert output_paths.output_file(kept, "--json", (".json",)) == kept
    assert kept.read_text() == "earlier"
    new = tmp_path / "new.json"
    assert output_paths.output_file(new, "--json") == new and not new.exists()
    assert output_paths.out_folder(tmp_path / "out") == tmp_path / "out"
    assert not (tmp_path / "out").exists() and sorted(tmp_path.iterdir()) == [kept]
    assert output_paths.out_folder(tmp_path) == tmp_path and sorted(tmp_path.iterdir()) == [kept]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a CPU-only machine")
def test_gpu_only_benchmarks_say_so_on_a_cpu_machine(capsys, nothing_runs):
    assert "CUDA" in _one_line("bench_peers", bench_peers.main, [], capsys)
    err = _one_line("bench_peers", bench_peers.main, ["--device", "cuda"], capsys)
    assert "--device cuda: needs a CUDA device" in err
    assert "CUDA" in _one_line(
        "bench_attention", bench_attention.main, ["--device", "cuda"], capsys
    )
    assert "CUDA" in _one_line("bench_moe_gemm", bench_moe_gemm.main, ["--device", "cuda"], capsys)


def test_a_script_run_as_a_command_fails_in_one_line():
    """The scripts as a user runs them: ``python bench/x.py``, no sys.path set-up."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for script, argv in (
        ("time_to_loss.py", ["--evals", "0"]),
        ("bench_moe_gemm.py", ["--modes", "sideways"]),
        ("looped_vs_baseline.py", ["--min-rounds", "0"]),
    ):
        proc = subprocess.run(
            [sys.executable, str(ROOT / "bench" / script), *argv],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=env,
            timeout=120,
        )
        err = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(err) == 1 and "error:" in err[0], proc.stderr


def test_time_to_loss_writes_outside_the_repository_by_default():
    args = time_to_loss.parse_args([])
    assert args.out is None  # the results go to the temporary folder the runs train in
    assert time_to_loss.parse_args(["--out", "bench/results/x"]).out == "bench/results/x"


def test_the_main_jobs_choices_come_from_the_registry():
    actions = {a.dest: a for a in cli._parser()._actions}
    assert tuple(actions["backend"].choices) == ("auto",) + tuple(BACKENDS)
    recompute = actions["recompute"]
    assert recompute.metavar == "{" + ",".join(RECOMPUTE_POLICIES) + ",all-but-N}"
    assert [recompute.type(p) for p in RECOMPUTE_POLICIES] == list(RECOMPUTE_POLICIES)
    assert recompute.type("all-but-3") == "all-but-3"
    with pytest.raises(argparse.ArgumentTypeError, match="got 'some'"):
        recompute.type("some")


def test_no_script_or_package_touches_sys_path():
    """``python bench/x.py`` puts bench/ on the path by itself; tests/conftest.py is the one
    place tests set it."""
    offenders = []
    for top in ("bench", "smelt_kernels", "smelt_tools", "smelt_model"):
        for path in (ROOT / top).rglob("*.py"):
            if "sys.path" in path.read_text():
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


def test_the_timing_helpers_live_in_one_place():
    from smelt_tools import hf_bench

    assert not (ROOT / "bench" / "timing.py").exists()
    assert hf_bench.environment is timing.environment
    assert not hasattr(hf_bench, "_cpu_name") and not hasattr(hf_bench, "_q")
    t = timing.Timing.of([3.0, 1.0, 2.0])
    assert (t.median_ms, t.min_ms, t.repeats) == (2.0, 1.0, 3)
    assert timing.quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.2) == pytest.approx(1.8)
    assert isinstance(timing.cpu_name(), str) and timing.cpu_name()
    env = timing.environment("cpu")
    for key in ("date", "processor", "cpu_count", "torch_threads", "torch", "device_name"):
        assert key in env


def test_bench_moe_gemm_refuses_a_run_the_memory_cannot_hold(monkeypatch, capsys, nothing_runs):
    """The default shapes need several GiB on the CPU: refused first where less is
    available, with --quick named; --quick itself fits in what is left."""
    monkeypatch.setattr(bench_moe_gemm, "available_memory", lambda device=None: 5 * 2**30)
    err = _one_line("bench_moe_gemm", bench_moe_gemm.main, [], capsys)
    assert "200M-base in float32 needs about 7.9 GiB, 5.0 GiB is available" in err
    assert "--quick" in err
    args, _ = bench_moe_gemm.parse_args(["--quick"])
    assert args.shapes == ["cpu-target"] and args.dtypes == ["float32"] and args.tokens == 256
    assert args.reference_bwd_params == 0 and args.decode_tokens == [1, 8]
    args, _ = bench_moe_gemm.parse_args(["--shapes", "200M-base", "--dtypes", "bfloat16"])
    assert args.shapes == ["200M-base"]  # 4.2 GiB
    monkeypatch.setattr(bench_moe_gemm, "available_memory", lambda device=None: 2**30)
    assert bench_moe_gemm.parse_args(["--quick"])[0].tokens == 256  # 0.6 GiB
    monkeypatch.setattr(bench_moe_gemm, "available_memory", lambda device=None: None)
    assert bench_moe_gemm.parse_args([])[0].shapes[-1] == "200M-smelt"  # nothing known: runs
