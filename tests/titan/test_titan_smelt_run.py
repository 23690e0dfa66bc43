"""SMELT tiny on torchtitan, FSDP 2 x EP 2 on two CPU processes (gloo), from a seed made
from a SmeltLM: one instrumented run (tests/titan/titan_worker.py), checked against a
single-process SmeltLM, for its FSDP collectives, its all-to-all counts, and exported."""

import json
import math
import sys
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("torchtitan", reason="torchtitan is not installed (extra 'titan')")

import titan_helpers as th  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from smelt_model import presets  # noqa: E402
from smelt_model.model import SmeltLM  # noqa: E402
from smelt_model.titan import traffic  # noqa: E402
from smelt_model.titan.attention import segment_ids_from_positions  # noqa: E402
from smelt_model.titan.state_dict import to_smelt, write_seed  # noqa: E402

PRESET = "tiny-smelt"
STEPS = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("titan_smelt")
    torch.manual_seed(0)
    model = SmeltLM(presets.get(PRESET))
    model.save_pretrained(tmp / "smelt0")
    write_seed(model, tmp / "seed")
    args = [
        str(th.HERE / "titan_worker.py"),
        str(tmp / "out"),
        "--config",
        PRESET,
        "--training.steps",
        str(STEPS),
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--parallelism.expert_parallel_degree",
        "2",
        "--dataloader.dataset",
        th.SMALL_CORPUS,
        "--dump_folder",
        str(tmp / "dump"),
        "--training.mixed_precision_param",
        "float32",
        "--training.max_norm",
        "1e9",
        "--lr_scheduler.warmup_steps",
        "1",
        "--checkpoint.enable",
        "--checkpoint.initial_load_path",
        str(tmp / "seed"),
        "--checkpoint.interval",
        "1000",
    ]
    proc = th.torchrun(args, cwd=tmp, SMELT_TITAN_COMM=tmp / "comm")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {
        "dir": tmp,
        "log": proc.stdout + proc.stderr,
        "json": json.loads((tmp / "out" / "run.json").read_text()),
        "tensors": load_file(str(tmp / "out" / "step1.safetensors")),
    }


def test_first_step_equals_a_single_process_smeltlm(run):
    t = run["tensors"]
    ref = SmeltLM.from_pretrained(run["dir"] / "smelt0")
    ref.train()
    out = ref(t["input"], segment_ids_from_positions(t["positions"]))
    V = out.logits.shape[-1]
    ce = F.cross_entropy(out.logits.reshape(-1, V), t["labels"].reshape(-1), ignore_index=-100)
    objective = ce + out.aux_loss
    objective.backward()
    assert run["json"]["losses"][0] == pytest.approx(objective.item(), rel=1e-5)
    grads = to_smelt({k[len("grad.") :]: v for k, v in t.items() if k.startswith("grad.")})
    names = dict(ref.named_parameters())
    assert set(grads) == set(names)
    for name, p in names.items():
        torch.testing.assert_close(
            grads[name], p.grad, rtol=1e-4, atol=2e-6, msg=lambda m: f"{name}: {m}"
        )


def test_a_few_steps_with_falling_loss(run):
    losses = run["json"]["losses"]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]
    assert th.losses(run["log"])[0] == pytest.approx(losses[0], rel=1e-4)


def test_the_looped_span_is_gathered_once_per_forward_and_reduced_once(run):
    events = [e for e in run["json"]["collectives"] if e["step"] is not None]
    gathers = Counter(
        (e["step"], e["phase"])
        for e in events
        if e["kind"] == "all_gather" and e["units"] == ["span"]
    )
    reduces = Counter(
        (e["step"], e["group_size"])
        for e in events
        if e["kind"] == "reduce_scatter" and e["units"] == ["span"]
    )
    for step in range(1, STEPS):  # the last step also ran the export-check forward
        assert gathers[(step, "forward")] == 1, gathers
        assert gathers[(step, "backward")] == 1, gathers
        # one reduce-scatter per FSDP mesh of the unit: the shared weights over the
        # data-parallel mesh (2), the experts over the expert-FSDP one (1)
        assert reduces[(step, 2)] == 1 and reduces[(step, 1)] == 1, reduces
    assert all(len(e["units"]) == 1 for e in events)


