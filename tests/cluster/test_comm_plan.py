"""Parallel plans in the communication ledger: parse_plan, de-duplicated dispatch (uniform
and realised through token_ranks), gathered experts, recompute, the Workload options and
the short reprs."""

import dataclasses
import math

import pytest
from helpers_cluster import small_config as _small
from helpers_cluster import small_looped as _looped

from smelt_model import budget, cluster, presets


# ----------------------------------------------------------------------------- parse_plan
def test_parse_plan_names_and_lists():
    cfg = _looped()
    assert cluster.parse_plan("ep", cfg, ep=2).layers == ("ep",) * 4
    assert cluster.parse_plan("gather", cfg).gather_layers == (0, 1, 2, 3)
    p = cluster.parse_plan("span-gather", cfg, ep=2)
    assert p.layers == ("ep", "gather", "gather", "ep") and p.letters == "egge"
    assert (p.ep, p.gather_group, p.span_gather, p.dedup, p.overlap, p.chunks) == (
        2,
        "node",
        "unit",
        True,
        True,
        2,
    )
    # what smelt's trainer runs; the dataclass's defaults: span, next
    assert (p.span_units, p.prefetch) == ("layer", "loop")
    assert (cluster.ParallelPlan(p.layers).span_units, cluster.ParallelPlan(p.layers).prefetch) == (
        "span",
        "next",
    )
    assert cluster.parse_plan(p.spec, cfg, ep=2) == p
    assert cluster.parse_plan(" ep, gather ,ep,ep", cfg, ep=2).gather_layers == (1,)
    assert cluster.parse_plan(p, cfg) is p
    assert (
        repr(p) == "ParallelPlan('egge', ep=2, gather=node/unit, span-units=layer, dedup, "
        "overlap, prefetch=loop)"
    )
    q = cluster.parse_plan(
        "ep",
        cfg,
        ep=4,
        dedup=False,
        overlap=False,
        recompute="all-but-2",
        span_units="span",
        prefetch="next",
    )
    assert repr(q) == "ParallelPlan('eeee', ep=4, gather=node/unit, recompute=all-but-2)"
    r = cluster.parse_plan("ep", cfg, ep=4, span_units="span", chunks=4, prefetch="next")
    assert repr(r) == "ParallelPlan('eeee', ep=4, gather=node/unit, dedup, overlap, chunks=4)"


@pytest.mark.parametrize(
    "spec,kwargs,error,message",
    [
        ("diagonal", {}, ValueError, "unknown plan 'diagonal'"),
        ("ep,gather", {}, ValueError, "has 2 entries; the model has 4"),
        ("ep,ep,ep,fast", {}, ValueError, r"layers\[3\] must be 'ep' or 'gather'"),
        ("ep", dict(ep=3), ValueError, r"plan ep \(3\) must divide n_experts"),
        ("ep", dict(ep=0), ValueError, "ep must be >= 1"),
        ("ep", dict(gather_group="rack"), ValueError, "gather_group must be one of node, all"),
        ("ep", dict(span_gather="half"), ValueError, "span_gather must be one of unit, layer"),
        ("ep", dict(span_units="unit"), ValueError, "span_units must be one of span, layer"),
        ("ep", dict(chunks=1), ValueError, "chunks must be >= 2"),
        ("ep", dict(chunks=2.0), TypeError, "chunks must be an int"),
        ("ep", dict(recompute="some"), ValueError, "recompute must be one of none"),
        ("ep", dict(recompute="all-but-0"), ValueError, r"or all-but-N \(N >= 1"),
        ("ep", dict(recompute="all-but-07"), ValueError, "got 'all-but-07'"),
        ("ep", dict(recompute="all-but-6"), ValueError, "keeps 6 of the 6 executed layers"),
        ("ep", dict(recompute=None), TypeError, "recompute must be a string"),
        ("ep", dict(prefetch="early"), ValueError, "prefetch must be one of next, loop"),
        ("ep", dict(dedup=1), TypeError, "dedup must be a bool"),
        (3, {}, TypeError, "plan spec must be a str"),
    ],
)
def test_parse_plan_errors(spec, kwargs, error, message):
    with pytest.raises(error, match=message):
        cluster.parse_plan(spec, _looped(), **kwargs)


