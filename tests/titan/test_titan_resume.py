"""Resuming on torchtitan through the launcher: nothing a checkpoint holds runs, what it
holds must fit the run, a newest checkpoint that does not load gives way to the one before
(saying so), and the resumed run reproduces the uninterrupted one's losses exactly.

The crafted checkpoints carry a live pickle payload (it would create a file if unpickled)
in every place torchtitan 0.3 / torch 2.13 unpickle during a load: DCP's ``.metadata``,
non-tensor entries of the train state, learning-rate scheduler and optimizer, a tensor
chunk, and the bytes a stock dataloader pickles its position into."""

import copy
import io
import pickle
import shutil
import sys

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is not installed (extra 'titan')")

# its module-scoped runs take long: scheduled first
pytestmark = pytest.mark.slow

import titan_helpers as th  # noqa: E402

from smelt_model import presets  # noqa: E402
from smelt_model.model import SmeltLM  # noqa: E402
from smelt_model.titan.checkpoint.state_dict import write_seed  # noqa: E402

PREFIX = "python -m smelt_model.titan: error: "


class _Payload:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):  # what an unrestricted load would run
        return (open, (self.path, "w"))


def _stock_args(dump, steps):
    return th.STOCK + [
        "--training.steps",
        str(steps),
        "--checkpoint.enable",
        "--checkpoint.interval",
        "1",
        "--checkpoint.no-last-save-model-only",
        "--dump_folder",
        str(dump),
    ]


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    """A stock qwen3 MoE (torchtitan's own dataloader) trained 3 steps on 2 ranks with a
    full checkpoint after each: its folder, log and losses."""
    tmp = tmp_path_factory.mktemp("titan_stock")
    th.stock_corpus(tmp)
    proc = th.launch(_stock_args(tmp / "base", 3), cwd=tmp)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    return {"dir": tmp, "log": log, "losses": th.losses(log)}


def _replaced(state, key, value):
    """``state`` (nested dicts) with every entry ``key`` set to ``value``."""
    if not isinstance(state, dict):
        return state
    return {k: value if k == key else _replaced(v, key, value) for k, v in state.items()}


def _craft(stock, dump, marker, only=None) -> dict[int, str]:
    """``dump/checkpoint``: the clean step-1 of the stock run, and above it one step folder
    per fault (each otherwise step 1's state, at its own step; ``only``: that fault
    alone); returns step -> fault."""
    base = stock["dir"] / "base" / "checkpoint" / "step-1"
    ckpt = dump / "checkpoint"
    ckpt.mkdir(parents=True)
    shutil.copytree(base, ckpt / "step-1")
    clean = th.read_all(base)
    lr = next(k for k in clean["optimizer"] if k.startswith("param_groups.") and k.endswith(".lr"))
    avg = next(k for k in clean["optimizer"] if k.endswith(".exp_avg"))
    position = pickle.loads(clean["dataloader"]["dp_rank_0"])  # the test's own file

    def put(part, key, value):
        return lambda st: st[part].__setitem__(key, value)

    faults = [
        ("train_state payload", put("train_state", "ntokens_seen", _Payload(marker))),
        ("lr_scheduler payload", put("lr_scheduler", "last_epoch", _Payload(marker))),
        ("optimizer payload", put("optimizer", lr, _Payload(marker))),
        ("dataloader payload", put("dataloader", "dp_rank_0", pickle.dumps(_Payload(marker)))),
        ("lr a string", put("optimizer", lr, "fast")),
        ("exp_avg shape", put("optimizer", avg, torch.zeros(3))),
        ("scheduler field", put("lr_scheduler", "last_epoch", "x")),
        (
            "data position",
            put("dataloader", "dp_rank_0", pickle.dumps({**position, "_num_yielded": 10**12})),
        ),
        (
            "negative sample_idx",
            put("dataloader", "dp_rank_0", pickle.dumps(_replaced(position, "sample_idx", -5))),
        ),
        (
            "token outside the vocabulary",
            put(
                "dataloader",
                "dp_rank_0",
                pickle.dumps(_replaced(position, "inputs_buffer", [1, 10**9])),
            ),
        ),
        ("step not its folder", None),
        ("truncated shard", "truncate"),
        ("model only", "model"),
        ("tensor payload", "tensor"),
        (".metadata payload", "metadata"),
    ]
    made = {}
    for n, (name, change) in enumerate(faults, start=2):
        if only is not None and name != only:
            continue
        state = copy.deepcopy(clean)  # step 1's state, read once
        if name != "step not its folder":
            state["train_state"]["step"] = n
            state["lr_scheduler"]["last_epoch"] = n
        if callable(change):
            change(state)
        if change == "model":  # what a run's model-only last step holds
            state = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        folder = ckpt / f"step-{n}"
        th.write_all(state, folder)
        if change == "truncate":
            shard = next(folder.glob("*.distcp"))
            shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        elif change in ("tensor", "metadata"):
            meta = pickle.loads((folder / ".metadata").read_bytes())
            if change == "tensor":  # norm.weight's bytes become a pickled payload
                info = next(v for k, v in meta.storage_data.items() if k.fqn == "norm.weight")
                shard = folder / info.relative_path
                blob = io.BytesIO()
                torch.save(_Payload(marker), blob)
                info.offset, info.length = shard.stat().st_size, len(blob.getvalue())
                with open(shard, "ab") as fh:
                    fh.write(blob.getvalue())
                (folder / ".metadata").write_bytes(pickle.dumps(meta))
            else:
                (folder / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
        made[n] = name
    return made


def test_the_payloads_are_live(tmp_path):
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(_Payload(marker)))
    assert marker.exists()


