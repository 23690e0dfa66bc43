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


#: one interpreter for every bad folder: ``SmeltLM.from_pretrained(folder)``, then
#: ``python -m smelt_model.titan.checkpoint.export SEED --seed-from folder`` as ``python -m``
#: runs it (its own ``__main__``, its exit status, and everything written to the stderr
#: file descriptor while it ran)
_REFUSALS = """
import json, os, runpy, sys, tempfile, traceback
from smelt_model.model import SmeltLM

out = {}
for case, folder, seed in json.loads(sys.argv[1]):
    mine = out[case] = {}
    try:
        SmeltLM.from_pretrained(folder)
        mine["from_pretrained"] = [0, ""]
    except ValueError as e:
        mine["from_pretrained"] = [3, str(e)]
    except Exception:
        mine["from_pretrained"] = [1, traceback.format_exc()]
    sys.argv = ["export", seed, "--seed-from", folder]
    with tempfile.TemporaryFile("w+") as err:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        try:
            runpy.run_module("smelt_model.titan.checkpoint.export", run_name="__main__")
            status = 0
        except SystemExit as e:
            status = e.code
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        mine["seed_from"] = [status, err.read(), os.path.exists(seed)]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def refusals(init, tmp_path_factory):
    """case -> {"folder", "seed", "from_pretrained": [status, message],
    "seed_from": [exit status, stderr, whether SEED exists]}"""
    tmp = tmp_path_factory.mktemp("bad")
    cases = [(c, str(_bad_folder(init, tmp, c)), str(tmp / f"{c}-seed")) for c in BAD]
    proc = th.run([sys.executable, "-c", _REFUSALS, json.dumps(cases)], cwd=tmp, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for case, folder, seed in cases:
        out[case].update(folder=folder, seed=seed)
    return out


@pytest.mark.parametrize("case", list(BAD))
def test_from_pretrained_refuses_a_config_its_weights_or_memory_cannot_hold(refusals, case):
    status, message = refusals[case]["from_pretrained"]
    assert status == 3, message[-2000:]
    assert BAD[case][2] in message and refusals[case]["folder"] in message, message


@pytest.mark.parametrize("case", list(BAD))
def test_seed_from_refuses_it_in_one_line(refusals, case):
    status, stderr, seed_exists = refusals[case]["seed_from"]
    assert status == 1
    err = stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("smelt-export: error: "), stderr[-2000:]
    assert BAD[case][2] in err[0]
    assert not seed_exists


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