def test_span_gather_needs_a_loop_and_plans_fit_their_model():
    with pytest.raises(ValueError, match="needs a looped model"):
        cluster.parse_plan("span-gather", _small())
    plan = cluster.parse_plan("ep", _looped(), ep=2)
    with pytest.raises(ValueError, match="plan has 4 layer entries; the model has 2"):
        cluster.comm(_small(), 8, dp_shard=2, plan=plan)
    with pytest.raises(TypeError, match="layers must be a non-empty tuple"):
        cluster.ParallelPlan(layers="ep")


# ----------------------------------------------------------------------------- EP rows
def test_all_ep_without_dedup_is_the_stock_count():
    cfg = _looped()
    stock = cluster.comm(cfg, 16, ep=2, dp_shard=2)
    plan = cluster.parse_plan("ep", cfg, ep=2, dedup=False, overlap=True)
    c = cluster.comm(cfg, 16, dp_shard=2, plan=plan)
    assert c.ep.bytes == stock.ep.bytes and c.fsdp.bytes == stock.fsdp.bytes
    assert c.gather.bytes == 0 and c.ep.layers == 6 and c.plan is plan
    with pytest.raises(ValueError, match=r"ep \(4\) differs from the plan's ep \(2\)"):
        cluster.comm(cfg, 16, ep=4, dp_shard=4, plan=plan)
    with pytest.raises(TypeError, match="plan must be a ParallelPlan"):
        cluster.comm(cfg, 16, ep=2, dp_shard=2, plan="ep")


def test_dedup_factor():
    # E 4, k 2, ep 2: a token misses a rank with probability C(2, 2) / C(4, 2) = 1/6
    assert cluster.dedup_factor(4, 2, 2) == pytest.approx(2 * (5 / 6) / 2)
    assert cluster.dedup_factor(192, 8, 8) == pytest.approx(0.66, abs=0.005)
    assert cluster.dedup_factor(288, 8, 8) == pytest.approx(0.66, abs=0.005)
    assert cluster.dedup_factor(288, 8, 16) == pytest.approx(0.82, abs=0.01)


def test_uniform_dedup_by_hand():
    cfg = _small()
    plan = cluster.parse_plan("ep", cfg, ep=2)
    c = cluster.comm(cfg, 8, dp_shard=2, plan=plan)
    # 4 tokens per rank, each reaches the other rank with probability 5/6; 2 layers
    per_collective = 2 * 4 * (5 / 6) * 8
    assert c.ep.dispatch_forward == pytest.approx(per_collective)
    assert (
        c.ep.combine_forward
        == c.ep.dispatch_backward
        == c.ep.combine_backward
        == c.ep.dispatch_forward
    )
    stock = cluster.comm(cfg, 8, ep=2, dp_shard=2)
    # each de-duplicated row carries its 2 slots: an int32 id and an fp32 score each, and
    # the scores' gradients come back
    rows = per_collective / 8
    assert (c.ep.slots_forward, c.ep.slots_backward) == pytest.approx((rows * 16, rows * 8))
    assert stock.ep.slots_forward == stock.ep.slots_backward == 0
    moved = c.ep.bytes - c.ep.slots_forward - c.ep.slots_backward
    assert moved / stock.ep.bytes == pytest.approx(cluster.dedup_factor(4, 2, 2))