def test_every_crafted_checkpoint_is_passed_over_and_the_resume_is_exact(stock, tmp_path):
    marker = tmp_path / "ran"
    dump = tmp_path / "dump"
    made = _craft(stock, dump, marker)
    proc = th.launch(_stock_args(dump, 3), cwd=stock["dir"])
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert not marker.exists()
    notices = [line for line in log.splitlines() if "checkpoint not loaded: " in line]
    assert len(notices) == len(made), "\n".join(notices)  # once each: rank 0 logs
    expected = {
        "train_state payload": ["train_state.ntokens_seen", "refused, nothing was run"],
        "lr_scheduler payload": ["lr_scheduler.last_epoch", "refused, nothing was run"],
        "optimizer payload": ["optimizer.param_groups", "refused, nothing was run"],
        "dataloader payload": ["dataloader.dp_rank_0", "refused, nothing was run"],
        "lr a string": ["lr is the string 'fast'"],
        "exp_avg shape": ["exp_avg", "Size mismatch"],
        "scheduler field": ["lr_scheduler.last_epoch is the string 'x'"],
        "data position": ["_num_yielded = 1000000000000"],
        "negative sample_idx": ["sample_idx = -5 is negative"],
        "token outside the vocabulary": ["inputs_buffer holds token 1000000000"],
        "step not its folder": ["train_state.step is 1, its folder is step-12"],
        "truncated shard": [".distcp", "truncated"],
        "model only": ["holds the model only", "cannot resume"],
        "tensor payload": ["norm.weight", "it names"],
        ".metadata payload": [".metadata", "refused, nothing was run"],
    }
    for n, name in made.items():
        line = next(x for x in notices if f"step-{n}/" in x or f"step-{n}:" in x)
        for needle in expected[name]:
            assert needle in line, (name, line)
    assert "Loading the checkpoint from" in log and f"{dump}/checkpoint/step-1." in log
    assert th.losses(log) == stock["losses"][1:]  # steps 2 and 3, bitwise


def test_a_checkpoint_named_explicitly_is_not_replaced_and_fails_once(stock, tmp_path):
    """Two processes started by the launcher itself (``--nproc_per_node``): the failure is
    one line on stderr, printed by one of them, and the status is the workers' (1)."""
    marker = tmp_path / "ran"
    dump = tmp_path / "dump"
    (step,) = _craft(stock, dump, marker, only=".metadata payload")
    args = _stock_args(dump, 3)[2:] + ["--checkpoint.load_step", str(step)]
    proc = th.run(
        [sys.executable, "-m", "smelt_model.titan", "--nproc_per_node", "2", *args],
        cwd=stock["dir"],
        HF_HOME=th.forkserver_hf_home(),  # the stock run prepared its dataset there
    )
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-3000:]
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(PREFIX), proc.stderr[-3000:]
    assert f"step-{step}/.metadata" in err[0] and "refused, nothing was run" in err[0]
    assert not marker.exists()


