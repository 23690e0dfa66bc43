"""The --moe_comm options in one process: the plan they resolve to, what each layer's
config gets, and the one-line refusals (before any process starts)."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is not installed (extra 'titan')")

import titan_helpers as th  # noqa: E402

from smelt_model import cluster  # noqa: E402
from smelt_model.titan import config_registry  # noqa: E402
from smelt_model.titan.moe.dispatch import (  # noqa: E402
    CountingAllToAllTokenDispatcher,
    DedupAllToAllTokenDispatcher,
    ScaledLocalTokenDispatcher,
)
from smelt_model.titan.moe.options import RunMesh, run_cluster  # noqa: E402
from smelt_model.titan.parallel.parallelize import resolve_parallel_plan, update_model_config  # noqa: E402


def _config(monkeypatch, world=2, local=None, ep=2, **moe_comm):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local or world))
    config = config_registry.trainer_config("tiny-smelt")
    config.parallelism.expert_parallel_degree = ep
    for key, value in moe_comm.items():
        setattr(config.moe_comm, key, value)
    return config


@pytest.mark.parametrize(
    "spec, dedup, kinds",
    [
        ("ep", True, "eeee"),
        ("span-gather", True, "egge"),
        ("gather,ep,ep,gather", False, "geeg"),
    ],
)
def test_each_layer_gets_its_dispatcher_and_sharding(monkeypatch, spec, dedup, kinds):
    config = _config(monkeypatch, plan=spec, dedup=dedup, overlap=True)
    config.training.local_batch_size = 2
    model = config.model_spec.model
    update_model_config(model, config)
    assert model.plan.letters == kinds and model.overlap and model.plan.dedup == dedup
    assert model.chunks == 2 and model.plan.span_units == "layer"
    ep_cls = DedupAllToAllTokenDispatcher if dedup else CountingAllToAllTokenDispatcher
    for i, kind in enumerate(kinds):
        moe = model.moe[i]
        expect = ep_cls if kind == "e" else ScaledLocalTokenDispatcher
        assert type(moe.routed_experts.token_dispatcher) is expect.Config
        state = moe.routed_experts.inner_experts.sharding_config.state_shardings
        assert ("ep" in str(state["w1_EFD"])) == (kind == "e")


def test_the_plan_line_says_whether_the_gathers_follow_the_loop(monkeypatch):
    from smelt_model.titan.moe.options import describe

    config = _config(monkeypatch, plan="span-gather")
    arch = config.model_spec.model.arch
    mesh = RunMesh(world=2, local_world=2, ep=2)
    plan = resolve_parallel_plan(config, arch, "none")[0]
    assert "; loop-aware prefetch;" in describe(plan, mesh, True, arch)
    # span experts gathered at every visit keep to one layer ahead
    config = _config(monkeypatch, plan="span-gather", span_gather="layer")
    plan = resolve_parallel_plan(config, arch, "none")[0]
    assert plan.prefetch == "loop" and "loop-aware" not in describe(plan, mesh, True, arch)
    config = _config(monkeypatch, plan="ep", prefetch="next")
    assert "loop-aware" not in describe(
        resolve_parallel_plan(config, arch, "none")[0], mesh, True, arch
    )


def test_the_cluster_comes_from_the_mesh_and_the_spec():
    mesh = RunMesh(world=16, local_world=8, ep=8)
    c = run_cluster("", mesh)
    assert (c.gpus, c.gpus_per_node, c.ep) == (16, 8, 8)
    c = run_cluster("gpus_per_node=4,inter=200Gb/s", mesh)
    assert (c.gpus, c.gpus_per_node, c.ep, c.inter) == (16, 4, 8, 25e9)
    with pytest.raises(ValueError, match="gpus=8, but the run has 16"):
        run_cluster("h100-8", mesh)


@pytest.mark.parametrize(
    "moe_comm, needle",
    [
        (dict(plan="bogus"), "--moe_comm.plan bogus: unknown plan 'bogus'"),
        (dict(plan="ep,gather"), "has 2 entries; the model has 4 physical layers"),
        (dict(gather_group="x"), "--moe_comm.gather_group 'x': choose one of"),
        (dict(overlap=True), "--training.local_batch_size must be a multiple of 2, got 1"),
        (dict(overlap=True, chunks=4), "must be a multiple of 4, got 2"),
        (dict(chunks=1), "--moe_comm.chunks 1: give 2 or more"),
        (dict(span_units="block"), "--moe_comm.span_units 'block': choose one of layer, span"),
        (dict(prefetch="early"), "--moe_comm.prefetch 'early': choose one of loop, next"),
        (dict(cluster="ep=4"), "ep=4, but the run has 2"),
        (
            dict(plan="span-gather", overlap=True, span_gather="layer"),
            "would gather the experts of span layers gathered at every visit once per chunk",
        ),
    ],
)
def test_a_plan_the_run_cannot_use_is_refused(monkeypatch, moe_comm, needle):
    config = _config(monkeypatch, **moe_comm)
    config.training.local_batch_size = (
        1 if moe_comm.get("overlap") and "chunks" not in moe_comm else 2
    )
    with pytest.raises(ValueError) as e:
        resolve_parallel_plan(config, config.model_spec.model.arch, "none")
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_the_launcher_says_it_in_one_line_before_any_process_starts(tmp_path):
    cmd = [sys.executable, "-m", "smelt_model.titan", "--config", "tiny-smelt"]
    cmd += ["--parallelism.expert_parallel_degree", "2", "--moe_comm.plan", "ep,gather"]
    proc = subprocess.run(
        cmd,
        cwd=tmp_path,
        env=th.env(WORLD_SIZE=2, LOCAL_WORLD_SIZE=2),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.endswith(
        "smelt_model.titan: error: --moe_comm.plan ep,gather: plan 'ep,gather' has 2 entries; "
        "the model has 4 physical layers"
    )
    assert "Traceback" not in proc.stderr and not (tmp_path / "outputs").exists()


def test_a_plan_that_does_not_fit_a_rank_is_refused(monkeypatch):
    """The ledger's memory per rank of the plan against the memory the SPEC gives (else
    what the machine has available), before anything is built."""
    from smelt_model.budget.memory import MemoryRefusal

    config = _config(monkeypatch, plan="gather", cluster="memory=1GB")
    with pytest.raises(MemoryRefusal) as e:
        resolve_parallel_plan(config, config.model_spec.model.arch, "none")
    message = str(e.value)
    assert "ParallelPlan('gggg'" in message and "on each rank" in message
    assert "--moe_comm.span_gather layer" in message and "\n" not in message
    config = _config(monkeypatch, plan="gather", cluster="memory=80GB")
    assert resolve_parallel_plan(config, config.model_spec.model.arch, "none")[0].letters == "gggg"


def test_auto_runs_the_ledgers_best_plan_for_the_run(monkeypatch):

    config = _config(monkeypatch, world=8, ep=8, plan="auto", cluster="memory=80GB")
    config.training.seq_len, config.training.local_batch_size = 256, 4
    arch = config.model_spec.model.arch
    plan, mesh = resolve_parallel_plan(config, arch, "none")
    expect, _ = cluster.best_plan(
        arch,
        "gpus=8,gpus_per_node=8,ep=8,memory=80GB",
        8 * 4 * 256,
        workload=cluster.Workload(dtype="bfloat16", mean_doc_len=256, seq_len=256),
        overlap=False,
    )
    assert plan == expect and mesh.world == 8
    assert plan.prefetch == "loop"  # the looped model's gathers follow the loop
    # the span as one unit, and one layer ahead, where the run asks for them
    config.moe_comm.span_units, config.moe_comm.prefetch = "span", "next"
    chosen = resolve_parallel_plan(config, arch, "none")[0]
    assert (chosen.span_units, chosen.prefetch) == ("span", "next")
    # a plan whose recompute the run does not match says which option would
    tight = _config(monkeypatch, world=8, ep=8, plan="auto", cluster="memory=10GB")
    tight.training.seq_len, tight.training.local_batch_size = 4096, 32
    with pytest.raises(ValueError) as refused:
        resolve_parallel_plan(tight, arch, "none")
    assert (
        "recomputes 'all-but-1'; run it with --moe_comm.keep_activations 1 "
        "activation_checkpoint:full (last) or give the plan"
    ) in str(refused.value)
    from smelt_model.titan.moe.options import recompute_args

    assert recompute_args("visit1") == "activation_checkpoint:selective (last)"
    assert recompute_args("all") == "activation_checkpoint:full (last)"
    assert recompute_args("none") == "activation_checkpoint:none (last)"
    assert resolve_parallel_plan(tight, arch, "all-but-1")[0].recompute == "all-but-1"


def test_the_launcher_checks_an_auto_plan_on_the_processes_it_will_start(monkeypatch):
    """``--nproc_per_node 2`` with ``--moe_comm.plan auto``: the launcher's check resolves
    the plan on a mesh of the 2 processes it is about to start (not on itself, one process,
    which EP 2 cannot divide), and leaves the environment as it found it."""
    from smelt_model.titan import __main__ as launcher
    from smelt_model.titan import patches

    for key in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    args = ["--module", "smelt_model.titan", "--config", "tiny-smelt"]
    args += ["--parallelism.data_parallel_shard_degree", "2"]
    args += ["--parallelism.expert_parallel_degree", "2", "--moe_comm.plan", "auto"]
    args += ["--training.seq_len", "128", "--training.local_batch_size", "2"]
    config = launcher._parse(patches.launch_args(args))
    launcher._check(config, 2)
    assert "WORLD_SIZE" not in os.environ and "LOCAL_WORLD_SIZE" not in os.environ
