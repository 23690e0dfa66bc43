"""Packaging: imports without native code, backend selection, csrc compiles for sm_90a."""

import glob
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

from smelt_kernels import backends

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CU_SOURCES = sorted(glob.glob(os.path.join(ROOT, "csrc", "*", "*.cu")))
BINDINGS = sorted(glob.glob(os.path.join(ROOT, "csrc", "*", "cuda_*.cpp")))
CPU_SOURCES = sorted(glob.glob(os.path.join(ROOT, "csrc", "*", "cpu_*.cpp")))


def test_imports_without_extensions():
    """With both native extensions unloadable, everything imports and reports why."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name in ('smelt_kernels._cpu', 'smelt_kernels._cuda'):\n"
        "            raise ImportError('blocked for the test')\n"
        "sys.meta_path.insert(0, Block())\n"
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


def test_backend_resolution():
    pref = {"cpu": ("cpu", "torch"), "cuda": ("triton", "torch")}
    assert backends.resolve("op", None, "cpu", pref) in ("cpu", "torch")
    assert backends.resolve("op", "auto", "cpu", pref, checks={"cpu": lambda d: "not here"}) == "torch"
    assert backends.resolve("op", "torch", "cpu", pref) == "torch"
    with pytest.raises(backends.BackendUnavailableError, match="'cuda' backend needs CUDA"):
        backends.resolve("op", "cuda", "cpu", {"cuda": ("cuda", "torch")})
    with pytest.raises(backends.BackendUnavailableError, match="no 'cuda' implementation"):
        backends.resolve("op", "cuda", "cpu", pref)
    with pytest.raises(ValueError, match="backend must be one of"):
        backends.resolve("op", "tpu", "cpu", pref)
    with pytest.raises(backends.BackendUnavailableError, match="custom reason"):
        backends.resolve("op", "cpu", "cpu", pref, checks={"cpu": lambda d: "custom reason"})


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "TRITON_INTERPRET" in backends.unavailable_reason("triton", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backends.unavailable_reason("triton", "cpu") is None


def test_report_lists_every_op_and_backend():
    rep = backends.report("cpu")
    assert {"moe_ffn", "segment_attention"} <= set(rep)
    for op, per_backend in rep.items():
        assert per_backend["torch"] is None, op


@pytest.mark.skipif(not CPU_SOURCES, reason="no csrc/*/cpu_*.cpp sources")
@pytest.mark.skipif(os.environ.get("SMELT_BUILD_NATIVE") == "0", reason="native build disabled")
def test_cpu_extension_is_built_and_loads():
    assert backends.extension("_cpu") is not None, backends.extension_error("_cpu")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("src", CU_SOURCES, ids=lambda p: os.path.relpath(p, ROOT))
def test_cu_compiles_for_sm90a(src, tmp_path):
    obj = tmp_path / (os.path.basename(src) + ".o")
    cmd = ["nvcc", "-c", "-std=c++17", "-O2", "-arch=sm_90a", "--expt-relaxed-constexpr",
           src, "-o", str(obj)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-4000:]
    assert obj.stat().st_size > 0


def _cuda_include():
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    for root in (os.environ.get("CUDA_HOME"), os.path.dirname(os.path.dirname(os.path.realpath(nvcc))),
                 "/usr/local/cuda"):
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
    cmd = [cxx, "-fsyntax-only", "-std=c++17", "-DTORCH_EXTENSION_NAME=_cuda",
           "-DTORCH_API_INCLUDE_EXTENSION_H", "-DWITH_CUDA", f"-I{_cuda_include()}",
           f"-I{sysconfig.get_paths()['include']}"]
    cmd += [f"-I{p}" for p in include_paths()] + [src]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-4000:]
