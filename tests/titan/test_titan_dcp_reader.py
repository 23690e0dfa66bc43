"""``smelt-export`` on checkpoints someone crafted: a ``.metadata`` that lies about a dtype or
a size, points outside the folder or is not DCP metadata at all, and a truncated shard, are
each one line and exit status 1, nothing written; a bf16 checkpoint exports as bf16."""

import pickle
import sys

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is not installed (extra 'titan')")

import titan_helpers as th  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from smelt_model import presets  # noqa: E402
from smelt_model.model import SmeltLM  # noqa: E402
from smelt_model.titan.checkpoint import export  # noqa: E402

CFG = presets.get("tiny-baseline").replace(n_layers=2, n_experts=8, vocab_size=300)


@pytest.fixture
def seed(tmp_path, capsys):
    """A seed checkpoint of a small SmeltLM (fp32), and the model."""
    torch.manual_seed(0)
    model = SmeltLM(CFG)
    model.save_pretrained(tmp_path / "smelt")
    assert export.main([str(tmp_path / "seed"), "--seed-from", str(tmp_path / "smelt")]) == 0
    capsys.readouterr()
    return tmp_path / "seed", model


def _metadata(folder):
    return pickle.loads((folder / ".metadata").read_bytes())  # our own test file


def _write_metadata(folder, meta):
    (folder / ".metadata").write_bytes(pickle.dumps(meta))


def _refused(capsys, code, out, *needles):
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1, err
    assert len(err) == 1 and err[0].startswith("smelt-export: error: "), err
    for needle in needles:
        assert needle in err[0], err[0]
    assert not out.exists()


def _tensor_key(meta, name="norm.weight"):
    return next(k for k in meta.state_dict_metadata if k.endswith(name))


def test_a_weight_declared_int8_but_stored_fp32_is_refused(seed, tmp_path, capsys):
    folder, _ = seed
    meta = _metadata(folder)
    key = _tensor_key(meta)
    meta.state_dict_metadata[key].properties.dtype = torch.int8
    _write_metadata(folder, meta)
    out = tmp_path / "out"
    _refused(capsys, export.main([str(folder), str(out)]), out, key, "torch.int8", "float32")


def test_a_size_larger_than_the_stored_bytes_is_refused_before_allocating(seed, tmp_path, capsys):
    folder, _ = seed
    meta = _metadata(folder)
    key = _tensor_key(meta)
    entry = meta.state_dict_metadata[key]
    huge = torch.Size([10**12])
    entry.size = huge
    entry.chunks[0].sizes = huge
    _write_metadata(folder, meta)
    out = tmp_path / "out"
    _refused(capsys, export.main([str(folder), str(out)]), out, key, "stored bytes")


@pytest.mark.parametrize("how", ["absolute", "parent"])
def test_storage_paths_outside_the_folder_are_refused(seed, tmp_path, capsys, how):
    folder, _ = seed
    meta = _metadata(folder)
    outside = tmp_path / "elsewhere.distcp"
    shard = next(folder.glob("*.distcp"))
    outside.write_bytes(shard.read_bytes())
    target = str(outside) if how == "absolute" else "../elsewhere.distcp"
    for info in meta.storage_data.values():
        info.relative_path = target
    _write_metadata(folder, meta)
    out = tmp_path / "out"
    _refused(capsys, export.main([str(folder), str(out)]), out, "outside")


@pytest.mark.parametrize(
    "content",
    [
        pickle.dumps(__import__("collections").OrderedDict()),
        pickle.dumps(5),
        pickle.dumps(torch.Size([3, 4])),
        pickle.dumps(__import__("pathlib").PurePosixPath("/etc")),
    ],
    ids=["OrderedDict", "int", "Size", "path"],
)
def test_metadata_that_is_not_dcp_metadata_is_one_line(seed, tmp_path, capsys, content):
    folder, _ = seed
    (folder / ".metadata").write_bytes(content)
    out = tmp_path / "out"
    _refused(capsys, export.main([str(folder), str(out)]), out, ".metadata", "not DCP metadata")