def test_all_to_all_counts_follow_the_realised_routing(run):
    records = traffic.read(run["dir"] / "comm")
    cfg = presets.get(PRESET)
    assert [r["ep_rank"] for r in records] == [0, 1] and records[0]["ep_size"] == 2
    tokens = 2 * 64  # local batch x seq_len
    e = cfg.n_experts // 2
    by_rank = {}
    for r in records:
        calls = [c for c in r["calls"] if c["step"] == 1]
        assert len(calls) == cfg.executed_layers
        for c in calls:
            assert sum(c["routing"]) == tokens * cfg.top_k
        by_rank[r["ep_rank"]] = {
            (ev["call"], ev["kind"], ev["phase"]): ev for ev in r["events"] if ev["step"] == 1
        }
    matrices = traffic.routing_matrices(records, step=1)
    assert len(matrices) == cfg.executed_layers and len(matrices[0]) == 2
    for i in (0, 1):
        for (call, kind, phase), ev in by_rank[i].items():
            if kind == "counts":
                continue
            assert ev["row_bytes"] == cfg.hidden_size * 4
            routing = matrices[call]  # step 1 holds the first calls of the run
            sent = [sum(routing[i][j * e : (j + 1) * e]) for j in (0, 1)]
            received = [sum(routing[j][i * e : (i + 1) * e]) for j in (0, 1)]
            # dispatch forward and combine backward carry this rank's own rows out;
            # combine forward and dispatch backward carry the rows it received back
            expect = (
                sent
                if (kind, phase) in (("dispatch", "forward"), ("combine", "backward"))
                else received
            )
            assert ev["rows_to"] == expect, (i, call, kind, phase)
            assert ev["bytes_to_others"] == expect[1 - i] * ev["row_bytes"]
            assert ev["bytes_total"] == sum(expect) * ev["row_bytes"]
    steps = records[0]["steps"]["1"]
    assert {
        "dispatch_forward",
        "combine_forward",
        "dispatch_backward",
        "combine_backward",
        "dispatch_forward_including_self",
    } <= set(steps)


def test_the_ledger_counts_the_bytes_the_dispatcher_sent(run):
    """budget.comm on the run's realised routing equals, per rank and step, the bytes its
    all-to-alls sent to the other rank: forward dispatch and combine, and the backward's
    mirror of each."""
    from smelt_model import budget

    records = traffic.read(run["dir"] / "comm")
    cfg = presets.get(PRESET)
    # (the last step also holds the worker's extra forward for the export check)
    for step in range(1, STEPS):
        led = budget.comm(
            cfg,
            2 * 64 * 2,
            ep=2,
            dp_shard=2,
            dtype="float32",
            routing=traffic.routing_matrices(records, step=step),
        )
        for r in records:
            sent = r["steps"][str(step)]
            rank = r["ep_rank"]
            assert sent["dispatch_forward"] == led.dispatch_by_rank[rank], (step, rank)
            assert sent["combine_forward"] == led.combine_by_rank[rank], (step, rank)
            assert sent["combine_backward"] == led.dispatch_by_rank[rank], (step, rank)
            assert sent["dispatch_backward"] == led.combine_by_rank[rank], (step, rank)
        # the step's field sums each layer's busiest rank
        assert led.dispatch_forward >= max(led.dispatch_by_rank)


def test_export_gives_the_torchtitan_models_logits(run):
    ckpt = run["dir"] / "dump" / "checkpoint" / f"step-{STEPS}"
    out = run["dir"] / "exported"
    proc = th.run(
        [sys.executable, "-m", "smelt_model.titan.export", str(ckpt), str(out)],
        cwd=run["dir"],
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    t = run["tensors"]
    model = SmeltLM.from_pretrained(out).eval()
    with torch.no_grad():
        logits = model(t["input"], segment_ids_from_positions(t["positions"])).logits
    torch.testing.assert_close(logits, t["logits"], rtol=1e-5, atol=1e-5)
