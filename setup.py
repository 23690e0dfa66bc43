"""smelt: kernels, a looped-block executor and a thin model layer for SMELT looped MoE models.

Install (CPU or GPU machine; torch must already be installed), with the tested versions::

    pip install -c constraints.txt --no-build-isolation -e ".[test]"

Native extensions are optional and built only when they can be:

* ``smelt_kernels._cpu`` (``csrc/<feature>/cpu_*.cpp``): C++ CPU kernels, built whenever torch and a
  C++ compiler are present at install time.
* ``smelt_kernels._cuda`` (``csrc/<feature>/*.cu`` + ``cuda_*.cpp``): CUDA kernels, built when torch
  has CUDA support and nvcc is found. ``TORCH_CUDA_ARCH_LIST`` is respected; the default
  is ``8.0;9.0a`` (Ampere, and Hopper with its arch-specific instructions).

``SMELT_BUILD_NATIVE=0`` skips both (a pure-Python install), ``SMELT_BUILD_NATIVE=1`` makes a
failure to build either one an error, unset means "build what this machine can".
``SMELT_BUILD_CUDA=0/1`` does the same for the CUDA extension alone.
``SMELT_MARCH_NATIVE=1`` compiles the CPU code for this machine's CPU (``-march=native``)
instead of the portable build that picks its vector code at run time. Every variable smelt
reads is in ``smelt_kernels.families.ENVIRONMENT``.
Without an extension everything still imports and falls back (to Triton or to torch).

Progress: the native build compiles one translation unit per source file with ninja, which
prints ``[done/total elapsed] command`` as each one finishes, with a line before and after
each extension. pip shows a build's own output only with ``-v`` (without it, "still
running..." until the build ends), so the build also writes one short line per compiled
file, and the lines before and after each extension, straight to the terminal the install
was started from (``/dev/tty``, when there is one and the build's output is not already
going to it); ``SMELT_BUILD_PROGRESS=0`` turns that off. ``MAX_JOBS=N`` caps the parallel
compiles (default: ninja's, the number of cores plus two).
"""

import glob
import os
import re
import shutil
import sys
import threading
import time

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _switch(name):
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value in ("0", "false", "off", "no"):
        return False
    if value in ("1", "true", "on", "yes"):
        return True
    sys.exit(f"{name} must be 0, 1 or auto, got {value!r}")


def _terminal():
    """The terminal the install was started from, when the build's output does not reach it
    (pip keeps it unless -v), else None."""
    if os.environ.get("SMELT_BUILD_PROGRESS", "1") == "0" or os.isatty(1):
        return None
    try:
        return open("/dev/tty", "w")
    except OSError:
        return None


_TTY = None


def _note(msg):
    print(f"smelt setup: {msg}", file=sys.stderr)
    if _TTY is not None:
        _TTY.write(f"\rsmelt setup: {msg}\n")
        _TTY.flush()


#: ninja's status (NINJA_STATUS below) and the source file of the compile it finished
_NINJA = re.compile(r"^\[(\d+)/(\d+) (\d+(?:\.\d+)?)s\] .*?-c (\S+\.(?:cpp|cu))\b")


def ninja_progress(line):
    """The short progress line of one line of ninja's output (None for any other line)."""
    m = _NINJA.match(line)
    if m is None:
        return None
    done, total, seconds, source = m.groups()
    source = source.replace(os.sep, "/")
    source = source[source.index("csrc/") :] if "csrc/" in source else os.path.basename(source)
    return f"[{done}/{total}, {float(seconds):.0f} s] compiled {source}"


class ProgressTee:
    """While active, everything written to file descriptor 1 (where ninja prints) still goes
    there, and each compile ninja finishes is also written to ``out`` as one short line."""

    def __init__(self, out):
        self.out = out

    def __enter__(self):
        sys.stdout.flush()
        read, write = os.pipe()
        self._saved = os.dup(1)
        os.dup2(write, 1)
        os.close(write)
        self._thread = threading.Thread(target=self._pump, args=(read,), daemon=True)
        self._thread.start()
        return self

    def _pump(self, read):
        with os.fdopen(read, "rb") as src:
            for raw in src:
                os.write(self._saved, raw)
                short = ninja_progress(raw.decode(errors="replace"))
                if short is not None:
                    self.out.write(f"\rsmelt setup: {short}\n")
                    self.out.flush()

    def __exit__(self, *exc):
        sys.stdout.flush()
        os.dup2(self._saved, 1)  # closes the pipe's last write end: the pump sees its end
        self._thread.join()
        os.close(self._saved)
        return False


