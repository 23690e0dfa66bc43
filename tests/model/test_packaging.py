"""Packaging facts users meet first: the pinned versions are written once and used by both the
README's quick start and CI, the license is declared, `pytest tests bench` can collect, and
every name the README's API examples import exists."""

import ast
import importlib
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
CI = (ROOT / ".ci" / "run").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def _quick_start() -> str:
    section = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)


def _pip_installs(script: str) -> list[list[str]]:
    """Each `pip install ...` of a shell script, as its argument list."""
    cmds = []
    for line in script.splitlines():
        for part in re.split(r"&&|;", line):
            words = shlex.split(part.split("#", 1)[0])
            if words[:2] == ["pip", "install"]:
                cmds.append(words[2:])
    return cmds


def _setup_requirements() -> dict[str, list[str]]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    call = next(
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "setup"
    )
    kw = {k.arg: k.value for k in call.keywords}
    extras = ast.literal_eval(kw["extras_require"])
    return {
        "install": ast.literal_eval(kw["install_requires"]),
        **extras,
        "license": [ast.literal_eval(kw["license"])],
    }


def _name(req: str) -> str:
    return re.match(r"[A-Za-z0-9_.\-]+", req).group(0).lower()


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.lower()] = version
    return pins


def test_quick_start_and_ci_install_the_same_pins():
    readme, ci = _pip_installs(_quick_start()), _pip_installs(CI)
    assert readme and ci
    for cmd in readme + ci:
        assert cmd[:2] == ["-c", "constraints.txt"], cmd
    assert readme == ci  # the same packages, extras and flags, in the same order
    pins = _pins()
    for cmd in readme:
        for word in cmd[2:]:
            if not word.startswith("-"):
                name = _name(word)
                assert name in pins or word.startswith(".["), f"{word} is not pinned"
                assert "==" not in word, f"{word}: pin it in constraints.txt instead"


def test_ci_runs_the_readme_test_command():
    test_cmd = [line for line in _quick_start().splitlines() if "pytest" in line]
    assert test_cmd == ["python -m pytest tests -q -n auto"]
    assert test_cmd[0] in CI.splitlines()


def test_constraints_pin_every_requirement_and_extra():
    reqs, pins = _setup_requirements(), _pins()
    assert set(reqs) >= {"test", "plot", "hf", "train", "build"}
    for group, items in reqs.items():
        if group == "license":
            continue
        for r in items:
            assert _name(r) in pins, f"{r} ({group}) has no pin in constraints.txt"
    assert "matplotlib" in map(_name, reqs["plot"]) and "tokenizers" in map(_name, reqs["train"])
    assert any(_name(r) == "transformers" and "<6" in r for r in reqs["hf"])
    ci_extras = re.search(r'"\.\[([a-z,]+)\]"', CI).group(1).split(",")
    assert {"test", "hf", "train", "plot"} <= set(ci_extras)


def test_license_is_declared():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and "Copyright 2026 the smelt authors" in text
    assert _setup_requirements()["license"] == ["Apache-2.0"]


def test_pytest_tests_bench_collects_without_name_clashes():
    """Test modules in folders without __init__.py must have distinct basenames."""
    seen = {}
    for top in ("tests", "bench"):
        for path in (ROOT / top).rglob("test_*.py"):
            assert path.name not in seen, f"{path} and {seen[path.name]} clash"
            seen[path.name] = path


def _readme_imports() -> list[tuple[str, str]]:
    names = []
    for block in _blocks("python"):
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom):
                names += [(node.module, a.name) for a in node.names]
            elif isinstance(node, ast.Import):
                names += [(a.name, None) for a in node.names]
    return names


@pytest.mark.parametrize("module,name", _readme_imports())
def test_every_name_the_readme_imports_exists(module, name):
    mod = importlib.import_module(module)
    if name is not None:
        assert hasattr(mod, name) or importlib.import_module(f"{module}.{name}")
