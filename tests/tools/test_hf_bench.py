"""The benchmark command: bad arguments give one line ``<prog>: error: ...`` on stderr and
exit status 2, before any work; the table renders every row. (Timings themselves are not
tested.)"""

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")

from smelt_tools import hf_bench as bench  # noqa: E402


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["--device", "tpu"], "--device must be cpu or cuda"),
        (["--repeats", "0"], "--repeats must be >= 1"),
        (["--repeats", "x"], "argument --repeats: invalid int value"),
        (["--no-such-option"], "unrecognized arguments"),
        (["--threads", "0"], "--threads must be a positive integer"),
        (["--out", __file__], "is a file, expected a folder"),
    ],
)
def test_bad_arguments_fail_with_one_line(argv, msg, capsys):
    assert bench.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{bench.PROG}: error: ") and msg in err[0]


def test_memory_estimate_guards_large_shapes():
    big = dict(bench.SHAPES["cpu"], batch=512, seq=8192)
    assert bench.estimate_bytes(big) > bench.MEMORY_LIMIT_BYTES
    assert bench.estimate_bytes(bench.SHAPES["cpu"]) < bench.MEMORY_LIMIT_BYTES


def test_markdown_has_a_row_per_measurement():
    env = dict(
        date="d",
        device="cpu",
        device_name="x",
        torch_threads=1,
        torch="t",
        load_average=1.0,
        transformers="5",
        dtype="float32",
        smelt_moe_backend="cpu",
        smelt_attention_backend="cpu",
        shape=dict(bench.SHAPES["cpu"], dtype="float32"),
    )
    row = {c: 1.0 for c in bench.COLUMNS}
    text = bench.markdown(dict(environment=env, rows=[row, row]))
    assert text.count("\n| 1 |") == 2
