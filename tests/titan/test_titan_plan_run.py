"""SMELT tiny on four CPU processes (gloo): expert parallelism over groups of 2 beside the
looped span's experts gathered over "nodes" of 2 ranks (FSDP inside a node, replicas on the
other node, their gradients all-reduced between them), gathered again at every visit, each
span layer an FSDP unit, with torchtitan's stock rows, no overlap and every layer
recomputed. One instrumented run (tests/titan/titan_worker.py), checked against a
single-process SmeltLM and its wire bytes against the ledger."""

import math
import re

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
STEPS = 3
WORLD, EP, NODE = 4, 2, 2


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("titan_plan")
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
        "1",
        "--parallelism.expert_parallel_degree",
        str(EP),
        "--dataloader.dataset",
        th.SMALL_CORPUS,
        "--dump_folder",
        str(tmp / "dump"),
        "--training.mixed_precision_param",
        "float32",
        "--lr_scheduler.warmup_steps",
        "1",
        "--checkpoint.enable",
        "--checkpoint.initial_load_path",
        str(tmp / "seed"),
        "--checkpoint.interval",
        "1000",
        "--moe_comm.plan",
        "span-gather",
        "--moe_comm.cluster",
        f"gpus_per_node={NODE}",
        "--moe_comm.no-dedup",
        "--moe_comm.span_gather",
        "layer",
        "activation_checkpoint:full",
    ]
    proc = th.launch(args, cwd=tmp, nproc=WORLD, timeout=300, SMELT_TITAN_COMM=tmp / "comm")
    return th.worker_results(proc, tmp)


def test_first_step_equals_a_single_process_smeltlm(run):
    """Loss and every gradient; the gradients are clipped by their norm over three meshes
    (dense, expert-parallel, in-node gathered), which equals the one-process norm."""
    t = run["tensors"]
    ref = SmeltLM.from_pretrained(run["dir"] / "smelt0")
    ref.train()
    out = ref(t["input"], segment_ids_from_positions(t["positions"]))
    V = out.logits.shape[-1]
    ce = F.cross_entropy(out.logits.reshape(-1, V), t["labels"].reshape(-1), ignore_index=-100)
    objective = ce + out.aux_loss
    objective.backward()
    assert run["json"]["losses"][0] == pytest.approx(objective.item(), rel=1e-5)
    names = dict(ref.named_parameters())
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in names.values()]))
    logged = float(re.search(r"step:\s+1\s.*?grad_norm:\s+([0-9.]+)", run["log"]).group(1))
    assert logged == pytest.approx(norm.item(), rel=1e-4)
    clip = min(1.0, 1.0 / (norm.item() + 1e-6))  # torchtitan's max_norm 1 (the default)
    grads = to_smelt({k[len("grad.") :]: v for k, v in t.items() if k.startswith("grad.")})
    assert set(grads) == set(names)
    for name, p in names.items():
        torch.testing.assert_close(
            grads[name], p.grad * clip, rtol=1e-4, atol=2e-7, msg=lambda m: f"{name}: {m}"
        )
    losses = run["json"]["losses"]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert "gather over 2 ranks (node, 2 replicas), span layer; stock rows" in run["log"]
    assert "no overlap; recompute all;" in run["log"]


def test_the_ledger_counts_the_bytes_on_the_wire(run):
    """Per EP group (ranks 0-1 and 2-3), rank and step: the stock all-to-alls equal
    cluster.comm on the realised routing (every layer's forward exchanges run again in its
    recompute), and the gathered span experts' FSDP bytes (104 experts over 2 ranks: no
    padding) equal the ledger's gather fields: all-gathers over the node's 2 ranks at every
    visit, forward and backward; FSDP2 reduces the gradients of a unit run twice once per
    step (reduce-scatter over the node, all-reduce between the 2 replicas)."""
    records = traffic.read(run["dir"] / "comm")
    cfg = presets.get(PRESET)
    kw = dict(ep=EP, dedup=False, overlap=False, recompute="all")
    plan = cluster.parse_plan("span-gather", cfg, span_gather="layer", **kw)
    unit = cluster.parse_plan("span-gather", cfg, **kw)
    for r in records:
        groups = {(e["kind"], e["group"], e["group_size"]) for e in r["fsdp"]}
        assert groups == {
            ("all_gather", "gather_shard", 2),
            ("reduce_scatter", "gather_shard", 2),
            ("all_reduce", "gather_shard_replicas", 2),
        }
    for step in range(1, STEPS):
        for first in range(0, WORLD, EP):
            group = [r for r in records if first <= r["rank"] < first + EP]
            kw = dict(dp_shard=WORLD, gpus_per_node=NODE, dtype="float32")
            routing = traffic.routing_matrices(group, step=step)
            led = cluster.comm(cfg, WORLD * 64, plan=plan, routing=routing, **kw)
            once = cluster.comm(cfg, WORLD * 64, plan=unit, routing=routing, **kw)
            for r in group:
                sent, rank = r["steps"][str(step)], r["ep_rank"]
                assert sent["dispatch_forward"] == led.ep.dispatch_by_rank[rank]
                assert sent["combine_forward"] == led.ep.combine_by_rank[rank]
                assert sent["combine_backward"] == led.ep.dispatch_by_rank[rank]
                assert sent["dispatch_backward"] == led.ep.combine_by_rank[rank]
                # every layer recomputed: its forward's exchanges again
                assert sent["dispatch_recompute"] == led.ep.dispatch_by_rank[rank]
                assert sent["combine_recompute"] == led.ep.combine_by_rank[rank]
                # the split sizes before each dispatch, and before each recomputed one
                assert sent["counts_forward"] == led.ep.counts_forward > 0
                assert sent["counts_recompute"] == led.ep.counts_recompute > 0
                for name in ("all_gather_forward", "all_gather_backward"):
                    key, want = f"gather_{name}", getattr(led.gather, name)
                    assert sent[key] == pytest.approx(want, rel=1e-12), key
                    assert sent[key] == pytest.approx(2 * getattr(once.gather, name), rel=1e-12)
                for name in ("reduce_scatter", "all_reduce"):
                    key, want = f"gather_{name}", getattr(led.gather, name)
                    assert sent[key] == pytest.approx(want, rel=1e-12), key
                    assert want == getattr(once.gather, name), key
            for key in ("dispatch_recompute", "combine_recompute"):
                forward = key.replace("recompute", "forward")
                assert getattr(led.ep, key) == getattr(led.ep, forward)
