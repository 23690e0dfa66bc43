"""The launcher and the export command: a bad option is one line on stderr and exit status 2,
printed once whatever the number of processes; the launcher names the patches it applied and
runs as one process without torchrun."""

import logging
import sys
import time

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is not installed (extra 'titan')")

import titan_helpers as th  # noqa: E402

from smelt_model import presets  # noqa: E402
from smelt_model.titan import __main__ as launcher  # noqa: E402
from smelt_model.titan import patches  # noqa: E402
from smelt_model.titan.checkpoint import export  # noqa: E402

PREFIX = "python -m smelt_model.titan: error: "


def _one_line_error(capsys, code, *needles):
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith(PREFIX), err
    for needle in needles:
        assert needle in err[0], err[0]


@pytest.mark.parametrize(
    "argv,needles",
    [
        (["--config", "tiny-nothing"], ["unknown preset 'tiny-nothing'", "tiny-smelt"]),
        ([], ["--config PRESET is required"]),
        (["--config", "tiny-smelt", "--training.steps", "many"], ["many"]),
        (["--config", "tiny-smelt", "--no.such.option", "1"], ["no.such.option"]),
        (
            ["--config", "tiny-smelt", "--parallelism.expert_parallel_degree", "3"],
            ["expert_parallel_degree 3"],
        ),
        (
            ["--config", "tiny-smelt", "--parallelism.tensor_parallel_degree", "2"],
            ["= 2 does not divide the 1 processes"],
        ),
        (["--config", "tiny-smelt", "--activation_checkpoint:memory-budget"], ["memory-budget"]),
        (["--config", "tiny-smelt", "--training.steps", "0"], ["--training.steps"]),
        (
            ["--config", "tiny-smelt", "--override.imports", "no_such_pkg.mod.fn"],
            ["--override.imports", "no_such_pkg.mod.fn"],
        ),
        (
            ["--config", "tiny-smelt", "--override.imports", "smelt_model.titan.loader.nothing"],
            ["smelt_model.titan.loader.nothing", "names no registered @override"],
        ),
        (["--config", "tiny-smelt", "--nproc_per_node", "0"], ["--nproc_per_node"]),
    ],
)
def test_bad_launcher_options_are_one_line(argv, needles, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    _one_line_error(capsys, launcher.main(argv), *needles)


def test_a_mistyped_option_is_a_short_line(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code = launcher.main(["--config", "tiny-smelt", "--training.stepz", "3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "training.stepz" in err[0]
    assert len(err[0]) <= 300, err[0]


def test_bad_options_from_the_command_line_exit_2_without_a_traceback(tmp_path):
    proc = th.run(
        [
            sys.executable,
            "-m",
            "smelt_model.titan",
            "--config",
            "200M-S95-smelt",
            "--parallelism.expert_parallel_degree",
            "5",
        ],
        cwd=tmp_path,
        timeout=120,
        WORLD_SIZE=5,
    )
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()
    assert err == [PREFIX + "--parallelism.expert_parallel_degree 5 must divide the 288 experts"], (
        proc.stderr
    )


def _worker_traceback(text: str) -> bool:
    """Whether ``text`` holds a traceback through smelt's or torchtitan's code (a worker's,
    not torchrun's own report of a failed worker)."""
    return any(
        line.strip().startswith("File ") and ("smelt_model" in line or "torchtitan" in line)
        for line in text.splitlines()
    )


BAD_OVERRIDE = ["--override.imports", "smelt_model.titan.no_such_module.fn"]


@pytest.mark.slow
def test_a_bad_option_under_torchrun_is_one_line_printed_once(tmp_path):
    proc = th.torchrun(
        ["-m", "smelt_model.titan", "--config", "tiny-smelt", *BAD_OVERRIDE],
        cwd=tmp_path,
        timeout=150,
    )
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if line.startswith(PREFIX)]
    assert len(ours) == 1 and "smelt_model.titan.no_such_module" in ours[0], proc.stderr
    assert len(ours[0]) <= 300
    assert not _worker_traceback(proc.stdout + proc.stderr), proc.stderr[-3000:]


def test_nproc_per_node_reports_a_bad_option_alone_with_status_2(tmp_path):
    proc = th.run(
        [sys.executable, "-m", "smelt_model.titan", "--nproc_per_node", "2"]
        + ["--config", "tiny-smelt", *BAD_OVERRIDE],
        cwd=tmp_path,
        timeout=150,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        PREFIX + "--override.imports: Failed to import override target "
        "'smelt_model.titan.no_such_module.fn': module 'smelt_model.titan.no_such_module' "
        "could not be imported: No module named 'smelt_model.titan.no_such_module'"
    ], proc.stderr


def test_added_options_go_before_a_torchtitan_subcommand():
    """Options after ``activation_checkpoint:full`` are that subcommand's own: the options
    the patches add go before it, and the command line parses."""
    args = ["--module", "smelt_model.titan", "--config", "tiny-smelt", "activation_checkpoint:full"]
    out = patches.launch_args(args)
    assert out[-1] == "activation_checkpoint:full" and set(args) <= set(out)
    config = launcher._parse(out)
    assert type(config.activation_checkpoint).__name__ == "Config"
    assert "Full" in type(config.activation_checkpoint).__qualname__
    assert config.parallelism.spmd_backend == "partial_dtensor"


def test_the_launcher_names_the_patches_it_applies(capsys):
    needed = patches.needed()
    names = [p.name for p in patches.PATCHES]
    assert set(needed) <= set(names) and len(set(names)) == len(names)
    for p in patches.PATCHES:  # each says what it is for, so that it can be deleted
        assert p.versions and p.upstream and p.when and (p.install or p.flag), p.name
    for name in ("safe_dcp_reader", "safe_dataloader_state", "checked_resume", "rank0_log"):
        assert name in needed
    if not torch.cuda.is_available():
        assert {"cpu_device", "gloo_sum_reduction", "no_cuda_graphs", "cpu_metrics"} <= set(needed)
        args = patches.launch_args(["--config", "tiny-smelt"])
        assert "--training.disable_cuda_graphs" in args
        # an option the command line sets itself is left alone
        args = patches.launch_args(["--parallelism.spmd_backend", "full_dtensor"])
        assert args.count("--parallelism.spmd_backend") == 1
    applied = patches.apply()
    # every patch it needed, in the list's order; one that removes its own condition
    # (set_timeout) is still named
    assert set(needed) <= set(applied) and applied == [n for n in names if n in applied]
    assert "set_timeout" in applied or hasattr(torch.distributed, "set_timeout")
    import torchtitan.tools.logging as tt_logging
    import torchtitan.tools.utils as tt_utils

    if "cpu_device" in applied:
        assert tt_utils.device_type == "cpu"
        assert tt_utils.device_module.get_device_properties().total_memory > 0
    assert hasattr(torch.distributed, "set_timeout")
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        tt_logging.init_logger()  # what torchtitan's main calls first
        out = capsys.readouterr().out
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        logging.captureWarnings(False)
    assert f"smelt patches for torchtitan 0.3.0 / torch 2.13: {', '.join(applied)}" in out, out


def test_the_final_sleep_becomes_a_barrier_on_every_rank(monkeypatch):
    import torchtitan.trainer as tt_trainer

    calls = []

    def stock_train(self):  # how torchtitan's Trainer.train ends on rank 0
        tt_trainer.time.sleep(2)
        calls.append("trained")
        return "done"

    monkeypatch.setattr(tt_trainer.Trainer, "train", stock_train)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "barrier", lambda *a, **k: calls.append("barrier"))
    monkeypatch.setattr(patches, "_LOG_FILTERS", [])
    patches._install_end_barrier()
    start = time.perf_counter()
    assert tt_trainer.Trainer.train(object()) == "done"
    assert time.perf_counter() - start < 1.0 and calls == ["trained", "barrier"]
    assert tt_trainer.time is time  # the module's own clock again after the run
    record = logging.LogRecord("root", logging.INFO, "", 0, patches._FINAL_SLEEP, (), None)
    assert not patches._Filters().filter(record)  # the log does not claim the sleep


def test_export_refuses_what_is_not_a_checkpoint(tmp_path, capsys):
    not_dcp = tmp_path / "model.pt"
    not_dcp.write_bytes(b"not a checkpoint")
    for argv, status in (
        ([str(not_dcp), str(tmp_path / "out")], 1),
        ([str(tmp_path), str(tmp_path / "o")], 1),
        ([str(tmp_path)], 2),
    ):
        code = export.main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert code == status and len(err) == 1
        assert err[0].startswith("smelt-export: error: ")
    assert not (tmp_path / "out").exists()


class _Payload:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):  # what a crafted .metadata would run on an unrestricted load
        return (open, (self.path, "w"))


def test_export_refuses_a_checkpoint_whose_metadata_runs_code(tmp_path, capsys):
    import pickle

    from smelt_model.model import SmeltLM

    cfg = presets.get("tiny-baseline").replace(n_layers=2, n_experts=8, vocab_size=300)
    SmeltLM(cfg).save_pretrained(tmp_path / "smelt")
    assert export.main([str(tmp_path / "seed"), "--seed-from", str(tmp_path / "smelt")]) == 0
    marker = tmp_path / "ran"
    (tmp_path / "seed" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    capsys.readouterr()
    code = export.main([str(tmp_path / "seed"), str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and "refused, nothing was run" in err[0], err
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_seed_and_export_round_trip_in_one_process(tmp_path, capsys):
    from smelt_model.model import SmeltLM

    cfg = presets.get("tiny-baseline").replace(n_layers=2, n_experts=8, vocab_size=300)
    torch.manual_seed(0)
    model = SmeltLM(cfg)
    model.save_pretrained(tmp_path / "smelt")
    assert export.main([str(tmp_path / "seed"), "--seed-from", str(tmp_path / "smelt")]) == 0
    assert export.main([str(tmp_path / "seed"), str(tmp_path / "back"), "--dtype", "bfloat16"]) == 0
    capsys.readouterr()
    from safetensors.torch import load_file

    assert SmeltLM.from_pretrained(tmp_path / "back").cfg == cfg
    stored = load_file(str(tmp_path / "back" / "model.safetensors"))
    original = model.state_dict()
    assert set(stored) == set(original)
    for name, value in stored.items():
        assert value.dtype == torch.bfloat16, name
        torch.testing.assert_close(value, original[name].to(torch.bfloat16), rtol=0, atol=0)


def test_without_torchtitan_the_launcher_says_so_and_export_still_works(
    tmp_path, capsys, monkeypatch
):
    from smelt_model.model import SmeltLM

    monkeypatch.setitem(sys.modules, "torchtitan", None)  # import torchtitan -> ImportError
    _one_line_error(
        capsys, launcher.main(["--config", "tiny-smelt"]), "torchtitan is not installed"
    )
    cfg = presets.get("tiny-smelt").replace(n_layers=2, n_experts=8, loop=None)
    SmeltLM(cfg).save_pretrained(tmp_path / "smelt")
    assert export.main([str(tmp_path / "seed"), "--seed-from", str(tmp_path / "smelt")]) == 0
    assert export.main([str(tmp_path / "seed"), str(tmp_path / "back")]) == 0
    assert SmeltLM.from_pretrained(tmp_path / "back").cfg == cfg


@pytest.mark.parametrize("where", ["a_file", "a_file/below"])
def test_a_comm_folder_the_ranks_cannot_write_is_refused_before_the_run(
    where, tmp_path, capsys, monkeypatch
):
    (tmp_path / "a_file").write_text("not a folder")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("SMELT_TITAN_COMM", str(tmp_path / where))
    _one_line_error(capsys, launcher.main(["--config", "tiny-smelt"]), "SMELT_TITAN_COMM=", where)


def test_a_comm_folder_that_cannot_be_written_exits_non_zero_from_the_command_line(tmp_path):
    (tmp_path / "taken").write_text("")
    proc = th.run(
        [sys.executable, "-m", "smelt_model.titan", "--config", "tiny-smelt"]
        + ["--training.steps", "1", "--dump_folder", str(tmp_path / "run")],
        cwd=tmp_path,
        timeout=120,
        SMELT_TITAN_COMM=str(tmp_path / "taken"),
    )
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(PREFIX + "SMELT_TITAN_COMM="), proc.stderr
    assert not (tmp_path / "run").exists()
