"""traffic.read refuses a damaged record folder with a ValueError naming the file."""

import json

import pytest

from smelt_model.titan.moe import traffic


def _record(rank):
    r = traffic.Recorder()
    r.rank, r.ep_rank, r.ep_size = rank, rank, 2
    r.calls.append({"call": 0, "step": 1, "routing": [1, 2], "token_ranks": [1, 1], "dedup": True})
    return r.to_dict()


def _folder(tmp_path, **files):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return tmp_path


def test_read_orders_by_rank_and_ignores_names_the_recorder_does_not_write(tmp_path):
    ranks = {f"comm_rank{r}.json": json.dumps(_record(r)) for r in (0, 1, 10)}
    folder = _folder(tmp_path, **ranks, **{"comm_rankfoo.json": "junk", "comm_rank1.json.bak": "x"})
    assert [r["rank"] for r in traffic.read(folder)] == [0, 1, 10]


def test_read_of_only_stray_names_says_there_are_no_records(tmp_path):
    folder = _folder(tmp_path, **{"comm_rankfoo.json": json.dumps(_record(0))})
    with pytest.raises(ValueError, match="no comm_rank<R>.json"):
        traffic.read(folder)


@pytest.mark.parametrize(
    "text, needle",
    [
        ("[1]", "holds a list"),
        ("{not json", "not a readable JSON file"),
        ("\xff\xfe", "not a readable JSON file"),
        ('{"format": "other"}', "not a smelt-titan-comm/2 file"),
        ("null", "holds a NoneType"),
    ],
)
def test_read_names_the_file_that_is_not_a_record(tmp_path, text, needle):
    folder = _folder(tmp_path, **{"comm_rank0.json": text})
    with pytest.raises(ValueError, match=needle) as e:
        traffic.read(folder)
    assert "comm_rank0.json" in str(e.value)


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"calls": "x"}, "'calls' must be list"),
        ({"rank": None}, "'rank' must be int"),
        ({"ep_rank": "0"}, "'ep_rank' must be an int or null"),
        ({"steps": []}, "'steps' must be dict"),
        ({"calls": [7]}, r"calls\[0\] lacks"),
        ({"calls": [{"routing": ["a"], "token_ranks": []}]}, r"calls\[0\] lacks"),
        ({"rank": 3}, "records rank 3, its name says rank 0"),
    ],
)
def test_read_names_the_file_and_the_field_that_is_wrong(tmp_path, change, needle):
    folder = _folder(tmp_path, **{"comm_rank0.json": json.dumps({**_record(0), **change})})
    with pytest.raises(ValueError, match=needle) as e:
        traffic.read(folder)
    assert "comm_rank0.json" in str(e.value)


def test_check_folder_creates_a_missing_folder_and_leaves_nothing_in_it(tmp_path):
    folder = tmp_path / "a" / "b"
    assert traffic.check_folder(folder) == folder
    assert folder.is_dir() and list(folder.iterdir()) == []


def test_check_folder_refuses_a_file_naming_it(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match=r"SMELT_TITAN_COMM=.*f: cannot write records there"):
        traffic.check_folder(tmp_path / "f")
