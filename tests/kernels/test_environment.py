"""smelt's environment variables: a value the table (``backends.ENVIRONMENT``) does not allow
is one ValueError naming the variable, its value and what it takes, at the first use and
before any native kernel reads it; ``backends.report()`` lists the refused values without
raising and shows what the native kernels use (as they report it), not the raw strings."""

import re
from pathlib import Path

import pytest
import torch

from smelt_kernels import backends
from smelt_kernels.attention import cpu as attention_cpu
from smelt_kernels.attention import segment_attention
from smelt_kernels.moe_gemm import moe_ffn, route
from smelt_kernels.norm import rms_norm

needs_cpu_ext = pytest.mark.skipif(
    backends.extension_op_missing("_cpu", "settings", "csrc/cpu_module.cpp") is not None,
    reason="smelt_kernels._cpu is not built",
)

#: per variable of the table: a value it must refuse
BAD = {
    "TRITON_INTERPRET": "2",
    "SMELT_CPU_GENERIC": "yes",
    "SMELT_CPU_DECODE": "false",
    "SMELT_ATTENTION_ISA": "avx3",
    "SMELT_ROUTE_ISA": "AVX2",
    "SMELT_CPU_POOL_MB": "-5",
    "SMELT_POISON": "2",
    "SMELT_HF_STRICT": "on",
    "SMELT_TRACEBACK": "true",
    "SMELT_TRAIN_CRASH": "step5",
    "SMELT_BUILD_NATIVE": "yes",
    "SMELT_BUILD_CUDA": "2",
    "SMELT_BUILD_PROGRESS": "off",
    "SMELT_MARCH_NATIVE": "true",
}


def test_every_variable_with_fixed_values_has_a_refused_example():
    """Each variable that takes a fixed set, a number or a pattern is tested below; the
    others take any text (a folder)."""
    restricted = {
        name
        for name, var in backends.ENVIRONMENT.items()
        if var.values or var.number or var.pattern
    }
    assert set(BAD) == restricted


@pytest.mark.parametrize("name", sorted(BAD))
def test_env_refuses_a_value_the_table_does_not_allow(name, monkeypatch):
    monkeypatch.setenv(name, BAD[name])
    var = backends.ENVIRONMENT[name]
    with pytest.raises(ValueError) as e:
        backends.env(name)
    assert name in str(e.value) and repr(BAD[name]) in str(e.value)
    assert var.takes() in str(e.value)
    monkeypatch.setenv(name, "")  # empty is unset: the default
    assert backends.env(name) == ""


@pytest.mark.parametrize(
    "name, good",
    [
        ("SMELT_CPU_POOL_MB", "0"),
        ("SMELT_CPU_POOL_MB", "2048"),
        ("SMELT_ATTENTION_ISA", "avx2-wide"),
        ("SMELT_TRAIN_CRASH", "checkpoint:12"),
        ("TRITON_INTERPRET", "True"),
    ],
)
def test_env_takes_the_values_the_table_allows(name, good, monkeypatch):
    monkeypatch.setenv(name, good)
    assert backends.env(name) == good


def _moe():
    g = torch.Generator().manual_seed(0)
    x, w1, w2 = torch.randn(4, 8, generator=g), torch.randn(3, 8, 8), torch.randn(3, 8, 4)
    return x, w1, w2, torch.rand(4, 2), torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2]])


def _attention():
    q = torch.randn(1, 5, 2, 16)
    return q, torch.randn(1, 5, 1, 16), torch.randn(1, 5, 1, 16)


CALLS = {  # what reads each variable, through the public ops on the CPU
    "SMELT_CPU_GENERIC": lambda: moe_ffn(*_moe(), backend="cpu"),
    "SMELT_CPU_DECODE": lambda: moe_ffn(*_moe(), backend="cpu"),
    "SMELT_CPU_POOL_MB": lambda: moe_ffn(*_moe(), backend="cpu"),
    "SMELT_ROUTE_ISA": lambda: route(torch.randn(4, 8), 2, backend="cpu"),
    "SMELT_ATTENTION_ISA": lambda: segment_attention(*_attention(), backend="cpu"),
    "SMELT_POISON": lambda: rms_norm(torch.randn(3, 8), torch.ones(8), backend="cpu"),
    "TRITON_INTERPRET": lambda: rms_norm(torch.randn(3, 8), torch.ones(8)),
}


