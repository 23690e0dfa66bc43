"""Every command the README and docs/ quote names options its program has: each one's
arguments go through the program's own argparse parser (in one process, stopped right after
the parse, so nothing runs), and an unknown option, a choice the parser refuses or a
missing argument fails the test with the page and the command. Commands a page names only
by module (``python -m smelt_model.train``) must name a module that exists. The commands of
docs/titan.md and docs/training.md also run in full in tests/titan and tests/train; the
torchtitan launcher's own options (``--training.steps``) are torchtitan's to check there."""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))
from test_docs import PAGES, _commands  # noqa: E402

#: what a placeholder stands for, where a parser checks the value's form
PLACEHOLDERS = {"PAIR": "tiny", "SPEC": "h100-8", "N": "2"}
#: programs whose options another parser owns (torchtitan's config manager), or that are not
#: smelt's (pytest, pip, venv)
FOREIGN = ("smelt_model.titan", "pytest", "pip", "venv")

RUNNER = r"""
import argparse, contextlib, importlib.util, io, json, os, runpy, sys

class Parsed(BaseException):
    pass

original = argparse.ArgumentParser.parse_args

def parse_only(self, args=None, namespace=None):
    original(self, args, namespace)  # an error exits 2 with argparse's message
    raise Parsed

argparse.ArgumentParser.parse_args = parse_only
out = []
for kind, target, argv in json.load(open(sys.argv[1])):
    if kind == "module" and not argv:
        out.append("" if importlib.util.find_spec(target) else f"no module {target}")
        continue
    sys.argv = [target, *argv]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            if kind == "module":
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:  # as python does for a script: its folder first on the path
                sys.path.insert(0, os.path.dirname(target))
                try:
                    runpy.run_path(target, run_name="__main__")
                finally:
                    sys.path.pop(0)
        out.append("the program ran to its end without parsing its arguments")
    except Parsed:
        out.append("")
    except SystemExit as e:
        out.append(f"exit {e.code}: " + err.getvalue().strip().splitlines()[-1:][0]
                   if err.getvalue().strip() else f"exit {e.code}")
    except BaseException as e:
        out.append(f"{type(e).__name__}: {e}")
print(json.dumps(out))
"""


def _invocations(command: str) -> list[tuple[str, str, list[str]]]:
    """The smelt programs a command line starts: (``module`` or ``path``, target, argv),
    optional ``[...]`` options taken as given, placeholders replaced."""
    found = []
    for part in re.split(r"&&|\|\|?|;", command.split("  #")[0]):
        if "..." in part or "[its" in part or "[torchtitan" in part:
            continue  # a shape of a command, not one to run
        words = shlex.split(part.replace("[", " ").replace("]", " "), comments=True)
        while words and re.match(r"^[A-Z_]+=", words[0]):
            words.pop(0)
        if not words or words[0] not in ("python", "python3"):
            continue
        words = [PLACEHOLDERS.get(w, w) for w in words[1:]]
        if words[0] == "-m":
            if words[1].startswith(FOREIGN):
                continue
            found.append(("module", words[1], words[2:]))
        elif words[0].endswith(".py"):
            found.append(("path", str(ROOT / words[0]), words[1:]))
    return found


def _check(invocations, tmp_path) -> list[str]:
    (tmp_path / "commands.json").write_text(json.dumps(invocations))
    (tmp_path / "runner.py").write_text(RUNNER)
    res = subprocess.run(
        [sys.executable, str(tmp_path / "runner.py"), str(tmp_path / "commands.json")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_every_quoted_command_parses(tmp_path):
    quoted = [(p.name, c, inv) for p in PAGES for c in _commands(p) for inv in _invocations(c)]
    assert len(quoted) >= 30, quoted  # the pages quote about forty
    errors = _check([inv for _, _, inv in quoted], tmp_path)
    bad = [f"{page}: {cmd}\n  {err}" for (page, cmd, _), err in zip(quoted, errors) if err]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "command,expected",
    [
        ("python -m smelt_model.budget tiny --colour", "unrecognized arguments: --colour"),
        ("python bench/bench_peers.py --device tpu", "invalid choice"),
        ("python -m smelt_model.no_such_module", "no module smelt_model.no_such_module"),
        ("python -m smelt_model.budget tiny", ""),
    ],
)
def test_the_check_catches_an_unknown_option(command, expected, tmp_path):
    [err] = _check(_invocations(command), tmp_path)
    assert (expected in err) if expected else err == "", err


def test_the_invocations_follow_the_shell():
    got = _invocations(
        "SMELT_X=1 python -m smelt_model.budget PAIR --cluster SPEC && python3 -m venv .venv"
        " && python bench/x.py [--device cuda]  # a comment"
    )
    assert got == [
        ("module", "smelt_model.budget", ["tiny", "--cluster", "h100-8"]),
        ("path", str(ROOT / "bench/x.py"), ["--device", "cuda"]),
    ]
    assert _invocations("torchrun ... -m smelt_model.titan --config PRESET") == []