def test_a_truncated_shard_is_refused_naming_it(seed, tmp_path, capsys):
    folder, _ = seed
    shard = next(folder.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    out = tmp_path / "out"
    _refused(capsys, export.main([str(folder), str(out)]), out, shard.name, "truncated")


def test_a_bf16_checkpoint_exports_as_bf16_by_default(tmp_path, capsys):
    torch.manual_seed(0)
    model = SmeltLM(CFG).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "smelt")
    assert export.main([str(tmp_path / "seed"), "--seed-from", str(tmp_path / "smelt")]) == 0
    assert export.main([str(tmp_path / "seed"), str(tmp_path / "back")]) == 0
    stored = load_file(str(tmp_path / "back" / "model.safetensors"))
    original = model.state_dict()
    assert set(stored) == set(original)
    for name, value in stored.items():
        assert value.dtype == torch.bfloat16, name
        torch.testing.assert_close(value, original[name], rtol=0, atol=0)
    assert export.main([str(tmp_path / "seed"), str(tmp_path / "f32"), "--dtype", "float32"]) == 0
    assert all(
        v.dtype == torch.float32
        for v in load_file(str(tmp_path / "f32" / "model.safetensors")).values()
    )


def test_bad_export_options_are_usage_errors(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    for argv in (
        [str(tmp_path)],
        [str(tmp_path / "a"), str(tmp_path / "b"), "--seed-from", str(tmp_path)],
        [str(tmp_path), str(tmp_path / "file")],
        [str(tmp_path), str(tmp_path / "o"), "--dtype", "int8"],
    ):
        assert export.main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("smelt-export: error: "), err


def test_the_console_script_form_is_one_line(tmp_path):
    proc = th.run(
        [
            sys.executable,
            "-m",
            "smelt_model.titan.checkpoint.export",
            str(tmp_path),
            str(tmp_path / "o"),
        ],
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"smelt-export: error: {tmp_path}: not a torchtitan checkpoint folder (no DCP "
        ".metadata); pass one step's folder, e.g. checkpoint/step-100"
    ]


class _Payload:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):  # what an unrestricted load would run
        return (open, (self.path, "w"))


# DCP warns that it assumes one process even when no_dist=True says so (torch 2.13)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_the_patched_reader_holds_every_dcp_load_in_the_process(seed, tmp_path):
    """What the launcher's ``safe_dcp_reader`` patch does to a plain ``dcp.load``."""
    import torch.distributed.checkpoint as dcp

    from smelt_model.checkpoint.dcp import first_failure
    from smelt_model.titan import patches

    patches.apply()
    folder, _ = seed
    marker = tmp_path / "ran"
    dcp.save({"data": _Payload(marker)}, checkpoint_id=str(tmp_path / "bytes"), no_dist=True)
    with pytest.raises(BaseException) as info:  # DCP wraps the error (a BaseException)
        dcp.load({"data": None}, checkpoint_id=str(tmp_path / "bytes"), no_dist=True)
    assert "refused, nothing was run" in str(first_failure(info.value))
    (folder / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(BaseException) as info:
        dcp.load(
            {"norm.weight": torch.empty(CFG.hidden_size)}, checkpoint_id=str(folder), no_dist=True
        )
    assert "refused, nothing was run" in str(first_failure(info.value))
    assert not marker.exists()


def test_restricted_loads_takes_plain_data_only(tmp_path):
    import numpy as np

    from smelt_model.checkpoint import CheckpointError
    from smelt_model.checkpoint.dcp import restricted_loads

    state = {
        "n": 3,
        "buf": [1, 2, 3],
        "t": torch.arange(4.0),
        "rng": np.random.get_state(),
        "od": __import__("collections").OrderedDict(a=(1, 2.5, None, b"x")),
        "s": {1, 2},
    }
    back = restricted_loads(pickle.dumps(state), "the entry x")
    assert back["n"] == 3 and back["buf"] == [1, 2, 3] and back["s"] == {1, 2}
    assert torch.equal(back["t"], state["t"]) and (back["rng"][1] == state["rng"][1]).all()
    marker = tmp_path / "ran"
    for blob in (
        pickle.dumps(_Payload(marker)),
        pickle.dumps({"ok": 1, "bad": [_Payload(marker)]}),
        pickle.dumps(np.array([object()], dtype=object)),
        b"not a pickle",
        5,
    ):
        with pytest.raises(CheckpointError, match="the entry x"):
            restricted_loads(blob, "the entry x")
    assert not marker.exists()
