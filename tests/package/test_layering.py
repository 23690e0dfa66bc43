"""The packages' layering, read from the source (every import, at module level or inside a
function): ``smelt_kernels`` imports none of ``smelt_tools``, ``smelt_model`` or ``bench``;
``smelt_tools`` imports no ``smelt_model`` or ``bench``; ``smelt_model`` no ``bench``; and
no module reaches itself through the imports of the others (no import circle)."""

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
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    bench_script = name.startswith("bench") and not name.startswith("bench.lvb")
    out = set()
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
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


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
    for word in ("audit_launches", "LoopPlan", "RECOMPUTE_POLICIES", "measure_interleaved"):
        assert word not in text, word


def test_the_plan_and_the_ledger_need_no_torch():
    code = (
        "import sys\n"
        "from smelt_model import budget, presets\n"
        "budget.ledger(presets.get('tiny-smelt'))\n"
        "assert 'torch' not in sys.modules, 'the plan or the ledger imported torch'\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=os.environ
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
