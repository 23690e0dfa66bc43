"""The packages' layering, read from the source (every import, at module level or inside a
function): ``smelt_kernels`` imports none of ``smelt_tools``, ``smelt_model`` or ``bench``;
``smelt_tools`` imports no ``smelt_model`` or ``bench``; ``smelt_model`` no ``bench``; and
no module reaches itself through the imports of the others (no import circle).

Inside ``smelt_model`` each home has its rules (docs/architecture.md draws them): the budgets,
the cluster model and the scaling tools import no torch, not even through what they import;
the scaling tools import nothing of the model; the paper's budgets import nothing of the
cluster model (only the ``smelt-budget`` command, which serves both, does); the shared data
and checkpoint homes import neither trainer; the two trainers never import each other; only
the torchtitan integration imports torchtitan. Nowhere does a module import another
module's underscore names. :func:`violations` checks a graph against all of it, and a test
feeds it graphs that break each rule."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("smelt_kernels", "smelt_tools", "smelt_model", "bench")
#: what each layer may import of the others (its own package always)
ALLOWED = {
    "smelt_kernels": set(),
    "smelt_tools": {"smelt_kernels"},
    "smelt_model": {"smelt_kernels", "smelt_tools"},
    "bench": {"smelt_kernels", "smelt_tools", "smelt_model"},
}


def _modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if pkg == "bench" and len(parts) > 1 and parts[1].startswith("test_"):
                continue  # the benchmarks' own tests
            found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The smelt modules ``name`` imports (``from a import b`` counts as ``a.b`` when that
    is a module, else ``a``)."""
    return _read(name, path, modules)[0]


