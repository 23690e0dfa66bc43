"""The launcher and the export command: bad options are one line on stderr and exit 2."""

import sys

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is not installed (extra 'titan')")

import titan_helpers as th  # noqa: E402

from smelt_model import presets  # noqa: E402
from smelt_model.titan import __main__ as launcher  # noqa: E402
from smelt_model.titan import export, shims  # noqa: E402


def _one_line_error(capsys, code, *needles):
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("smelt_model.titan: error: "), err
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
    ],
)
def test_bad_launcher_options_are_one_line(argv, needles, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    _one_line_error(capsys, launcher.main(argv), *needles)


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
    assert err == [
        "smelt_model.titan: error: --parallelism.expert_parallel_degree 5 must "
        "divide the 288 experts"
    ], proc.stderr


def test_the_launcher_names_the_shims_this_process_needs():
    needed = shims.needed()
    assert set(needed) <= set(shims.SHIMS)
    if not torch.cuda.is_available():
        assert {"cpu_device", "gloo_sum_reduction", "no_cuda_graphs"} <= set(needed)
        args = shims.launch_args(["--config", "tiny-smelt"])
        assert "--training.disable_cuda_graphs" in args
        # an option the command line sets itself is left alone
        args = shims.launch_args(["--parallelism.spmd_backend", "full_dtensor"])
        assert args.count("--parallelism.spmd_backend") == 1
    applied = shims.apply()
    assert applied == needed or set(applied) >= set(needed)
    import torchtitan.tools.utils as tt_utils

    if "cpu_device" in applied:
        assert tt_utils.device_type == "cpu"
        assert tt_utils.device_module.get_device_properties().total_memory > 0
    assert hasattr(torch.distributed, "set_timeout")


def test_export_refuses_what_is_not_a_checkpoint(tmp_path, capsys):
    not_dcp = tmp_path / "model.pt"
    not_dcp.write_bytes(b"not a checkpoint")
    for argv in (
        [str(not_dcp), str(tmp_path / "out")],
        [str(tmp_path), str(tmp_path / "o")],
        [str(tmp_path)],
    ):
        code = export.main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1
        assert err[0].startswith("smelt_model.titan.export: error: ")
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
    assert code == 2 and len(err) == 1 and "refused, nothing was run" in err[0], err
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