def test_token_ranks_by_hand():
    cfg = _small()
    plan = cluster.parse_plan("ep", cfg, ep=2)
    # layer 0: rank 0's 4 tokens: 3 stay, 3 reach rank 1; rank 1's: 2 reach rank 0, 4 stay
    # layer 1: everything stays home
    token_ranks = [[[3, 3], [2, 4]], [[4, 0], [0, 4]]]
    c = cluster.comm(cfg, 8, dp_shard=2, plan=plan, token_ranks=token_ranks)
    row = 8
    assert c.ep.dispatch_by_rank == (3 * row, 2 * row)
    assert c.ep.combine_by_rank == (2 * row, 3 * row)
    assert c.ep.dispatch_forward == c.ep.combine_backward == 3 * row
    assert c.ep.combine_forward == c.ep.dispatch_backward == 3 * row
    assert c.ep.slots_by_rank == (3 * 16, 2 * 16) and c.ep.slots_forward == 3 * 16
    # the scores' gradients go back from the rank that received the rows
    assert c.ep.slots_back_by_rank == (2 * 8, 3 * 8) and c.ep.slots_backward == 3 * 8
    # what each rank sends in all: its rows in the four all-to-alls, its slots and gradients
    sent = [
        2 * (d + b) + s + g
        for d, b, s, g in zip(
            c.ep.dispatch_by_rank,
            c.ep.combine_by_rank,
            c.ep.slots_by_rank,
            c.ep.slots_back_by_rank,
        )
    ]
    assert sent == [2 * 5 * row + 3 * 16 + 2 * 8, 2 * 5 * row + 2 * 16 + 3 * 8]
    # with routing beside it, the two must agree: experts 0, 1 on rank 0, 2, 3 on rank 1
    routing = [[[3, 1, 2, 2], [2, 0, 3, 3]], [[4, 4, 0, 0], [0, 0, 4, 4]]]
    assert (
        cluster.comm(cfg, 8, dp_shard=2, plan=plan, token_ranks=token_ranks, routing=routing) == c
    )
    bad = [[[3, 1, 4, 0], [2, 0, 3, 3]], routing[1]]  # 4 slots to rank 1 from 3 tokens: fine
    cluster.comm(cfg, 8, dp_shard=2, plan=plan, token_ranks=token_ranks, routing=bad)
    bad = [[[4, 2, 1, 1], [2, 0, 3, 3]], routing[1]]  # 2 slots cannot come from 3 tokens
    with pytest.raises(ValueError, match=r"token_ranks\[0\]\[0\]\[1\] = 3 tokens cannot carry"):
        cluster.comm(cfg, 8, dp_shard=2, plan=plan, token_ranks=token_ranks, routing=bad)


@pytest.mark.parametrize(
    "token_ranks,message",
    [
        ([[[3, 3], [2, 4]]], "one matrix per executed EP MoE layer"),
        ([[[3, 3, 0], [2, 4, 0]]] * 2, r"token_ranks\[0\] must be an \(ep, ep\)"),
        ([[[3, math.inf], [2, 4]]] * 2, "non-negative integer counts, got inf"),
        ([[[3, math.nan], [2, 4]]] * 2, "non-negative integer counts, got nan"),
        ([[[3, 1e300], [2, 4]]] * 2, "more than the 4 a rank can have"),
        ([[[1, 2], [2, 4]]] * 2, r"row 0 sums to 3; each of the rank's 4 tokens"),
        ([[[4, 4], [4, 4]], [[4, 4], [4, 5]]], "more than the 4"),
    ],
)
def test_bad_token_ranks(token_ranks, message):
    plan = cluster.parse_plan("ep", _small(), ep=2)
    with pytest.raises(ValueError, match=message):
        cluster.comm(_small(), 8, dp_shard=2, plan=plan, token_ranks=token_ranks)


def test_counts_must_match_the_dispatcher():
    cfg = _small()
    dedup = cluster.parse_plan("ep", cfg, ep=2)
    routing = [[[4, 4, 0, 0], [0, 0, 4, 4]]] * 2
    with pytest.raises(ValueError, match="come from token_ranks"):
        cluster.comm(cfg, 8, dp_shard=2, plan=dedup, routing=routing)
    with pytest.raises(ValueError, match="token_ranks counts de-duplicated rows"):
        cluster.comm(cfg, 8, ep=2, dp_shard=2, token_ranks=[[[4, 0], [0, 4]]] * 2)


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 1e300, 2**70])
def test_routing_with_non_finite_or_huge_counts_is_a_value_error(value):
    routing = [[[4, 4, 0, 0], [0, 0, 4, value]]] * 2
    with pytest.raises(ValueError, match=r"routing\[0\]"):
        cluster.comm(_small(), 8, ep=2, dp_shard=2, routing=routing)


