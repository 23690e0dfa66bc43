"""The self-test (``smelt-selftest``): ``--quick`` passes on the CPU, lists every op and
backend and runs fewer cases than the full run for every op; the table explains its
``worst`` column; broken implementations (a forward off by 1e-2, a backward that returns
NaN, a forward that kills its process or loses the device) fail their rows by name with exit
status 1 and the other rows still run; bad options (an output path that is a folder too) are
one line and exit status 2, before any work."""

import json
import math
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from smelt_kernels import backends
from smelt_kernels.moe_gemm import cpu as moe_cpu
from smelt_tools import selftest
from smelt_tools.selftest import cli, runner
from smelt_tools.selftest.cases import CASES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _command(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "smelt_tools.selftest", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def _row(stdout: str, op: str, backend: str, dtype: str) -> str:
    """The table's line for (op, backend, dtype)."""
    for line in stdout.splitlines():
        cells = line.split()
        if len(cells) > 4 and cells[:2] == [op, backend] and dtype in cells[2:4]:
            return line
    raise AssertionError(f"no row {op} / {backend} / {dtype} in\n{stdout}")


def test_quick_passes_and_lists_every_op_and_backend(tmp_path):
    path = tmp_path / "selftest.json"
    out = _command("--quick", "--json", str(path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASSED" in out.stdout.strip().splitlines()[-1]
    data = json.loads(path.read_text())
    rows = data["results"]
    assert data["complete"] and not data["failed"] and data["device"] == "cpu"
    assert {r["op"] for r in rows} == set(CASES)  # every shipped op, and only those
    report = backends.report("cpu")
    for op in CASES:
        for backend, why in report[op].items():
            mine = [r for r in rows if (r["op"], r["backend"]) == (op, backend)]
            if why is not None:  # listed with the registry's reason
                assert [(r["dtype"], r["verdict"], r["reason"]) for r in mine] == [
                    ("-", "skipped", why)
                ]
                assert f"skipped: {why}" in _row(out.stdout, op, backend, "-")
                continue
            assert {"float32", "bfloat16"} <= {r["dtype"] for r in mine}, (op, backend)
            for r in mine:
                if backend == "triton" and r["dtype"] == "bfloat16":  # the interpreter's limit
                    assert r["verdict"] == "skipped" and "interpreter" in r["reason"]
                else:
                    assert r["verdict"] == "pass" and r["cases"] > 0 and r["worst"] <= 1.0, r
    # one progress line per op and backend, on stderr
    progress = [line for line in out.stderr.splitlines() if line.startswith("selftest [")]
    assert len(progress) == sum(len(report[op]) for op in CASES)
    # the CPU kernels name their variants
    moe = [r for r in rows if (r["op"], r["backend"], r["dtype"]) == ("moe_ffn", "cpu", "float32")]
    assert moe[0]["variant"] in {v.name for v in moe_cpu.VARIANTS}, moe
    assert "native" in _row(out.stdout, "segment_attention", "cpu", "float32")
    # the worst column is explained under the table
    assert selftest.LEGEND in out.stdout
    assert data["tolerances"]["bfloat16"] == dict(factor=2.0, floor_ulps=2.0, floor_min=1e-5)


def test_quick_runs_fewer_cases_than_the_full_run_for_every_op():
    """--quick is a smoke test: for every op, strictly fewer cases than the full run (one
    float32 row on the reference backend, which runs every case)."""
    for op in CASES:
        unit = runner.Unit(op, "torch", torch.float32)
        with runner.poisoned():
            quick, full = (runner.run_unit(unit, "cpu", quick=q) for q in (True, False))
        assert quick.verdict == full.verdict == "pass", (quick, full)
        assert 0 < quick.cases < full.cases, (op, quick.cases, full.cases)


def test_help_explains_the_worst_column():
    out = _command("--help")
    assert out.returncode == 0
    assert "worst: the largest error / bound" in " ".join(out.stdout.split())


def _replace(monkeypatch, op, backend, **changes):
    """Register ``changes`` over ``op``'s ``backend`` implementation (replace=True), in a copy
    of the op's registry entry that is put back after the test."""
    impl = backends.implementation(op, backend)
    monkeypatch.setitem(backends._REGISTRY, op, dict(backends._REGISTRY[op]))
    fields = dict(
        forward=impl.forward,
        backward=impl.backward,
        devices=impl.devices,
        priority=impl.priority,
        dtypes=impl.dtypes,
        requires=impl.requires,
        supports=impl.supports,
        checks_values=impl.checks_values,
        traced=impl.traced,
    )
    fields.update(changes)
    backends.register(op, backend, replace=True, **fields)
    return impl


def test_a_forward_off_by_1e_2_fails_by_name(monkeypatch, capsys):
    impl = backends.implementation("moe_ffn", "cpu")

    def off(*args):
        y, *rest = impl.forward(*args)
        return (y + 1e-2, *rest)

    _replace(monkeypatch, "moe_ffn", "cpu", forward=off)  # no infer: no-grad calls run it too
    status = cli.main(["--in-process", "--quick", "--op", "moe_ffn", "--backend", "cpu", "torch"])
    out = capsys.readouterr().out
    assert status == 1
    assert _row(out, "moe_ffn", "cpu", "float32").split()[-1] == "FAIL"
    assert "FAIL moe_ffn / cpu / float32:" in out
    # in bfloat16, 1e-2 at outputs near 1 is within two units of the dtype: the rule's floor
    assert _row(out, "moe_ffn", "cpu", "bfloat16").split()[-1] == "pass"
    for dtype in ("float32", "bfloat16"):
        assert _row(out, "moe_ffn", "torch", dtype).split()[-1] == "pass"
    assert re.search(r"case 'all tokens on one expert': y: max error 1\.0\d*e-02 > bound", out)
    assert re.search(r"case 'all tokens on one expert': y \(no grad\): max error", out)
    assert "FAILED -- 3 passed, 1 failed" in out


def test_a_backward_that_returns_nan_fails(monkeypatch):
    impl = backends.implementation("rms_norm", "cpu")

    def nan_backward(dy, x, weight, rstd):
        dx, dw = impl.backward(dy, x, weight, rstd)
        return torch.full_like(dx, math.nan), dw

    _replace(monkeypatch, "rms_norm", "cpu", backward=nan_backward, infer=impl.infer)
    results = selftest.run("cpu", ops=["rms_norm"], backends=["cpu"])
    assert [(r.backend, r.dtype, r.verdict) for r in results] == [
        ("cpu", d, "FAIL") for d in ("float32", "bfloat16", "float16")
    ]
    for r in results:
        assert r.worst == math.inf
        assert any(
            "dx: " in f and "NaN or inf values where the reference is finite" in f
            for f in r.failures
        ), r.failures
        assert not any(f.split(": ")[1].startswith(("y", "dw")) for f in r.failures), r.failures


@pytest.mark.slow
def test_a_crashing_kernel_fails_its_row_and_the_rest_run(tmp_path):
    # every process of the command loads an RMSNorm forward that kills its process in
    # float32 and raises a CUDA error (the context is gone) in bfloat16, and notes its pid
    (tmp_path / "sitecustomize.py").write_text(
        textwrap.dedent(f"""
        import os, signal
        import torch
        from smelt_kernels import backends
        import smelt_kernels.norm
        with open({str(tmp_path / "pids")!r}, "a") as f:
            f.write(f"{{os.getpid()}}\\n")
        impl = backends.implementation("rms_norm", "cpu")
        def forward(x, weight, eps):
            if x.dtype == torch.float32:
                os.kill(os.getpid(), signal.SIGSEGV)
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        backends.register("rms_norm", "cpu", forward, impl.backward, devices=("cpu",),
                          priority=impl.priority, dtypes=impl.dtypes, requires=impl.requires,
                          supports=impl.supports, replace=True)
    """)
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, str(tmp_path)]))
    out = _command("--quick", "--op", "rms_norm", "--backend", "cpu", "torch", env=env)
    assert out.returncode == 1, out.stdout + out.stderr
    assert _row(out.stdout, "rms_norm", "cpu", "float32").split()[-1] == "FAIL"
    assert "case 'odd width': the process died (killed by SIGSEGV)" in out.stdout
    assert "rms_norm / cpu / float32 crashed (killed by SIGSEGV)" in out.stderr
    assert _row(out.stdout, "rms_norm", "cpu", "bfloat16").split()[-1] == "FAIL"
    assert "case 'odd width': raised RuntimeError: CUDA error: an illegal memory" in out.stdout
    assert f"{runner.LOST}: the rest of this row did not run" in out.stdout
    for dtype in ("float32", "bfloat16"):
        assert _row(out.stdout, "rms_norm", "torch", dtype).split()[-1] == "pass"
    # the command, the first worker, one after the crash, one after the lost device
    assert len(set((tmp_path / "pids").read_text().split())) == 4


@pytest.mark.parametrize(
    "args, message",
    [
        (["--frobnicate"], "unrecognized arguments: --frobnicate"),
        (["--quick", "now"], "unrecognized arguments: now"),
        (["--op"], "expected at least one argument"),
        (["--json", "tests"], "--json tests: is a folder, expected a file to write"),
        (["--json", os.path.join("README.md", "out.json")], "README.md is not a folder"),
    ],
)
def test_bad_options_are_one_line(args, message):
    """Refused before any work: no worker starts, no row runs."""
    out = _command(*args)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and message in out.stderr, out.stderr
    assert out.stderr.startswith("smelt-selftest: error: ")


def test_a_json_path_in_a_missing_folder_is_refused_and_not_made(tmp_path):
    path = tmp_path / "absent" / "deeper" / "x.json"
    out = _command("--quick", "--json", str(path))
    assert out.returncode == 2 and out.stdout == "", out
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("smelt-selftest: error: ")
    assert f"--json {path}: the folder {path.parent} does not exist" in out.stderr, out.stderr
    assert not (tmp_path / "absent").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--op", "moe_ffn", "attention"], "ops: unknown 'attention' (choose from moe_ffn, "),
        (["--backend", "tpu"], "backends: unknown 'tpu'"),
        (["--device", "meta"], "the self-test runs on cpu or cuda"),
        (["--device", "tpu"], "'tpu' is not a device"),
    ],
)
def test_bad_names_are_one_line(args, message, capsys):
    assert cli.main(["--in-process", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and message in captured.err


def test_a_refused_environment_value_is_one_line_before_any_row(monkeypatch, capsys):
    monkeypatch.setenv("SMELT_ROUTE_ISA", "avx3")
    assert cli.main(["--in-process", "--quick"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert "SMELT_ROUTE_ISA='avx3' is not valid" in captured.err


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the message of a machine without a GPU"
)
def test_cuda_without_a_gpu_is_one_line():
    out = _command("--device", "cuda", "--quick")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (
        "smelt-selftest: error: device: cuda asked for, but no CUDA GPU is available "
        "(torch.cuda.is_available() is False)\n"
    )


def test_full_cases_of_one_op_in_process():
    results = selftest.run("cpu", ops=["rotary"])
    assert [(r.backend, r.dtype, r.verdict, r.cases) for r in results] == [
        (b, d, "pass", len(CASES["rotary"]()))
        for b in ("cpu", "torch")
        for d in ("float32", "bfloat16", "float16")
    ]
    table = selftest.format_table(results)
    assert table.splitlines()[0].split() == [
        "op",
        "backend",
        "variant",
        "dtype",
        "cases",
        "worst",
        "verdict",
    ]
    with pytest.raises(ValueError, match="ops: unknown 'rotery'"):
        selftest.run("cpu", ops=["rotery"])