def test_the_log_of_a_cpu_run_is_plain_and_said_once(stock):
    log = stock["log"]
    assert "\x1b[" not in log  # no colour codes when the output is not a terminal
    steps = [line for line in log.splitlines() if " step: " in line and "loss:" in line]
    assert len(steps) == 3  # one line per step, not one per rank
    assert log.count("torchtitan version") == 1
    for noise in (
        "mfu",
        "memory: ",
        "memory usage for model",
        "lspci",
        "Peak flops",
        "initial_load_model_only=True has no effect",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    ):
        assert noise not in log, noise
    assert "smelt patches for torchtitan 0.3.0" in log and "rank0_log" in log


def _smelt_args(dump, *extra):
    return [
        "-m",
        "smelt_model.titan",
        "--config",
        "tiny-smelt",
        "--training.steps",
        "2",
        "--training.seq_len",
        "32",
        "--training.local_batch_size",
        "1",
        "--dataloader.dataset",
        th.SMALL_CORPUS,
        "--checkpoint.enable",
        "--dump_folder",
        str(dump),
        *extra,
    ]


def _smelt_step(folder, preset, batches):
    """A SMELT checkpoint folder of ``preset`` at step 1 whose data position is
    ``batches`` (model, train state and data position; no optimizer state)."""
    torch.manual_seed(0)
    write_seed(SmeltLM(presets.get(preset)), folder)
    state = th.read_all(folder)
    state["train_state"] = {"step": 1, "ntokens_seen": 32}
    state["dataloader"] = {"dp_rank_0": {"batches": batches}, "world_size": 1}
    shutil.rmtree(folder)
    th.write_all(state, folder)


def test_a_smelt_data_position_beyond_its_step_and_another_preset_are_refused(tmp_path):
    """A SMELT run's loader skips the batches its state says: a crafted 10**12 must not make
    the resume spin; a checkpoint of another preset says which. One process, no torchrun."""
    ckpt = tmp_path / "dump" / "checkpoint"
    _smelt_step(ckpt / "step-2", "tiny-baseline", 2)
    _smelt_step(ckpt / "step-1", "tiny-smelt", 10**12)
    args = _smelt_args(
        tmp_path / "dump", "--checkpoint.exclude_from_loading", "optimizer,lr_scheduler"
    )
    proc = th.launch_one(args, cwd=tmp_path, timeout=170)
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-3000:]
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(PREFIX + "no loadable checkpoint"), proc.stderr
    assert "step-2: holds preset 'tiny-baseline'" in err[0]
    assert "this run is preset 'tiny-smelt'" in err[0]
    assert "step-1: the data position dataloader.dp_rank_0.batches = 1000000000000" in err[0]


def test_another_presets_initial_load_path_says_which_preset_it_holds(tmp_path):
    from types import SimpleNamespace

    from smelt_model.checkpoint import CheckpointError
    from smelt_model.titan.checkpoint import resume
    from smelt_model.titan.checkpoint.state_dict import config_bytes

    write_seed(SmeltLM(presets.get("tiny-baseline")), tmp_path / "seed")
    mine = {"config_json": config_bytes(presets.get("tiny-smelt"))}
    manager = SimpleNamespace(
        folder=str(tmp_path / "none"),
        initial_load_path=str(tmp_path / "seed"),
        initial_load_in_hf=False,
        initial_load_model_only=True,
        exclude_from_loading=[],
        states={"model": SimpleNamespace(state_dict=lambda: mine)},
    )
    with pytest.raises(CheckpointError) as info:
        resume.checked_load(manager)
    assert str(info.value) == (
        f"--checkpoint.initial_load_path: {tmp_path / 'seed'}: holds "
        f"{resume.describe(presets.get('tiny-baseline'))}, but this run is "
        f"{resume.describe(presets.get('tiny-smelt'))}"
    )
    assert "preset 'tiny-baseline'" in str(info.value)


def test_a_smelt_run_resumes_from_its_checkpoint_in_one_process(tmp_path):
    """Without torchrun the launcher runs one process; it resumes its own checkpoint."""
    full = ("--checkpoint.interval", "1", "--checkpoint.no-last-save-model-only")
    first = th.launch_one(_smelt_args(tmp_path / "dump", *full), cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    args = _smelt_args(tmp_path / "dump", "--checkpoint.interval", "1")  # step 3: model only
    args[args.index("--training.steps") + 1] = "3"
    again = th.launch_one(args, cwd=tmp_path)
    log = again.stdout + again.stderr
    assert again.returncode == 0, log[-3000:]
    assert "Loading the checkpoint from" in log and "step-2" in log
    assert len(th.losses(log)) == 1  # only step 3 trained