def test_only_ep_layers_are_counted():
    cfg = _looped()
    plan = cluster.parse_plan("span-gather", cfg, ep=2, dedup=False)
    c = cluster.comm(cfg, 16, dp_shard=2, plan=plan)
    stock = cluster.comm(cfg, 16, ep=2, dp_shard=2)
    assert c.ep.layers == 2 and c.moe_layers == 6
    assert c.ep.bytes == pytest.approx(stock.ep.bytes * 2 / 6)
    # routing then holds one matrix per executed ep layer (layers 0 and 3)
    local = [[[8, 8, 0, 0], [0, 0, 8, 8]]] * 2
    assert cluster.comm(cfg, 16, dp_shard=2, plan=plan, routing=local).ep.bytes == 0
    with pytest.raises(ValueError, match=r"one matrix per executed EP MoE layer \(2\), got 6"):
        cluster.comm(cfg, 16, dp_shard=2, plan=plan, routing=local * 3)


def test_recompute_repeats_the_forward_all_to_alls():
    cfg = _looped()
    for policy, slots in (("all", 6), ("visit1", 2), ("none", 0), ("all-but-5", 1)):
        plan = cluster.parse_plan("ep", cfg, ep=2, dedup=False, recompute=policy)
        c = cluster.comm(cfg, 16, dp_shard=2, plan=plan)
        assert c.ep.dispatch_recompute == pytest.approx(c.ep.dispatch_forward * slots / 6)
        assert c.ep.combine_recompute == pytest.approx(c.ep.combine_forward * slots / 6)
        forward = c.ep.dispatch_forward + c.ep.combine_forward
        assert c.ep.bytes == pytest.approx(forward * (2 + slots / 6))


# ----------------------------------------------------------------------------- gathered
def test_gathered_experts_by_hand():
    cfg = _small()
    plan = cluster.parse_plan("gather", cfg, ep=2)
    c = cluster.comm(cfg, 8, dp_shard=4, gpus_per_node=2, plan=plan)
    # two nodes of two: experts (96 per layer, 2 layers) sharded over a node, 2 replicas
    assert (c.gather.group_size, c.gather.replicas) == (2, 2)
    assert c.gather.all_gather_forward == c.gather.all_gather_backward == 2 * 96 / 2 * 2
    assert c.gather.reduce_scatter == 2 * 96 / 2 * 4
    assert c.gather.all_reduce == 2 * 2 * (1 / 2) * (96 / 2) * 4
    assert c.ep.bytes == 0 and c.fsdp.by_part["experts"] == 0
    assert c.total_bytes == c.fsdp.bytes + c.gather.bytes
    every = cluster.comm(
        cfg,
        8,
        dp_shard=4,
        gpus_per_node=2,
        plan=cluster.parse_plan("gather", cfg, ep=2, gather_group="all"),
    )
    assert (every.gather.group_size, every.gather.replicas, every.gather.all_reduce) == (4, 1, 0)
    assert every.gather.reduce_scatter == 2 * 96 * 3 / 4 * 4
    # no re-gather before the backward without resharding
    keep = dataclasses.replace(plan, reshard_after_forward=False)
    kept = cluster.comm(cfg, 8, dp_shard=4, plan=keep)
    assert kept.gather.all_gather_backward == 0 and kept.gather.group_size == 4
    assert kept.fsdp.all_gather_backward == 0
    with pytest.raises(ValueError, match=r"gpus_per_node \(3\) must divide dp_shard \(4\)"):
        cluster.comm(cfg, 8, dp_shard=4, gpus_per_node=3, plan=plan)


