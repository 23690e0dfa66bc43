"""setup.py's build progress: each compile ninja finishes becomes one short line on the
terminal (which pip does not hide), and the build's own output still goes where it went.
Nothing is compiled here."""

import io
import runpy
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _setup():
    """setup.py's helpers, without running setup() (that happens only as __main__)."""
    return runpy.run_path(str(ROOT / "setup.py"), run_name="setup_helpers")


def test_reading_setup_builds_nothing():
    m = _setup()
    assert "ext_modules" not in m and callable(m["ProgressTee"])


def test_ninja_status_lines_become_progress_lines():
    progress = _setup()["ninja_progress"]
    line = (
        "[3/10 41.5s] c++ -MMD -MF /b/temp/csrc/norm/cpu_rmsnorm.o.d -O3 -c "
        "/home/u/smelt/csrc/norm/cpu_rmsnorm.cpp -o /b/temp/csrc/norm/cpu_rmsnorm.o"
    )
    assert progress(line) == "[3/10, 42 s] compiled csrc/norm/cpu_rmsnorm.cpp"
    assert progress("[1/2 3s] nvcc -c csrc/attention/cuda.cu -o a.o") == (
        "[1/2, 3 s] compiled csrc/attention/cuda.cu"
    )
    assert progress("building 'smelt_kernels._cpu' extension") is None
    assert progress("[4/10 50s] c++ a.o b.o -shared -o _cpu.so") is None  # no source


def test_the_tee_reports_each_compile_and_passes_everything_through(capfd):
    tty = io.StringIO()
    ninja = "[1/2 2s] c++ -c csrc/moe_gemm/cpu_grouped.cpp -o x.o\nwarning: unused\n"
    ninja += "[2/2 9s] c++ -c csrc/cpu_module.cpp -o y.o\n"
    with _setup()["ProgressTee"](tty):
        subprocess.run(["printf", "%s", ninja], check=True)  # writes to file descriptor 1
    assert tty.getvalue() == (
        "\rsmelt setup: [1/2, 2 s] compiled csrc/moe_gemm/cpu_grouped.cpp\n"
        "\rsmelt setup: [2/2, 9 s] compiled csrc/cpu_module.cpp\n"
    )
    assert capfd.readouterr().out == ninja  # the build's output, unchanged
