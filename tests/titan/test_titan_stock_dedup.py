"""A stock torchtitan MoE model (qwen3-MoE narrowed to CPU size) with the de-duplicating
dispatcher switched on by ``--override.imports``, on two CPU processes (gloo) with expert
parallelism 2: step 1's batch gives the same loss and gradients with the stock-row
dispatcher on the same model (tests/titan/titan_worker.py --compare-stock-dispatch), the
loss falls, and the dispatcher sends one row per (token, rank) pair."""

import math

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is not installed (extra 'titan')")

# its module-scoped runs take long: scheduled first
pytestmark = pytest.mark.slow

import titan_helpers as th  # noqa: E402

from smelt_model.titan.moe import traffic  # noqa: E402

OVERRIDES = ",".join(
    [
        "smelt_model.titan.moe.experts.smelt_experts",
        "smelt_model.titan.attention.smelt_attention",
        "smelt_model.titan.loader.smelt_data",
        "smelt_model.titan.loader.smelt_tokenizer",
        "smelt_model.titan.moe.dispatch.dedup_all_to_all",
    ]
)
STEPS, E, K = 4, 16, 4  # qwen3_moe_tiny: 16 experts, top-4, 2 layers


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("titan_stock_dedup")
    args = [
        str(th.HERE / "titan_worker.py"),
        str(tmp / "out"),
        "--compare-stock-dispatch",
        "--module",
        "smelt_model.titan.stock",
        "--config",
        "qwen3_moe_tiny",
        "--override.imports",
        OVERRIDES,
        "--parallelism.expert_parallel_degree",
        "2",
        "--training.steps",
        str(STEPS),
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--training.mixed_precision_param",
        "float32",
        "--dataloader.dataset",
        th.SMALL_CORPUS,
        "--debug.seed",
        "0",
        "--dump_folder",
        str(tmp / "dump"),
    ]
    proc = th.launch(args, cwd=tmp, SMELT_TITAN_COMM=tmp / "comm")
    return th.worker_results(proc, tmp)


def test_the_override_reaches_every_layer(run):
    for layer in (0, 1):
        assert (
            f"smelt_model.titan.moe.dispatch.dedup_all_to_all: model_spec.model.layers.{layer}.moe."
            "routed_experts.token_dispatcher AllToAllTokenDispatcher.Config -> "
            "DedupAllToAllTokenDispatcher.Config"
        ) in run["log"]


def test_same_loss_and_gradients_as_the_stock_rows_and_falling_loss(run):
    as_run, stock = run["json"]["compare"]
    assert as_run == pytest.approx(stock, rel=1e-6)
    t = run["tensors"]
    names = [k[len("grad_stock.") :] for k in t if k.startswith("grad_stock.")]
    assert names and all(f"grad_as_run.{n}" in t for n in names)
    for n in names:
        torch.testing.assert_close(
            t[f"grad_as_run.{n}"], t[f"grad_stock.{n}"], rtol=1e-4, atol=1e-7, msg=n
        )
    losses = run["json"]["losses"]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(as_run, rel=1e-6) and losses[-1] < losses[0]


def test_one_row_per_token_and_rank(run):
    """From step 2 on (step 1 also ran the comparison), every dispatch sends the call's
    token_ranks and fewer rows than the (token, slot) rows of the same routing (the
    config's activation checkpointing runs each layer's forward, and its dispatch, twice)."""
    records = traffic.read(run["dir"] / "comm")
    for step in range(2, STEPS + 1):
        stock = dedup = 0
        for r in records:
            calls = {c["call"]: c for c in r["calls"] if c["step"] == step}
            assert len(calls) in (2, 4) and all(c["dedup"] for c in calls.values())
            for ev in r["events"]:
                if ev["step"] == step and (ev["kind"], ev["phase"]) == ("dispatch", "forward"):
                    c = calls[ev["call"]]
                    assert ev["rows_to"] == c["token_ranks"]
                    other = 1 - r["ep_rank"]
                    dedup += ev["rows_to"][other]
                    stock += sum(c["routing"][other * E // 2 : (other + 1) * E // 2])
        assert 0 < dedup < stock