@needs_cpu_ext
@pytest.mark.parametrize("name", sorted(CALLS))
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_ops_refuse_an_invalid_value_before_the_kernel_reads_it(name, grad, monkeypatch):
    """The variables the native kernels read (which would ignore a value they do not know)
    are checked by the op's entry point, with and without autograd."""
    monkeypatch.setenv(name, BAD[name])
    with torch.set_grad_enabled(grad), pytest.raises(ValueError, match=name):
        CALLS[name]()
    monkeypatch.delenv(name)
    CALLS[name]()  # and runs once it is unset


@needs_cpu_ext
def test_report_shows_what_the_native_kernels_use(monkeypatch):
    monkeypatch.setenv("SMELT_ROUTE_ISA", "generic")
    monkeypatch.setenv("SMELT_CPU_POOL_MB", "0")
    monkeypatch.setenv("SMELT_CPU_DECODE", "0")
    rep = backends.report("cpu")
    assert not rep.problems
    assert set(rep.in_use) == {n for n, v in backends.ENVIRONMENT.items() if v.native}
    assert rep.in_use["SMELT_ROUTE_ISA"] == "router top-k generic"
    assert rep.in_use["SMELT_CPU_POOL_MB"] == "block pool off"
    assert rep.in_use["SMELT_CPU_DECODE"] == "MoE few-rows path off"
    isa = attention_cpu.native_isa()
    assert rep.in_use["SMELT_ATTENTION_ISA"] == f"attention kernel {isa}"
    assert isa in ("avx512", "avx2", "avx2-wide", "generic")
    text = str(rep)
    assert "native CPU kernels now use:" in text and "router top-k generic" in text
    monkeypatch.setenv("SMELT_CPU_POOL_MB", "64")
    assert backends.report("cpu").in_use["SMELT_CPU_POOL_MB"] == "block pool keeps up to 64 MiB"


def test_report_lists_a_refused_value_without_raising(monkeypatch):
    monkeypatch.setenv("SMELT_ROUTE_ISA", "avx3")
    rep = backends.report("cpu")
    assert list(rep.problems) == ["SMELT_ROUTE_ISA"] and "'avx3'" in rep.problems["SMELT_ROUTE_ISA"]
    assert rep.in_use == {}  # the kernels would ignore the value: nothing to show for them
    assert "refused: environment variable SMELT_ROUTE_ISA='avx3'" in str(rep)
    with pytest.raises(ValueError, match="SMELT_ROUTE_ISA"):
        backends.native_settings()


ROOT = Path(__file__).resolve().parents[2]
#: how smelt's code reads a variable, in Python (``setup.py`` included), C++ and shell
_READS = re.compile(
    r"""(?:environ\.get\(|environ\[|getenv\(|env_flag\(|env_int\(|\benv\(|check_env\(|"""
    r"""setenv\(|_switch\(|\bENV\s*=)\s*["'](SMELT_[A-Z0-9_]+)["']"""
)


def test_every_variable_smelt_reads_is_in_the_table():
    """One table: every ``SMELT_*`` variable read anywhere in the packages, the native
    code, setup.py and the scripts is an entry of ``ENVIRONMENT``, and every entry is read
    somewhere."""
    sources = [ROOT / "setup.py", *(ROOT / "bench").glob("*.sh")]
    for top, pattern in (
        ("smelt_kernels", "*.py"),
        ("smelt_tools", "*.py"),
        ("smelt_model", "*.py"),
        ("bench", "*.py"),
        ("csrc", "*.[ch]*"),
    ):
        sources += sorted((ROOT / top).rglob(pattern))
    read = set()
    for path in sources:
        read |= set(_READS.findall(path.read_text()))
    table = {name for name in backends.ENVIRONMENT if name.startswith("SMELT_")}
    assert read - table == set(), f"read but not in the table: {sorted(read - table)}"
    assert table - read == set(), f"in the table but read nowhere: {sorted(table - read)}"
