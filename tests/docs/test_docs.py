"""The README and the docs pages say what runs: every Python snippet runs as written (one
fresh process per page, in a scratch folder), and the cheap commands they quote run too.
docs/titan.md and docs/comm.md are run by tests/titan/ and tests/model/test_comm.py."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
OWN_TESTS = {"titan.md", "comm.md"}


def _python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def _run(args, cwd, timeout=300):
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )


@pytest.mark.parametrize(
    "page",
    [p for p in PAGES if p.name not in OWN_TESTS and _python_blocks(p)],
    ids=lambda p: p.name,
)
def test_python_snippets_run(page, tmp_path):
    script = "\n\n".join(f"# --- snippet {i}\n{b}" for i, b in enumerate(_python_blocks(page)))
    (tmp_path / "snippets.py").write_text(script)
    res = _run(["snippets.py"], tmp_path)
    assert res.returncode == 0, f"{page.name}:\n{res.stderr[-3000:]}"


#: (page, command) pairs: the command must appear in the page as written, and run
COMMANDS = [
    ("model.md", "python -m smelt_model.budget 200M-S95"),
    ("model.md", "python -m smelt_model.budget 200M-S95-baseline --match"),
    ("training.md", "python -m smelt_model.scaling --paper"),
    ("gpu.md", "python -m smelt_tools.selftest --quick"),
    ("README.md", "python -m smelt_model.budget 200M-S95 --cluster h100-64"),
]


@pytest.mark.parametrize("page,command", COMMANDS)
def test_quoted_commands_run(page, command, tmp_path):
    path = ROOT / page if page == "README.md" else ROOT / "docs" / page
    text = " ".join(path.read_text().split())  # a command may wrap across lines
    assert command in text, f"{page} no longer quotes {command!r}"
    words = command.split()
    assert words[:2] == ["python", "-m"]
    res = _run(words[1:], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]


def test_links_between_pages_resolve():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#]+)\)", page.read_text()):
            if target.startswith("http"):
                continue
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"
