"""The README and the docs pages say what runs: every Python snippet runs as written (one
fresh process per page, in a scratch folder; the README's as pasted into the Python REPL),
the cheap commands they quote run too, and no command they quote writes into the
repository. docs/titan.md and docs/comm.md are run by tests/titan/ and
tests/cluster/test_comm.py."""

import re
import shlex
import subprocess
import sys
import textwrap
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
    [p for p in PAGES if p.name not in OWN_TESTS | {"README.md"} and _python_blocks(p)],
    ids=lambda p: p.name,
)
def test_python_snippets_run(page, tmp_path):
    script = "\n\n".join(f"# --- snippet {i}\n{b}" for i, b in enumerate(_python_blocks(page)))
    (tmp_path / "snippets.py").write_text(script)
    res = _run(["snippets.py"], tmp_path)
    assert res.returncode == 0, f"{page.name}:\n{res.stderr[-3000:]}"


REPL = textwrap.dedent(
    """
    import code, json, sys

    class Console(code.InteractiveConsole):
        errors = []

        def write(self, data):  # where the REPL prints a traceback or a syntax error
            self.errors.append(data)

    console = Console()
    for i, snippet in enumerate(json.load(open("snippets.json"))):
        more = False
        for line in snippet.splitlines():
            more = console.push(line)
        if more:
            console.push("")  # the blank line a user types to end the last block
        if console.errors:
            sys.exit(f"snippet {i} fails in the REPL:\\n" + "".join(console.errors))
    """
)


def test_readme_snippets_paste_into_the_repl(tmp_path):
    """Each README snippet fed to the interactive console line by line, as a paste into
    ``python`` does: a blank line inside an indented block ends it there."""
    import json

    (tmp_path / "snippets.json").write_text(json.dumps(_python_blocks(ROOT / "README.md")))
    (tmp_path / "repl.py").write_text(REPL)
    res = _run(["repl.py"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]


def test_the_repl_check_catches_a_blank_line_in_a_class(tmp_path):
    import json

    bad = "class A:\n    x = 1\n\n    def f(self):\n        return 1\n"
    (tmp_path / "snippets.json").write_text(json.dumps([bad]))
    (tmp_path / "repl.py").write_text(REPL)
    res = _run(["repl.py"], tmp_path)
    assert res.returncode != 0 and "IndentationError" in res.stderr


#: options that name a file or folder a command writes
OUTPUT_OPTIONS = ("--out", "--json", "--markdown", "--plot", "--dump_folder", "--output")
#: a value a reader substitutes (OUT, DIR, ...) or that is already outside the repository
PLACEHOLDER = re.compile(r"^(runs/|\$|[A-Z_]+$)")


def _commands(page: Path) -> list[str]:
    """The command lines a page quotes: every line of its bash blocks and every inline code
    span that runs python, torchrun or bash (a span may wrap across lines)."""
    text = page.read_text()
    lines = [x for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S) for x in b.splitlines()]
    spans = re.findall(r"(?<!`)`([^`]+)`(?!`)", re.sub(r"```.*?```", "", text, flags=re.S))
    found = lines + [" ".join(x.split()) for x in spans]
    return [c for c in found if re.search(r"\b(python|torchrun|bash)\b", c)]


def _writes_into_the_repository(command: str) -> list[str]:
    try:
        words = shlex.split(command.split("#")[0].replace("[", " ").replace("]", " "))
    except ValueError:
        words = command.split()
    bad = []
    for i, w in enumerate(words):
        name, eq, value = w.partition("=")
        if name not in OUTPUT_OPTIONS and w != "bench/gpu_check.sh":
            continue
        if not eq:
            value = words[i + 1] if i + 1 < len(words) else ""
        if not value or value.startswith("-"):
            bad.append(f"{name} with no folder (it writes into bench/results)")
        elif not PLACEHOLDER.match(value):
            bad.append(f"{name} {value}")
    return bad


#: pages whose quoted commands still write into the repository (page name -> what)
KNOWN_TO_WRITE: dict[str, str] = {}


@pytest.mark.parametrize(
    "page",
    [
        pytest.param(p, marks=pytest.mark.xfail(strict=True, reason=KNOWN_TO_WRITE[p.name]))
        if p.name in KNOWN_TO_WRITE
        else p
        for p in PAGES
    ],
    ids=lambda p: p.name,
)
def test_no_quoted_command_writes_into_the_repository(page):
    """Outputs go under runs/ (git-ignored) or a folder the reader names."""
    bad = {c: _writes_into_the_repository(c) for c in _commands(page)}
    assert not {c: b for c, b in bad.items() if b}


def test_the_output_check_sees_what_it_should():
    assert _writes_into_the_repository("python bench/x.py --json r.json --plot runs/p.png") == [
        "--json r.json"
    ]
    assert _writes_into_the_repository("python bench/x.py [--out]") != []
    assert _writes_into_the_repository("python -m m --out=runs/a --markdown $TMPDIR/a.md") == []
    assert _writes_into_the_repository("bash bench/gpu_check.sh gpu_out") != []
    assert _writes_into_the_repository("bash bench/gpu_check.sh OUT_DIR") == []


def test_the_quick_start_says_how_to_get_torch_for_the_cpu_and_how_long_it_takes():
    quick = _quick_start()
    assert "https://download.pytorch.org/whl/cpu" in quick and "-c constraints.txt torch" in quick
    assert "idle" in quick and "`time`" in quick and "--max-time" in quick
    assert "lists each file it compiles" in quick and "-v" in quick


def _quick_start() -> str:
    text = (ROOT / "README.md").read_text()
    return " ".join(text[text.index("## Quick start") : text.index("## A tour")].split())


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


def test_the_documented_ce_gains_are_what_the_code_prints(tmp_path):
    """docs/training.md quotes CE Gain twice: the snippet's result comment and the
    ``--paper`` row at 1e+21. Both are compared with what runs, so they cannot drift."""
    text = (ROOT / "docs" / "training.md").read_text()
    snippet = next(b for b in _python_blocks(ROOT / "docs" / "training.md") if "CE Gain" in b)
    quoted = re.search(r"CE Gain \{gain:\.1%\}\"\)\s*# ([\d.]+)% / ([\d.]+)% / ([\d.]+)%", snippet)
    assert quoted, "the snippet no longer quotes its three gains"
    (tmp_path / "gain.py").write_text(snippet)
    res = _run(["gain.py"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    printed = re.findall(r"CE Gain ([\d.]+)%", res.stdout)
    assert printed == list(quoted.groups()), res.stdout
    paper = re.search(r"`--paper` prints ([\d.]+)% /\s*([\d.]+)% / ([\d.]+)%", text)
    assert paper, "training.md no longer quotes the --paper row"
    res = _run(["-m", "smelt_model.scaling", "--paper"], tmp_path)
    row = next(x for x in res.stdout.splitlines() if x.startswith("| 1e+21 |") and "%" in x)
    assert [c.strip().rstrip("%") for c in row.split("|")[2:5]] == list(paper.groups()), row