def _read(name: str, path: Path, modules: dict[str, Path]) -> tuple[set[str], set[str], list]:
    """(the smelt modules ``name`` imports, the top-level names of every other package it
    imports, the underscore names it takes from another smelt module)."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    bench_script = name.startswith("bench") and not name.startswith("bench.lvb")
    out, external, private = set(), set(), []
    # an import inside a function is a decision taken when it runs (a device's memory, an
    # optional dependency): the home rules on other packages read the module-level ones
    nested = {
        id(n)
        for f in ast.walk(tree)
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
        for n in ast.walk(f)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
                if bench_script and mod.split(".")[0] in ("lvb", "timing"):
                    mod = "bench." + mod  # bench/ scripts import their siblings by name
            targets = [
                f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names
            ]
            private += [
                f"{mod}.{a.name}"
                for a in node.names
                if a.name.startswith("_")
                and not a.name.startswith("__")
                and mod in modules
                and mod != name
                and f"{mod}.{a.name}" not in modules
            ]
        else:
            continue
        for t in targets:
            if t.split(".")[0] not in PACKAGES:
                if id(node) not in nested:
                    external.add(t.split(".")[0])
                continue
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out, external, private


@pytest.fixture(scope="module")
def read() -> dict[str, tuple[set[str], set[str], list]]:
    modules = _modules()
    return {name: _read(name, path, modules) for name, path in modules.items()}


@pytest.fixture(scope="module")
def graph(read) -> dict[str, set[str]]:
    return {name: r[0] for name, r in read.items()}


def _in(name: str, *homes: str) -> bool:
    return any(name == h or name.startswith(h + ".") for h in homes)


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += graph.get(n, ())
    return seen


M = "smelt_model."
#: the homes whose code runs without torch (the budget arithmetic, the cluster model on
#: paper, the scaling fits), through everything they import
NO_TORCH = (M + "budget", M + "cluster", M + "scaling")
#: what the scaling tools may import of smelt: themselves, the plot helper, the commands
SCALING_MAY = (M + "scaling", M + "plotting", "smelt_tools")
TRAINERS = (M + "train", M + "titan")


def violations(graph: dict[str, set[str]], external: dict[str, set[str]], private=None):
    """Every broken rule of the module docstring, one line each."""
    bad = []
    for name, targets in graph.items():
        if _in(name, *NO_TORCH):
            for m in sorted(_reach(graph, name)):
                if "torch" in external.get(m, ()):
                    bad.append(f"{name} reaches torch through {m}")
        for t in sorted(targets):
            if _in(name, M + "scaling") and not _in(t, *SCALING_MAY):
                bad.append(f"{name} (scaling) imports {t}")
            if _in(name, M + "budget") and name != M + "budget.cli" and _in(t, M + "cluster"):
                bad.append(f"{name} (the budgets) imports {t} (the cluster model)")
            if _in(name, M + "data", M + "checkpoint") and _in(t, *TRAINERS):
                bad.append(f"{name} (shared by the trainers) imports {t}")
            if _in(name, M + "train") and _in(t, M + "titan"):
                bad.append(f"{name} (one trainer) imports {t} (the other)")
            if _in(name, M + "titan") and _in(t, M + "train"):
                bad.append(f"{name} (one trainer) imports {t} (the other)")
        if "torchtitan" in external.get(name, ()) and not _in(name, M + "titan"):
            bad.append(f"{name} imports torchtitan outside smelt_model.titan")
    for name, names in (private or {}).items():
        bad += [f"{name} imports the private name {p}" for p in names]
    return bad


def test_each_home_keeps_its_rules(read):
    graph = {n: r[0] for n, r in read.items()}
    external = {n: r[1] for n, r in read.items()}
    private = {n: r[2] for n, r in read.items() if r[2]}
    bad = violations(graph, external, private)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "graph, external, private, expected",
    [
        (
            {M + "budget.ledger": {M + "model"}, M + "model": set()},
            {M + "model": {"torch"}},
            None,
            "smelt_model.budget.ledger reaches torch through smelt_model.model",
        ),
        ({M + "scaling.surface": {M + "config"}}, {}, None, "(scaling) imports smelt_model.config"),
        ({M + "budget.matcher": {M + "cluster.comm"}}, {}, None, "(the cluster model)"),
        ({M + "data.corpus": {M + "train.trainer"}}, {}, None, "(shared by the trainers)"),
        ({M + "train.cli": {M + "titan.model"}}, {}, None, "(one trainer) imports"),
        ({M + "titan.loader": {M + "train.data"}}, {}, None, "(one trainer) imports"),
        ({M + "model": set()}, {M + "model": {"torchtitan"}}, None, "outside smelt_model.titan"),
        ({}, {}, {M + "budget.cli": [M + "cluster.comm._bytes"]}, "the private name"),
    ],
)
def test_a_broken_rule_is_caught(graph, external, private, expected):
    """The rules above are not vacuous: each fabricated violation is reported."""
    bad = violations(graph, external, private)
    assert any(expected in line for line in bad), bad
    assert not violations({M + "budget.cli": {M + "cluster.comm"}}, {}, {})


def test_each_package_imports_only_the_layers_below(graph):
    bad = []
    for name, targets in graph.items():
        pkg = name.split(".")[0]
        for t in targets:
            other = t.split(".")[0]
            if other != pkg and other not in ALLOWED[pkg]:
                bad.append(f"{name} imports {t}")
    assert not bad, "\n".join(bad)


def test_no_import_circle(graph):
    """A package ``__init__`` that names its own submodules is not a circle by itself; any
    other path from a module back to itself is."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def edges(n):
        # a package's __init__ importing its own children is how packages expose names
        return [t for t in graph[n] if not (t.startswith(n + ".") and "." in t)]

    def visit(n):  # Tarjan's strongly connected components
        index[n] = low[n] = len(index)
        stack.append(n)
        on_stack.add(n)
        for t in edges(n):
            if t not in index:
                visit(t)
                low[n] = min(low[n], low[t])
            elif t in on_stack:
                low[n] = min(low[n], index[t])
        if low[n] == index[n]:
            comp = []
            while True:
                m = stack.pop()
                on_stack.discard(m)
                comp.append(m)
                if m == n:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    for n in graph:
        if n not in index:
            visit(n)
    assert not cycles, "import circles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_kernels_hold_no_benchmark_audit_or_loop_code():
    names = {p.stem for p in (ROOT / "smelt_kernels").rglob("*.py")}
    assert not names & {"audit", "timing", "bench", "cli", "selftest", "executor", "plan"}
    text = "\n".join(p.read_text() for p in (ROOT / "smelt_kernels").rglob("*.py"))
    for word in ("audit_launches", "LoopSchedule", "RECOMPUTE_POLICIES", "measure_interleaved"):
        assert word not in text, word


def test_the_budgets_the_cluster_model_and_the_scaling_fits_need_no_torch():
    code = (
        "import sys\n"
        "from smelt_model import budget, cluster, presets, scaling\n"
        "from smelt_model.budget import cli, memory\n"
        "budget.ledger(presets.get('tiny-smelt'))\n"
        "cluster.project_pair(*presets.pair('tiny'), 'h100-8')\n"
        "memory.available()\n"
        "assert 'torch' not in sys.modules, 'the budgets or the cluster model imported torch'\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=os.environ
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