def native_extensions():
    """(ext_modules, cmdclass) for what this machine can build."""
    native = _switch("SMELT_BUILD_NATIVE")
    want_cuda = _switch("SMELT_BUILD_CUDA")
    if want_cuda is None:
        want_cuda = native
    if native is False:
        _note("SMELT_BUILD_NATIVE=0: pure-Python install")
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        if native:
            sys.exit(
                "SMELT_BUILD_NATIVE=1 but torch is not importable at build time "
                "(install torch first and use `pip install --no-build-isolation -e .`)"
            )
        _note(
            "torch not importable at build time: pure-Python install "
            "(use --no-build-isolation to build the native extensions)"
        )
        return [], {}

    exts = []
    cxx_flags = ["-O3", "-std=c++20"]
    # each feature keeps its native code in csrc/<feature>/: cpu_*.cpp for the CPU extension,
    # *.cu and cuda_*.cpp (the bindings) for the CUDA one
    cpu_sources = sorted(glob.glob(os.path.join("csrc", "*", "cpu_*.cpp")))
    cpu_sources += [os.path.join("csrc", "cpu_module.cpp")]
    if cpu_sources:
        if shutil.which(os.environ.get("CXX", "c++")) is None:
            if native:
                sys.exit("SMELT_BUILD_NATIVE=1 but no C++ compiler was found")
            _note("no C++ compiler: skipping the CPU extension")
        else:
            openmp = ["-fopenmp"] if sys.platform.startswith("linux") else []
            march = ["-march=native"] if os.environ.get("SMELT_MARCH_NATIVE") == "1" else []
            # no FP-exception semantics to keep: lets GCC if-convert the clamps and selects of
            # the element-wise loops (SwiGLU's exp, the combines) and vectorise them; results
            # are unchanged (no reassociation)
            fp = ["-fno-trapping-math"]
            exts.append(
                cpp_extension.CppExtension(
                    "smelt_kernels._cpu",
                    cpu_sources,
                    extra_compile_args={"cxx": cxx_flags + fp + openmp + march},
                    extra_link_args=openmp,
                )
            )

    cuda_sources = sorted(glob.glob(os.path.join("csrc", "*", "*.cu")))
    cuda_sources += sorted(glob.glob(os.path.join("csrc", "*", "cuda_*.cpp")))
    cuda_sources += [os.path.join("csrc", "cuda_module.cpp")]
    has_cuda_torch = torch.version.cuda is not None
    has_nvcc = cpp_extension.CUDA_HOME is not None
    if want_cuda is False:
        _note("SMELT_BUILD_CUDA=0: skipping the CUDA extension")
    elif cuda_sources and has_cuda_torch and has_nvcc:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0a")
        _note(
            f"building the CUDA extension for TORCH_CUDA_ARCH_LIST="
            f"{os.environ['TORCH_CUDA_ARCH_LIST']}"
        )
        exts.append(
            cpp_extension.CUDAExtension(
                "smelt_kernels._cuda",
                cuda_sources,
                extra_compile_args={
                    "cxx": cxx_flags,
                    "nvcc": [
                        "-O3",
                        "-std=c++20",
                        "--use_fast_math",
                        "-lineinfo",
                        "--expt-relaxed-constexpr",
                    ],
                },
            )
        )
    elif want_cuda:
        sys.exit(
            "CUDA build requested but impossible: "
            + ("torch has no CUDA support; " if not has_cuda_torch else "")
            + ("nvcc / CUDA_HOME not found; " if not has_nvcc else "")
            + ("no csrc/*/*.cu sources" if not cuda_sources else "")
        )
    else:
        _note("no CUDA-enabled torch or no nvcc: skipping the CUDA extension")

    if not exts:
        return [], {}
    return exts, {
        "build_ext": _with_progress(cpp_extension.BuildExtension.with_options(use_ninja=True))
    }


def _with_progress(build_ext):
    """``build_ext`` that says what it compiles and how long it took, and has ninja number its
    steps with the elapsed time (ninja prints them on the build's output as they finish)."""
    os.environ.setdefault("NINJA_STATUS", "[%f/%t %es] ")

    class BuildWithProgress(build_ext):
        def build_extension(self, ext):
            n = len(ext.sources)
            _note(
                f"compiling {ext.name} ({n} source files; each is listed as "
                "[done/to-do, elapsed seconds] when it finishes; several minutes on 2 cores)"
            )
            start = time.time()
            if _TTY is None:
                super().build_extension(ext)
            else:
                with ProgressTee(_TTY):
                    super().build_extension(ext)
            _note(f"built {ext.name} in {time.time() - start:.0f} s")

    return BuildWithProgress


if __name__ == "__main__":  # what pip and setuptools run; tests import the helpers above
    _TTY = _terminal()
    ext_modules, cmdclass = native_extensions()
    setup(
        name="smelt",
        version="0.1.0",
        description="Kernels, a looped-block executor and a thin model layer for SMELT looped MoE "
        "transformers, with wall-clock against FLOPs benchmarks",
        long_description=open(os.path.join(ROOT, "README.md")).read()
        if os.path.exists(os.path.join(ROOT, "README.md"))
        else "",
        long_description_content_type="text/markdown",
        license="Apache-2.0",
        license_files=["LICENSE"],
        python_requires=">=3.10",
        packages=find_packages(
            include=[
                "smelt_kernels",
                "smelt_kernels.*",
                "smelt_tools",
                "smelt_tools.*",
                "smelt_model",
                "smelt_model.*",
            ]
        ),
        install_requires=[
            "torch>=2.5",
            "triton>=3.6; platform_system == 'Linux'",
            "numpy",
            "safetensors",
            "scipy",
            "tqdm",
        ],
        extras_require={
            # tested versions: constraints.txt (pip install -c constraints.txt -e ".[test]")
            "test": ["pytest>=8", "pytest-benchmark", "pytest-xdist", "ruff"],
            "plot": ["matplotlib"],
            "hf": ["transformers>=5.23,<6"],
            "train": ["tokenizers>=0.23"],
            "build": ["ninja"],  # torch ships the pybind11 headers
            "titan": ["torchtitan==0.3.0"],  # smelt_model.titan; its patches are for this release
        },
        entry_points={
            # the commands users run most, by name (each is also python -m <module>)
            "console_scripts": [
                "smelt-selftest=smelt_tools.selftest.cli:main",
                "smelt-budget=smelt_model.budget.cli:main",
                "smelt-train=smelt_model.train.cli:main",
                "smelt-scaling=smelt_model.scaling.report:main",
                "smelt-analysis=smelt_model.analysis:main",
                "smelt-export=smelt_model.titan.checkpoint.export:main",
            ]
        },
        ext_modules=ext_modules,
        cmdclass=cmdclass,
    )
