"""SMELT tiny on torchtitan, FSDP 2 x EP 2 on two CPU processes (gloo), from a seed made
from a SmeltLM, with a mixed plan (one span layer's experts gathered, the other layers
expert-parallel), each span layer an FSDP unit kept gathered for both visits, the
de-duplicating dispatcher, the overlap in four chunks and the span's first visit
recomputed (overlapped again in the backward): one instrumented run
(tests/titan/titan_worker.py), checked against a single-process SmeltLM, for its FSDP
collectives, the bytes on the wire against the ledger, and exported."""

import math
import sys
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("torchtitan", reason="torchtitan is not installed (extra 'titan')")

# its module-scoped runs take long: scheduled first
pytestmark = pytest.mark.slow

import titan_helpers as th  # noqa: E402

from smelt_model import cluster, presets  # noqa: E402
from smelt_model.model import SmeltLM  # noqa: E402
from smelt_model.titan.attention import segment_ids_from_positions  # noqa: E402
from smelt_model.titan.checkpoint.state_dict import to_smelt, write_seed  # noqa: E402
from smelt_model.titan.moe import traffic  # noqa: E402

PRESET = "tiny-smelt"
STEPS = 4
PLAN = "ep,ep,gather,ep"  # tiny-smelt: layer 0, the span's layers 1 and 2, layer 3
CHUNKS = 4


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
        str(CHUNKS),
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
        "--moe_comm.plan",
        PLAN,
        "--moe_comm.overlap",
        "--moe_comm.chunks",
        str(CHUNKS),
        "activation_checkpoint:selective",
    ]
    proc = th.launch(args, cwd=tmp, SMELT_TITAN_COMM=tmp / "comm")
    return th.worker_results(proc, tmp)


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
    line = "smelt plan: layers ep,ep,gather,ep; ep 2; gather over 2 ranks (node, 1 replica)"
    assert line in run["log"]
    assert "overlap in 4 chunks; recompute visit1;" in run["log"]
    assert "each span layer an FSDP unit" in run["log"]


def test_each_span_layer_is_gathered_once_per_pass_and_reduced_once(run):
    """Each span layer is an FSDP unit run at both visits: gathered once in the forward
    (kept for the second visit), once for the backward (kept for both visits' backward,
    the first visit's recompute included), its gradients reduced once. The expert-parallel
    span layer has two parameter groups (its experts on the expert-FSDP mesh of 1 rank,
    the rest on the data-parallel mesh of 2); the gathered one, one (2 ranks)."""
    events = [e for e in run["json"]["collectives"] if e["step"] is not None]
    for layer, groups in (("span.layers.0", (1, 2)), ("span.layers.1", (2,))):
        mine = [e for e in events if e["layers"] == [layer]]
        gathers = Counter((e["step"], e["phase"]) for e in mine if e["kind"] == "all_gather")
        reduces = Counter(
            (e["step"], e["group_size"]) for e in mine if e["kind"] == "reduce_scatter"
        )
        for step in range(1, STEPS):  # the last step also ran the export-check forward
            # FSDP skips the all-gather of a group of one rank: only the 2-rank group's shows
            assert gathers[(step, "forward")] == 1, (layer, gathers)
            assert gathers[(step, "backward")] == 1, (layer, gathers)
            assert sorted(n for (s, n), k in reduces.items() for _ in range(k) if s == step) == [
                *groups
            ], (layer, reduces)
    assert all(len(e["units"]) == 1 for e in events)


def test_dedup_rows_follow_the_realised_routing(run):
    """Each chunk's MoE call on an ep layer sends one row per (token, rank) pair: its
    token_ranks; the combine returns what the other rank sent; the backward mirrors both,
    and the recomputed first visit sends its forward's rows again."""
    records = traffic.read(run["dir"] / "comm")
    cfg = presets.get(PRESET)
    assert [r["ep_rank"] for r in records] == [0, 1] and records[0]["ep_size"] == 2
    ep_layers = 4  # layer 0, layer 1 at both visits, layer 3 (the span's layer 2 is gathered)
    by_call = [{c["call"]: c for c in r["calls"] if c["step"] == 1} for r in records]
    for i, r in enumerate(records):
        calls = by_call[i]
        again = [c for c in calls.values() if c["recompute"]]
        assert len(calls) - len(again) == ep_layers * CHUNKS and len(again) == CHUNKS
        assert {c["chunk"] for c in calls.values()} == set(range(CHUNKS))
        for c in calls.values():
            assert c["dedup"] and sum(c["routing"]) == 64 * cfg.top_k  # a chunk: one row of 64
            assert max(c["token_ranks"]) <= 64 <= sum(c["token_ranks"])
        other = by_call[1 - i]
        for ev in r["events"]:
            if ev["step"] != 1 or ev["kind"] not in ("dispatch", "combine"):
                continue
            assert ev["row_bytes"] == cfg.hidden_size * 4
            mine = calls[ev["call"]]["token_ranks"]
            # the peer's call of the same layer and chunk: the same position in its record
            peer = list(other.values())[list(calls).index(ev["call"])]["token_ranks"]
            received = [mine[0], peer[0]] if i == 0 else [peer[1], mine[1]]
            out = (ev["kind"], ev["phase"]) in (
                ("dispatch", "forward"),
                ("dispatch", "recompute"),
                ("combine", "backward"),
            )
            assert ev["rows_to"] == (mine if out else received), (i, ev)


