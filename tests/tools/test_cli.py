"""The one command convention (smelt_tools.cli): usage errors exit 2, failures the user
caused exit 1, each one line naming what is wrong; a bug keeps its traceback."""

import pytest

from smelt_tools import cli


def _command(raise_what):
    def run(argv):
        parser = cli.Parser(prog="toy")
        parser.add_argument("--n", type=int, default=1)
        args = parser.parse_args(argv)
        if raise_what is not None:
            raise raise_what
        return args.n - 1

    return cli.command("toy", run)


@pytest.mark.parametrize(
    "error, status, line",
    [
        (cli.UsageError("--n must be positive"), 2, "toy: error: --n must be positive"),
        (cli.CommandError("run.json: not a run"), 1, "toy: error: run.json: not a run"),
        (ValueError("bad\nvalue   here"), 1, "toy: error: bad value here"),
        (FileNotFoundError(2, "No such file or directory", "x.csv"), 1,
         "toy: error: x.csv: No such file or directory"),
    ],
)  # fmt: skip
def test_each_failure_is_one_line_with_its_status(error, status, line, capsys, monkeypatch):
    monkeypatch.delenv("SMELT_TRACEBACK", raising=False)
    assert _command(error)([]) == status
    assert capsys.readouterr().err == line + "\n"


def test_a_bad_option_is_a_usage_error_and_success_returns_the_status(capsys):
    assert _command(None)(["--n", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("toy: error: argument --n: invalid int value") and err.count("\n") == 1
    assert _command(None)(["--n", "3"]) == 2 and _command(None)([]) == 0


def test_a_bug_keeps_its_traceback_and_smelt_traceback_re_raises(monkeypatch, capsys):
    with pytest.raises(KeyError):
        _command(KeyError("a bug"))([])
    monkeypatch.setenv("SMELT_TRACEBACK", "1")
    with pytest.raises(cli.CommandError):
        _command(cli.CommandError("x"))([])
    monkeypatch.setenv("SMELT_TRACEBACK", "yes")
    assert _command(cli.CommandError("x"))([]) == 1
    assert "SMELT_TRACEBACK='yes' was ignored" in capsys.readouterr().err


def test_shared_option_helpers(tmp_path):
    assert cli.output_path(None, "--json") is None
    assert cli.output_path(tmp_path / "new" / "r.json", "--json", (".json",)).name == "r.json"
    with pytest.raises(cli.UsageError, match="--json .*is a folder"):
        cli.output_path(tmp_path, "--json")
    with pytest.raises(cli.UsageError, match="expected a .png file"):
        cli.output_path(tmp_path / "r.jpg", "--plot", (".png",))
    (tmp_path / "file").write_text("")
    with pytest.raises(cli.UsageError, match="is not a folder"):
        cli.output_path(tmp_path / "file" / "r.json", "--json")
    assert "did you mean 'tiny-smelt'?" in str(cli.unknown("preset", "tiny-smlt", ["tiny-smelt"]))
    assert "did you mean" not in str(cli.unknown("preset", "zzz", ["tiny-smelt"]))
    assert cli.threads(None) is None and cli.threads(2) == 2
    with pytest.raises(cli.UsageError, match="--threads"):
        cli.threads(0)


def test_an_output_where_nothing_can_be_written_is_refused_first(tmp_path):
    """A folder or file this process may not write is refused before any work. Writing is
    tried, not asked of os.access, so root is refused too: /proc takes no new file and its
    files no appending."""
    with pytest.raises(cli.UsageError, match=r"--plot /proc/x.png: the folder /proc is not"):
        cli.output_path("/proc/x.png", "--plot", (".png",))
    with pytest.raises(cli.UsageError, match=r"--plot .*the folder /proc is not writable"):
        cli.output_path("/proc/new/steps.png", "--plot", (".png",))
    with pytest.raises(cli.UsageError, match="--json .*the file /proc/version is not writable"):
        cli.output_path("/proc/version", "--json")
    old = tmp_path / "old.json"
    old.write_text("{}")
    assert cli.output_path(old, "--json") == old and old.read_text() == "{}"  # left as it was
    assert cli.output_path(tmp_path / "new.json", "--json") == tmp_path / "new.json"
    assert not (tmp_path / "new.json").exists()  # created to try, and removed
    with pytest.raises(cli.UsageError, match="--plot .*: no folder .*missing"):
        cli.output_path(tmp_path / "missing" / "a.png", "--plot", (".png",), new_folders=False)
    assert not (tmp_path / "missing").exists()
