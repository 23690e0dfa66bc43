"""Packaging: imports without native code, backend selection, csrc compiles for sm_90a."""

import glob
import logging
import os
import shutil
import subprocess
import sys
import sysconfig

import helpers
import pytest
import torch

from smelt_kernels import backends, families

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CU_SOURCES = sorted(glob.glob(os.path.join(ROOT, "csrc", "*", "*.cu")))
BINDINGS = sorted(glob.glob(os.path.join(ROOT, "csrc", "*", "cuda_*.cpp")))
CPU_SOURCES = sorted(glob.glob(os.path.join(ROOT, "csrc", "*", "cpu_*.cpp")))


def test_imports_without_extensions():
    """With both native extensions unloadable, everything imports and reports why."""
    code = helpers.BLOCK_NATIVE + (
        "import smelt_kernels, smelt_model\n"
        "from smelt_kernels import backends, reference\n"
        "for name in ('_cpu', '_cuda'):\n"
        "    assert backends.extension(name) is None\n"
        "    assert 'blocked' in backends.extension_error(name)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@pytest.fixture
def toy_op(monkeypatch):
    """A registered op of its own (removed again after the test)."""
    monkeypatch.setitem(backends._REGISTRY, "toy", {})
    monkeypatch.setattr(backends, "_REPORTED", set())
    backends.register("toy", "torch", lambda x: "torch", lambda g: g, devices=None)
    backends.register(
        "toy",
        "cpu",
        lambda x: "cpu",
        devices=("cpu",),
        priority=10,
        dtypes=(torch.float32,),
        supports=lambda size: None if size < 4 else "too big",
    )
    backends.register(
        "toy", "cuda", lambda x: "cuda", backward_via=("torch",), devices=("cuda",), priority=20
    )
    return "toy"


def test_an_implementation_takes_its_familys_devices_and_priority(toy_op):
    """Unless given, devices and priority are the family's: what auto's order follows."""
    for name in ("torch", "cpu", "triton", "cuda"):
        impl = backends.register("toy", name, lambda x: x, lambda g: g, replace=True)
        fam = backends.family(name)
        assert (impl.devices, impl.priority) == (fam.devices, fam.priority)
    assert [i.backend for i in backends.implementations("toy")] == [
        "triton",
        "cuda",
        "cpu",
        "torch",
    ]
    mine = backends.register("toy", "cpu", lambda x: x, devices=None, priority=99, replace=True)
    assert (mine.devices, mine.priority) == (None, 99)


def test_backend_selection(toy_op, caplog):
    assert backends.select(toy_op, None, device="cpu", dtype=torch.float32, size=1).backend == "cpu"
    assert (
        backends.select(toy_op, "auto", device="cpu", dtype=torch.float32, size=1).backend == "cpu"
    )
    assert backends.select(toy_op, "torch", device="cpu").backend == "torch"
    # auto falls back past what the preferred implementation cannot take, and says why once
    with caplog.at_level(logging.INFO, logger="smelt"):
        assert (
            backends.select(toy_op, None, device="cpu", dtype=torch.float64, size=1).backend
            == "torch"
        )
        assert (
            backends.select(toy_op, None, device="cpu", dtype=torch.float64, size=1).backend
            == "torch"
        )
    assert [r.getMessage() for r in caplog.records] == [
        "toy on cpu uses backend 'torch' (cpu: backend 'cpu' takes float32, got float64)"
    ]
    assert (
        backends.select(toy_op, None, device="cpu", dtype=torch.float32, size=9).backend == "torch"
    )
    # an explicit backend: one error class per kind of failure
    with pytest.raises(TypeError, match="takes float32, got float64"):
        backends.select(toy_op, "cpu", device="cpu", dtype=torch.float64)
    with pytest.raises(ValueError, match="too big"):
        backends.select(toy_op, "cpu", device="cpu", dtype=torch.float32, size=9)
    with pytest.raises(backends.BackendUnavailableError, match="runs on cuda tensors"):
        backends.select(toy_op, "cuda", device="cpu")
    with pytest.raises(backends.BackendUnavailableError, match="no 'triton' implementation"):
        backends.select(toy_op, "triton", device="cpu")
    with pytest.raises(ValueError, match="backend must be one of"):
        backends.select(toy_op, "tpu", device="cpu")
    with pytest.raises(ValueError, match="already has"):
        backends.register(toy_op, "torch", lambda x: x)


def test_backward_of_borrows(toy_op):
    cuda = backends.implementation(toy_op, "cuda")
    assert backends.backward_impl(cuda, "cuda").backend == "torch"
    assert backends.backward_of(cuda, "cuda") is backends.implementation(toy_op, "torch").backward
    forward_only = backends.register(toy_op, "triton", lambda x: x)
    with pytest.raises(backends.BackendUnavailableError, match="has no backward"):
        backends.backward_of(forward_only, "cpu")
    with pytest.raises(ValueError, match="backward or backward_via"):
        backends.register(toy_op, "triton", lambda x: x, lambda g: g, backward_via=("torch",))


def test_no_chain_over_backend_names_in_the_ops():
    """Backend choice lives in the registry: no op file compares a backend name, and no op
    decides on its own whether autograd records a call or whether it is being compiled (the
    no-autograd fast path and the compile rule are registry features, run by opdef)."""
    for path in glob.glob(os.path.join(ROOT, "smelt_kernels", "**", "*.py"), recursive=True):
        if os.path.basename(path) in ("backends.py", "families.py", "opdef.py", "checks.py"):
            continue
        with open(path) as f:
            text = f.read()
        assert "backend ==" not in text and "name ==" not in text, path
        assert "needs_grad(" not in text, path
        if os.path.basename(os.path.dirname(path)) in ("moe_gemm", "attention", "norm"):
            assert "is_grad_enabled" not in text and "is_compiling()" not in text, path


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "TRITON_INTERPRET" in backends.unavailable_reason("triton", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backends.unavailable_reason("triton", "cpu") is None


def test_report_lists_every_op_and_backend():
    rep = backends.report("cpu")
    assert set(rep) == {
        "moe_ffn",
        "grouped_gemm",
        "route",
        "segment_attention",
        "rms_norm",
        "rotary",
        "linear",
    }
    assert set(rep.variants["segment_attention"]["cpu"]) == {"native", "chunked"}
    assert {"rows", "panels", "few-rows"} <= set(rep.variants["moe_ffn"]["cpu"])
    assert set(rep["rms_norm"]) == set(rep["rotary"]) == set(rep["linear"]) == {"torch", "cpu"}
    assert (
        set(rep["moe_ffn"]) == set(rep["segment_attention"]) == {"torch", "cpu", "triton", "cuda"}
    )
    assert set(rep["grouped_gemm"]) == {"torch", "cpu", "triton"}
    for op, per_backend in rep.items():
        assert per_backend["torch"] is None, op
        for name, reason in per_backend.items():
            assert reason is None or isinstance(reason, str) and reason, (op, name)
    assert rep["moe_ffn"]["triton"] is None  # the suite runs Triton through the interpreter
    for op in ("moe_ffn", "segment_attention"):
        assert "cuda" in rep[op]["cuda"]  # the CUDA kernels need CUDA tensors


def test_report_says_why_a_backend_is_unavailable(monkeypatch):
    monkeypatch.setitem(families._EXT_CACHE, "_cpu", None)
    monkeypatch.setitem(families._EXT_ERRORS, "_cpu", "smelt_kernels._cpu is not built (test)")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    rep = backends.report("cpu")
    assert (
        rep["moe_ffn"]["cpu"]
        == rep["grouped_gemm"]["cpu"]
        == "smelt_kernels._cpu is not built (test)"
    )
    assert "TRITON_INTERPRET=1" in rep["moe_ffn"]["triton"]
    assert "TRITON_INTERPRET=1" in rep["segment_attention"]["triton"]
    assert rep["segment_attention"]["cpu"] is None  # ATen's flash kernel needs no extension
    assert backends.report("cuda")["moe_ffn"]["cpu"].startswith(
        "moe_ffn: backend 'cpu' runs on cpu"
    )


@pytest.mark.skipif(not CPU_SOURCES, reason="no csrc/*/cpu_*.cpp sources")
@pytest.mark.skipif(os.environ.get("SMELT_BUILD_NATIVE") == "0", reason="native build disabled")
def test_cpu_extension_is_built_and_loads():
    assert backends.extension("_cpu") is not None, backends.extension_error("_cpu")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("src", CU_SOURCES, ids=lambda p: os.path.relpath(p, ROOT))
def test_cu_compiles_for_sm90a(src, tmp_path):
    obj = tmp_path / (os.path.basename(src) + ".o")
    cmd = [
        "nvcc",
        "-c",
        "-std=c++17",
        "-O2",
        "-arch=sm_90a",
        "--expt-relaxed-constexpr",
        src,
        "-o",
        str(obj),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-4000:]
    assert obj.stat().st_size > 0


def _cuda_include():
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    for root in (
        os.environ.get("CUDA_HOME"),
        os.path.dirname(os.path.dirname(os.path.realpath(nvcc))),
        "/usr/local/cuda",
    ):
        if root and os.path.exists(os.path.join(root, "include", "cuda_runtime_api.h")):
            return os.path.join(root, "include")
    return None


@pytest.mark.skipif(_cuda_include() is None, reason="CUDA headers not found")
@pytest.mark.parametrize("src", BINDINGS, ids=lambda p: os.path.relpath(p, ROOT))
def test_cuda_bindings_compile(src):
    """The extension's C++ bindings type-check against torch's and CUDA's headers."""
    from torch.utils.cpp_extension import include_paths

    cxx = shutil.which(os.environ.get("CXX", "c++"))
    if cxx is None:
        pytest.skip("no C++ compiler")
    cmd = [
        cxx,
        "-fsyntax-only",
        "-std=c++17",
        "-DTORCH_EXTENSION_NAME=_cuda",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        "-DWITH_CUDA",
        f"-I{_cuda_include()}",
        f"-I{sysconfig.get_paths()['include']}",
    ]
    cmd += [f"-I{p}" for p in include_paths()] + [src]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-4000:]
