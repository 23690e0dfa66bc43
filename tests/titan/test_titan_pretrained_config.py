"""A config handed in with a folder of weights is checked against them, and against the
memory, before any model is built: each bad config is one quick error, through
SmeltLM.from_pretrained and through the export's --seed-from."""

import json
import shutil
import sys

import pytest
import titan_helpers as th
import torch

from smelt_model import presets
from smelt_model.model import SmeltLM

BAD = {
    "loop_count": (("loop", "count"), 10**9, "executed layers"),
    "n_layers": (("n_layers",), 10**6, "n_layers 1000000"),
    "vocab_size": (("vocab_size",), 10**10, "vocab_size 10000000000"),
}


@pytest.fixture(scope="module")
def init(tmp_path_factory):
    torch.manual_seed(0)
    return SmeltLM(presets.get("tiny-smelt")).save_pretrained(tmp_path_factory.mktemp("init"))


def _bad_folder(init, tmp_path, case):
    keys, value, _ = BAD[case]
    folder = shutil.copytree(init, tmp_path / case)
    cfg = json.loads((folder / "config.json").read_text())
    (cfg[keys[0]] if len(keys) == 2 else cfg)[keys[-1]] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("case", list(BAD))
def test_from_pretrained_refuses_a_config_its_weights_or_memory_cannot_hold(init, tmp_path, case):
    folder = _bad_folder(init, tmp_path, case)
    script = (
        "import sys\nfrom smelt_model.model import SmeltLM\n"
        "try:\n    SmeltLM.from_pretrained(sys.argv[1])\n"
        "except ValueError as e:\n    print(e)\n    sys.exit(3)\n"
    )
    proc = th.run([sys.executable, "-c", script, str(folder)], cwd=tmp_path, timeout=60)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert BAD[case][2] in proc.stdout and str(folder) in proc.stdout, proc.stdout


@pytest.mark.parametrize("case", list(BAD))
def test_seed_from_refuses_it_in_one_line(init, tmp_path, case):
    folder = _bad_folder(init, tmp_path, case)
    cmd = [sys.executable, "-m", "smelt_model.titan.checkpoint.export", str(tmp_path / "seed")]
    proc = th.run(cmd + ["--seed-from", str(folder)], cwd=tmp_path, timeout=60)
    assert proc.returncode == 1
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("smelt-export: error: "), proc.stderr[-2000:]
    assert BAD[case][2] in err[0]
    assert not (tmp_path / "seed").exists()


def test_a_file_that_is_not_safetensors_is_named(init, tmp_path):
    folder = shutil.copytree(init, tmp_path / "junk")
    (folder / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match="model.safetensors: not a readable safetensors file"):
        SmeltLM.from_pretrained(folder)


def test_a_good_folder_still_loads(init):
    model = SmeltLM.from_pretrained(init)
    torch.manual_seed(0)
    saved = SmeltLM(presets.get("tiny-smelt")).state_dict()
    loaded = model.state_dict()
    assert set(loaded) == set(saved)
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