def test_the_ledger_counts_the_bytes_on_the_wire(run):
    """cluster.comm with the run's plan and realised token_ranks equals, per rank and step, the
    bytes its all-to-alls sent to the other rank (forward, backward and the recomputed
    forward), and the FSDP bytes of the gathered span layer's experts (104 experts split
    evenly over 2 ranks: no padding); the de-duplicated rows are fewer than the stock rows
    of the same routing by the ledger's factor."""

    records = traffic.read(run["dir"] / "comm")
    cfg = presets.get(PRESET)
    kw = dict(ep=2, overlap=True, chunks=CHUNKS, recompute="visit1")
    plan = cluster.parse_plan(PLAN, cfg, dedup=True, **kw)
    stock = cluster.parse_plan(PLAN, cfg, dedup=False, **kw)
    tokens = 2 * 64 * CHUNKS
    for step in range(1, STEPS):  # the last step also holds the worker's export-check forward
        ranks = traffic.token_rank_matrices(records, step=step)
        led = cluster.comm(cfg, tokens, dp_shard=2, plan=plan, dtype="float32", token_ranks=ranks)
        rows = cluster.comm(
            cfg,
            tokens,
            dp_shard=2,
            plan=stock,
            dtype="float32",
            routing=traffic.routing_matrices(records, step=step),
        )
        for r in records:
            sent, rank = r["steps"][str(step)], r["ep_rank"]
            assert sent["dispatch_forward"] == led.ep.dispatch_by_rank[rank], (step, rank)
            assert sent["combine_forward"] == led.ep.combine_by_rank[rank], (step, rank)
            assert sent["combine_backward"] == led.ep.dispatch_by_rank[rank], (step, rank)
            assert sent["dispatch_backward"] == led.ep.combine_by_rank[rank], (step, rank)
            # each de-duplicated row's slots (ids and scores), and the scores' gradients
            assert sent["slots_forward"] == led.ep.slots_by_rank[rank] > 0, (step, rank)
            assert sent["slots_backward"] == led.ep.slots_back_by_rank[rank], (step, rank)
            # the split sizes before each chunk's dispatch, and before the recomputed ones
            assert sent["counts_forward"] == led.ep.counts_forward > 0, (step, rank)
            assert sent["counts_recompute"] == led.ep.counts_recompute > 0, (step, rank)
            for name in ("all_gather_forward", "all_gather_backward"):
                want = getattr(led.gather, name)
                assert sent[f"gather_{name}"] == pytest.approx(want, rel=1e-12), (step, name)
            assert sent["gather_reduce_scatter"] == pytest.approx(led.gather.reduce_scatter)
            assert "gather_all_reduce" not in sent  # one node: no replicas
            fewer = sent["dispatch_forward"] / rows.ep.dispatch_by_rank[rank]
            assert fewer == pytest.approx(
                led.ep.dispatch_by_rank[rank] / rows.ep.dispatch_by_rank[rank]
            )
            assert fewer < 0.5  # k 8 of 104 experts over 2 ranks: about 0.25 (uniform)
        # one recomputed ep layer (layer 1's first visit): the ledger counts its busier rank
        for key in ("dispatch_recompute", "combine_recompute", "slots_recompute"):
            assert max(r["steps"][str(step)][key] for r in records) == getattr(led.ep, key), key


def test_export_gives_the_torchtitan_models_logits(run):
    ckpt = run["dir"] / "dump" / "checkpoint" / f"step-{STEPS}"
    out = run["dir"] / "exported"
    proc = th.run(
        [sys.executable, "-m", "smelt_model.titan.checkpoint.export", str(ckpt), str(out)],
        cwd=run["dir"],
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    t = run["tensors"]
    model = SmeltLM.from_pretrained(out).eval()
    with torch.no_grad():
        logits = model(t["input"], segment_ids_from_positions(t["positions"])).logits
    torch.testing.assert_close(logits, t["logits"], rtol=1e-5, atol=1e-5)
