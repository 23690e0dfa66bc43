"""The static kernel audit (``python -m smelt_tools.audit``): the Triton kernels compile for
Hopper (sm_90a) ahead of time with their GPU configurations (LLVM and Triton's bundled ptxas,
no GPU; the interpreter accepts code a real compile rejects), the CUDA kernels with nvcc, and
the shipped configurations do not spill, fit in shared memory and use wgmma where it matters.

The test audits SMELT's cell (H 1056, d_e 352, E 288) and head dim 88 plus the fp32 paths;
the committed table (bench/results/audit_sm90a.*) covers every shape and head dim.
"""

import json
import os
import subprocess
import sys

import pytest

from smelt_tools import audit

# its module-scoped runs take long: scheduled first
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOT = {"moe.up_proj", "moe.down_proj", "attention.forward"}


def _run(args, env=None, timeout=900):
    env = dict(os.environ if env is None else env, PYTHONPATH=ROOT)
    return subprocess.run(
        [sys.executable, "-m", "smelt_tools.audit", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    if audit.triton_ptxas() is None:
        pytest.skip("this Triton install has no bundled ptxas")
    path = tmp_path_factory.mktemp("audit") / "audit.json"
    only = [] if audit.nvcc() else ["--only", "triton"]
    out = _run(["--json", str(path), "--shapes", "smelt", "--head-dims", "88", *only])
    assert out.returncode == 0, out.stderr[-4000:]
    assert "[1/" in out.stderr and "kernels audited" in out.stderr  # progress is shown
    with open(path) as f:
        return json.load(f)


def test_rows_have_the_contract_fields(rows):
    assert rows
    for r in rows:
        for key in ("kernel", "config", "registers", "spill_bytes", "shared_bytes", "mma"):
            assert key in r, (key, r)
        assert 0 < r["registers"] <= 255, r


def test_every_triton_kernel_is_audited(rows):
    kernels = {r["kernel"] for r in rows if r["source"] == "triton"}
    assert kernels >= HOT | {
        "moe.dgrad_swiglu",
        "moe.dgrad_x",
        "moe.wgrad_w1",
        "moe.wgrad_w2",
        "moe.combine",
        "moe.grouped_gemm",
        "moe.route_count",
        "moe.route_scatter",
        "attention.backward_dq",
        "attention.backward_dkdv",
        "attention.backward_delta",
    }
    assert any("float32" in r["config"] for r in rows), "the fp32 paths are audited too"


def test_no_spills_and_shared_memory_within_sm90(rows):
    """No kernel spills, Triton or CUDA (every instantiation of the CUDA kernels)."""
    bad = [
        (r["kernel"], r["config"], r["spill_bytes"], r["shared_bytes"])
        for r in rows
        if r["shared_bytes"] > audit.SM90_SHARED_LIMIT or r["spill_bytes"] > 0
    ]
    assert not bad, bad


def test_committed_audit_has_no_spills():
    """The committed table (bench/results/audit_sm90a.json, every shape and head dim) says
    nothing spills and everything fits in shared memory."""
    with open(os.path.join(ROOT, "bench", "results", "audit_sm90a.json")) as f:
        rows = json.load(f)
    assert {r["source"] for r in rows} == {"triton", "cuda"}
    bad = [
        (r["kernel"], r["config"])
        for r in rows
        if r["spill_bytes"] or r["shared_bytes"] > audit.SM90_SHARED_LIMIT
    ]
    assert not bad, bad


def test_hot_gemm_kernels_use_wgmma(rows):
    hot = [r for r in rows if r["kernel"] in HOT and "bf16" in r["config"]]
    assert {r["kernel"] for r in hot} == HOT
    assert all("wgmma" in r["mma"] for r in hot), [(r["kernel"], r["mma"]) for r in hot]


def test_cuda_kernels_report_their_matrix_instructions(rows):
    cuda = [r for r in rows if r["source"] == "cuda"]
    if not audit.nvcc():
        pytest.skip("nvcc not found")
    assert cuda
    kinds = {"wgmma", "mma.sync", "wmma", "none"}
    assert all(set(r["mma"].split("+")) <= kinds for r in cuda), {r["mma"] for r in cuda}
    # the GEMM and attention kernels use the tensor cores (combine/gather helpers need not)
    assert any(r["mma"] != "none" for r in cuda)


def test_missing_tool_is_one_clear_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PATH=str(tmp_path), CUDA_HOME=str(tmp_path), CUDA_PATH=str(tmp_path))  # no nvcc
    out = _run(["--only", "cuda"], env=env, timeout=120)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "nvcc" in lines[0] and "Traceback" not in out.stderr


def test_bad_arguments_are_refused(tmp_path):
    out = _run(["--shapes", "nope", "--only", "triton"], timeout=120)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    out = _run(["--head-dims", "90", "--only", "triton"], timeout=120)
    assert out.returncode == 2 and "head-dims" in out.stderr
    assert out.stderr.startswith("python -m smelt_tools.audit: error: ")


@pytest.mark.parametrize("option", ["--json", "--markdown"])
def test_output_paths_are_checked_before_any_work(option, tmp_path):
    """A folder, or a path under a file, is one line and exit status 2 before anything
    compiles (no progress line)."""
    for path, message in (
        (tmp_path, "is a folder, expected a file to write"),
        (tmp_path / "file" / "out", "is not a folder"),
    ):
        (tmp_path / "file").write_text("")
        out = _run([option, str(path), "--only", "triton"], timeout=120)
        assert out.returncode == 2 and out.stdout == "", out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and option in lines[0] and message in lines[0], lines


def test_parsers():
    log = """ptxas info    : Compiling entry function '_Z3fooPf' for 'sm_90a'
ptxas info    : Function properties for _Z3fooPf
    16 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 96 registers, used 1 barriers, 4096 bytes smem, 400 bytes cmem[0]
"""
    st = audit.parse_ptxas(log)["_Z3fooPf"]
    assert (st["registers"], st["spill_stores"], st["spill_loads"], st["static_smem"]) == (
        96,
        8,
        12,
        4096,
    )
    assert audit.mma_kind("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16") == "wgmma"
    assert audit.mma_kind("mma.sync.aligned.m16n8k16.row.col") == "mma.sync"
    assert audit.mma_kind("wmma.mma.sync.aligned.row.col.m16n16k16") == "wmma"
    assert audit.mma_kind("ld.global.f32") == "none"