def test_span_gathered_as_a_unit_or_layer_by_layer():
    cfg = _looped()
    unit = cluster.parse_plan("span-gather", cfg, ep=2)
    layer = cluster.parse_plan("span-gather", cfg, ep=2, span_gather="layer")
    a = cluster.comm(cfg, 16, dp_shard=4, plan=unit)
    b = cluster.comm(cfg, 16, dp_shard=4, plan=layer)
    # two span layers of 96 expert parameters over a group of 4: gathered once per step
    # with their unit, once per visit (twice) each way on their own; reduced once either way
    # (FSDP2 reduces a unit run twice after its first visit's backward)
    assert a.gather.all_gather_forward == 2 * 96 * 3 / 4 * 2
    assert b.gather.all_gather_forward == 2 * a.gather.all_gather_forward
    assert b.gather.all_gather_backward == 2 * a.gather.all_gather_backward
    assert b.gather.reduce_scatter == a.gather.reduce_scatter
    assert a.ep.bytes == b.ep.bytes and a.fsdp.bytes == b.fsdp.bytes
    # without resharding a unit keeps them for the backward; their own unit still gathers
    keep = dict(reshard_after_forward=False)
    a2 = cluster.comm(cfg, 16, dp_shard=4, plan=dataclasses.replace(unit, **keep))
    b2 = cluster.comm(cfg, 16, dp_shard=4, plan=dataclasses.replace(layer, **keep))
    assert a2.gather.all_gather_backward == 0 and b2.gather.bytes == b.gather.bytes
    # the span's FSDP units (one, or one per layer) move the same bytes
    span = cluster.comm(cfg, 16, dp_shard=4, plan=dataclasses.replace(unit, span_units="span"))
    assert (span.fsdp.bytes, span.gather.bytes) == (a.fsdp.bytes, a.gather.bytes)
    # the experts of the gathered layers left the efsdp FSDP axis
    stock = cluster.comm(cfg, 16, ep=2, dp_shard=4)
    assert a.fsdp.by_part["experts"] == pytest.approx(stock.fsdp.by_part["experts"] / 2)


# ----------------------------------------------------------------------------- options, reprs
def test_workload_options_have_one_home():
    cfg = _small()
    w = cluster.Workload(dtype="float32", reduce_dtype="bfloat16")
    assert cluster.comm(cfg, 8, ep=2, dp_shard=2, workload=w) == cluster.comm(
        cfg, 8, ep=2, dp_shard=2, dtype="float32", reduce_dtype="bfloat16"
    )
    # keywords refine a given workload
    assert cluster.comm(cfg, 8, ep=2, dp_shard=2, workload=w, dtype="bfloat16").dtype == "bfloat16"
    with pytest.raises(TypeError, match=r"comm\(\) got unexpected keyword argument\(s\) colour"):
        cluster.comm(cfg, 8, colour="red")
    with pytest.raises(TypeError, match="workload must be a Workload"):
        cluster.comm(cfg, 8, workload={"dtype": "float32"})
    with pytest.raises(ValueError, match="mean_doc_len"):
        cluster.Workload(mean_doc_len=0)
    with pytest.raises(TypeError, match="head must be a bool"):
        cluster.Workload(head=1)
    with pytest.raises(ValueError, match="experts must be one of smelt, stock"):
        cluster.Workload(experts="torch")
    # FSDP's resharding is the plan's choice, not the workload's
    with pytest.raises(TypeError, match="reshard_after_forward"):
        cluster.comm(cfg, 8, reshard_after_forward=False)


def test_reprs_are_short():
    base, smelt = presets.pair("200M-S95")
    assert repr(budget.compare(base, smelt)) == "Ratios(flops=1.029, params=1.004, kv=1.031)"
    r = cluster.ratios(base, smelt, 262144, ep=8, dp_shard=8)
    assert repr(r) == "CommRatios(ep=1.238, fsdp=0.7676, total=1.225, flops=1.029)"
    c = cluster.comm(smelt, 262144, ep=8, dp_shard=8)
    assert repr(c).startswith("Comm(ep 34.88 GB, fsdp 607.63 MB, gather 0 B per rank and step")
    assert len(repr(c)) < 200
    plan = cluster.parse_plan("span-gather", smelt, ep=8)
    assert len(repr(cluster.comm(smelt, 262144, dp_shard=8, plan=plan))) < 300
