"""The communication ledger (cluster.comm), the cluster projection (cluster.spec), their
command line, and the worked tables of docs/comm.md."""

import re
import shlex
from pathlib import Path

import pytest
from helpers_cluster import small_config as _small

from smelt_model import budget, cluster, presets
from smelt_model.budget import cli as budget_cli
from smelt_model.cluster import report
from smelt_model.cluster.units import format_time
from smelt_model.config import LoopSpec

DOC = Path(__file__).resolve().parents[2] / "docs" / "comm.md"


# ----------------------------------------------------------------------------- EP bytes
def test_uniform_ep_bytes_by_hand():
    # 8 tokens over 2 ranks: 4 tokens x top-2 = 8 rows per rank, half of them leave it;
    # a row is H = 4 bf16 elements (8 bytes); 2 executed layers
    c = cluster.comm(_small(), 8, ep=2, dp_shard=2)
    per_collective = 2 * 4 * 8
    assert (
        c.ep.dispatch_forward,
        c.ep.combine_forward,
        c.ep.dispatch_backward,
        c.ep.combine_backward,
    ) == (per_collective,) * 4
    assert c.ep.bytes == 4 * per_collective
    assert c.ep.dispatch_by_rank == c.ep.combine_by_rank == (per_collective, per_collective)
    assert c.ep.bytes / c.tokens_per_rank == 256 / 4
    assert c.moe_layers == 2 and c.tokens_per_rank == 4 and c.efsdp == 1
    # fp32 rows are twice as large
    assert cluster.comm(_small(), 8, ep=2, dp_shard=2, dtype="float32").ep.bytes == 512


def test_split_sizes_by_hand():
    """Before each dispatch a rank sends every other EP rank the counts of that rank's
    experts (int64), de-duplicating also the number of rows; one exchange per chunk with
    the overlap, again for a recomputed layer; not part of ep_bytes."""
    cfg = _small()  # 4 experts, 2 executed MoE layers
    stock = cluster.comm(cfg, 8, ep=2, dp_shard=2)
    assert (stock.ep.counts_forward, stock.ep.counts_recompute) == (2 * 1 * 2 * 8, 0)
    assert stock.ep.bytes == 4 * 2 * 4 * 8  # the rows alone
    four = cluster.comm(cfg, 16, ep=4, dp_shard=4)
    assert four.ep.counts_forward == 2 * 3 * 1 * 8
    plan = cluster.parse_plan("ep", cfg, ep=2, overlap=True, chunks=2, recompute="all")
    c = cluster.comm(cfg, 8, dp_shard=2, plan=plan)
    assert c.ep.counts_forward == 2 * 2 * 1 * (2 + 1) * 8
    assert c.ep.counts_recompute == c.ep.counts_forward
    assert cluster.comm(cfg, 8, ep=1, dp_shard=2).ep.counts_forward == 0


def test_uniform_ep_four_ranks():
    # 16 tokens over 4 ranks: 8 rows per rank, 3/4 of them leave it
    c = cluster.comm(_small(), 16, ep=4, dp_shard=4)
    assert c.ep.dispatch_forward == 2 * 6 * 8


def test_ep_one_sends_nothing():
    c = cluster.comm(_small(), 8, ep=1, dp_shard=2)
    assert c.ep.bytes == 0 and c.ep.dispatch_by_rank == c.ep.combine_by_rank == (0,)
    c = cluster.comm(_small(), 8, ep=1, dp_shard=2, routing=[[[3, 1, 2, 2]]] * 2)
    assert c.ep.bytes == 0


def test_skewed_routing_by_hand():
    # experts 0, 1 live on rank 0 and 2, 3 on rank 1
    routing = [
        [
            [5, 1, 2, 0],  # rank 0 sends 2 rows to rank 1
            [3, 3, 0, 2],
        ],  # rank 1 sends 6 rows to rank 0
        [
            [0, 0, 4, 4],  # rank 0 sends all 8 rows away
            [0, 0, 8, 0],
        ],  # rank 1 keeps all of its rows
    ]
    c = cluster.comm(_small(), 8, ep=2, dp_shard=2, routing=routing)
    row = 8
    assert c.ep.dispatch_by_rank == (10 * row, 6 * row)  # layer 0 + layer 1
    assert c.ep.combine_by_rank == (6 * row, 10 * row)  # the rows each rank received back
    # each collective is paced by its busiest rank: max(2, 6) + max(8, 0)
    assert c.ep.dispatch_forward == c.ep.combine_backward == 14 * row
    assert c.ep.combine_forward == c.ep.dispatch_backward == (6 + 8) * row
    # every rank sends in all four all-to-alls what it dispatched and combined: 16 rows each
    assert (
        tuple(2 * (d + b) for d, b in zip(c.ep.dispatch_by_rank, c.ep.combine_by_rank))
        == (2 * 16 * row,) * 2
    )
    assert c.ep.bytes > cluster.comm(_small(), 8, ep=2, dp_shard=2).ep.bytes


def test_routing_edge_cases():
    local = [[[4, 4, 0, 0], [0, 0, 4, 4]]] * 2
    assert cluster.comm(_small(), 8, ep=2, dp_shard=2, routing=local).ep.bytes == 0
    even = [[[2] * 4] * 4] * 2
    assert cluster.comm(_small(), 16, ep=4, dp_shard=4, routing=even) == cluster.comm(
        _small(), 16, ep=4, dp_shard=4
    )
    torch = pytest.importorskip("torch")
    as_tensors = [torch.tensor(m) for m in even]
    assert (
        cluster.comm(_small(), 16, ep=4, dp_shard=4, routing=as_tensors).ep.bytes
        == cluster.comm(_small(), 16, ep=4, dp_shard=4).ep.bytes
    )


@pytest.mark.parametrize(
    "routing,message",
    [
        ("abc", "routing must be a sequence"),
        ([[[4, 4, 0, 0], [0, 0, 4, 4]]], "one matrix per executed EP MoE layer"),
        ([[[4, 4, 0, 0]]] * 2, r"routing\[0\] must be an \(ep, n_experts\)"),
        ([[[4, 4, 0], [0, 4, 4]]] * 2, r"routing\[0\] must be an \(ep, n_experts\)"),
        ([[[4, 4, 0, 0], [0, 0, 4, 4]], [[9, -1, 0, 0], [0, 0, 4, 4]]], r"routing\[1\] .*non-neg"),
        ([[[4, 4, 0, 0], [0, 0, 4, 4.5]]] * 2, "integer counts"),
        ([[[4, 4, 0, 0], [0, 0, 4, 3]]] * 2, r"routing\[0\] row 1 routes 7"),
    ],
)
def test_bad_routing(routing, message):
    with pytest.raises((TypeError, ValueError), match=message):
        cluster.comm(_small(), 8, ep=2, dp_shard=2, routing=routing)


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (dict(cfg="tiny"), TypeError, "cfg must be a ModelConfig"),
        (dict(tokens_per_step=0), ValueError, "tokens_per_step must be >= 1"),
        (dict(tokens_per_step=8.0), TypeError, "tokens_per_step must be an int"),
        (dict(tokens_per_step=9), ValueError, r"tokens_per_step \(9\) must be a multiple of dp"),
        (dict(ep=3, dp_shard=6, tokens_per_step=6), ValueError, r"ep \(3\) must divide n_exp"),
        (dict(gpus_per_node=0), ValueError, "gpus_per_node must be >= 1"),
        (dict(ep=4), ValueError, r"ep \(4\) must divide dp_shard"),
        (dict(ep=True), TypeError, "ep must be an int"),
        (dict(dp_shard=0), ValueError, "dp_shard must be >= 1"),
        (dict(dtype="int8"), ValueError, "dtype must be one of"),
        (dict(reduce_dtype="fp64"), ValueError, "reduce_dtype must be one of"),
        (dict(colour="red"), TypeError, r"unexpected keyword argument\(s\) colour"),
    ],
)
def test_bad_arguments(kwargs, error, message):
    args = dict(cfg=_small(), tokens_per_step=8, ep=2, dp_shard=2) | kwargs
    with pytest.raises(error, match=message):
        cluster.comm(args.pop("cfg"), args.pop("tokens_per_step"), **args)


# ----------------------------------------------------------------------------- FSDP bytes
def test_fsdp_bytes_by_hand():
    # dense parts: attention 128 + router 32 + norms 16 + final norm 4 + embeddings 2*10*4
    # = 260 parameters over dp_shard ranks; experts 192 over efsdp, 1/ep of them per EP rank
    c = cluster.comm(_small(), 8, ep=2, dp_shard=2)  # efsdp 1: experts do not move
    assert c.fsdp.all_gather_forward == 260 / 2 * 2
    # the root (final norm and embeddings) is kept from the forward to the backward
    assert c.fsdp.all_gather_backward == (260 - 84) / 2 * 2
    assert c.fsdp.reduce_scatter == 260 / 2 * 4
    assert c.fsdp.by_part["experts"] == 0 and c.fsdp.by_part["embeddings"] == 40 * (2 + 4)
    assert sum(c.fsdp.by_part.values()) == c.fsdp.bytes
    c = cluster.comm(_small(), 8, ep=2, dp_shard=4)  # efsdp 2
    gathered = 260 * 3 / 4 + 192 / 2 * 1 / 2
    assert c.fsdp.all_gather_forward == gathered * 2
    assert c.fsdp.reduce_scatter == gathered * 4
    kept = cluster.ParallelPlan(("ep", "ep"), ep=2, reshard_after_forward=False)
    c = cluster.comm(_small(), 8, dp_shard=4, plan=kept, reduce_dtype="bfloat16")
    assert c.fsdp.all_gather_backward == 0 and c.fsdp.bytes == gathered * 4
    assert cluster.comm(_small(), 8).fsdp.bytes == 0  # one rank: nothing to gather


def test_span_gathered_once():
    looped = _small(n_layers=4, loop=LoopSpec(start=1, length=2, count=2))
    flat = looped.replace(loop=None)
    a, b = (cluster.comm(c, 64, ep=2, dp_shard=4) for c in (flat, looped))
    assert b.moe_layers == 6 and a.moe_layers == 4
    assert b.fsdp.by_part == a.fsdp.by_part  # the span's weights move once, not per visit
    assert b.ep.bytes == pytest.approx(a.ep.bytes * 6 / 4)


# ----------------------------------------------------------------------------- ratios
@pytest.mark.parametrize(
    "pair,ep_ratio,flops", [("200M-S95", 1.238, 1.029), ("1.6B-S97", 1.203, 1.008)]
)
def test_issue_ratios(pair, ep_ratio, flops):
    base, smelt = presets.pair(pair)
    for ep, dp_shard in ((8, 8), (8, 64), (2, 2)):
        r = cluster.ratios(base, smelt, 32768 * dp_shard, ep=ep, dp_shard=dp_shard)
        assert r.ep == pytest.approx(ep_ratio, abs=5e-4)
        assert r.flops == pytest.approx(flops, abs=5e-4)
        # the hidden size times the executed layers, through the ledger
        lb, ls = budget.ledger(base), budget.ledger(smelt)
        assert r.ep == pytest.approx(
            smelt.hidden_size * ls.executed_layers / (base.hidden_size * lb.executed_layers)
        )
    r = cluster.ratios(base, smelt, 32768, ep=1, dp_shard=1)
    assert r.ep is None and r.fsdp is None and r.total is None
    with pytest.raises(TypeError, match="looped_cfg"):
        cluster.ratios(base, "smelt", 8)


# ----------------------------------------------------------------------------- cluster
def test_parse_cluster():
    assert cluster.parse_cluster("h100-8") == cluster.Cluster()
    c = cluster.parse_cluster("h100-64,ep=16,inter=200Gb/s")
    assert (c.gpus, c.ep, c.inter, c.nodes, c.ep_peers()) == (64, 16, 25e9, 8, (7, 8))
    c = cluster.parse_cluster("gpus=16, intra=0.9TB/s, inter=50GB/s, peak=500, mfu=0.5")
    assert (c.intra, c.inter, c.peak, c.mfu, c.ep) == (0.9e12, 50e9, 500e12, 0.5, 8)
    assert cluster.parse_cluster("inter=400").inter == 50e9  # a bare number is Gb/s
    assert cluster.parse_cluster("memory=141").memory == 141e9  # a bare number is GB
    assert cluster.parse_cluster("memory=64GiB").memory == 64 * 2**30
    assert cluster.parse_cluster(c) is c
    assert cluster.parse_cluster("latency=35").latency == pytest.approx(35e-6)  # bare: us
    assert cluster.parse_cluster("h100-8,latency=0.05ms").latency == pytest.approx(50e-6)
    assert cluster.parse_cluster("latency=0").latency == 0
    assert (
        cluster.Cluster()
        .describe()
        .endswith("EP 8 (in one node), 80 GB per GPU, 20 us per collective")
    )


@pytest.mark.parametrize(
    "spec,message",
    [
        ("", "empty"),
        ("h200-3", "unknown cluster preset 'h200-3'"),
        ("gpus=8,colour=red", "key one of gpus"),
        ("gpus=8,gpus=16", "gives gpus twice"),
        ("gpus=8,", "item ''"),
        ("h100-8,", "item ''"),
        ("gpus=eight", "cluster gpus must be an int"),
        ("inter=fast", "cluster inter must be a number with a unit"),
        ("inter=400Mb/s", "unknown unit 'Mb/s'"),
        ("memory=80MB", "unknown unit 'MB'"),
        ("intra=-5", "cluster intra must lie between 1 GB/s and 100000 GB/s, got -5 GB/s"),
        ("intra=1e-320", "cluster intra must lie between 1 GB/s"),
        ("inter=1e30", "cluster inter must lie between 1 Gb/s and 100000 Gb/s"),
        ("mfu=1.5", "cluster mfu must lie between 0.01 and 1, got 1.5"),
        ("mfu=1e-300", "cluster mfu must lie between 0.01 and 1, got 1e-300"),
        ("peak=inf", "cluster peak must be finite"),
        ("peak=0.001", "cluster peak must lie between 1 TFLOP/s and 100000 TFLOP/s"),
        ("memory=0.5", "cluster memory must lie between 1 GB and 10000 GB"),
        ("memory=nan", "cluster memory must be a number with a unit"),
        ("gpus=12", "must fill whole nodes"),
        ("gpus=8,ep=3", r"cluster ep \(3\) must divide gpus"),
        ("gpus=48,gpus_per_node=8,ep=12", "must divide one another"),
        ("gpus=0", "cluster gpus must lie between 1 and 1000000, got 0"),
        ("gpus_per_node=2048", "cluster gpus_per_node must lie between 1 and 1024"),
        ("latency=-1us", "cluster latency must lie between 0 us and 10000 us, got -1 us"),
        ("latency=1s", "cluster latency must lie between 0 us and 10000 us"),
        ("latency=5ns", "unknown unit 'ns'"),
    ],
)
def test_bad_cluster(spec, message):
    with pytest.raises(ValueError, match=message):
        cluster.parse_cluster(spec)
    with pytest.raises(TypeError, match="cluster spec must be a str"):
        cluster.parse_cluster(8)


def test_every_printed_number_is_finite(capsys):
    # the extremes the ranges allow still give finite times with a few digits
    for spec in ("h100-8,intra=1,inter=1,mfu=0.01,peak=1", "h100-8,intra=1e5,peak=1e5,mfu=1"):
        assert budget_cli.main(["tiny", "--cluster", spec]) == 0
        out = capsys.readouterr().out
        assert "nan" not in out and "inf" not in out
        assert not re.search(r"\d{9,}", out.replace("262144", "").replace("2048", "")), out


# ----------------------------------------------------------------------------- CLI
def test_cli_shows_the_communication_ledger(capsys):
    assert budget_cli.main(["200M-S95"]) == 0
    out = capsys.readouterr().out
    assert "F 1.0288" in out and "ep 8, dp_shard 8" in out
    assert "communication ratios (looped / baseline): EP 1.2375" in out
    assert (
        budget_cli.main(["200M-S95", "--ep", "2", "--dp-shard", "2", "--tokens-per-step", "4096"])
        == 0
    )
    assert "4096 tokens per step (2048 per rank), ep 2" in capsys.readouterr().out
    # a single config whose expert count 8 does not divide: the default EP degree adapts
    assert budget_cli.main(["tiny-baseline", "--dp-shard", "4"]) == 0
    assert "ep 4, dp_shard 4" in capsys.readouterr().out
    # under a plan: the gathered experts get their own row
    assert budget_cli.main(["200M-S95", "--plan", "span-gather"]) == 2  # the baseline has no span
    assert budget_cli.main(["200M-S95", "--plan", "gather"]) == 0
    out = capsys.readouterr().out
    assert "plan gather" in out and "gathered experts" in out


def test_cli_cluster(capsys):
    assert budget_cli.main(["tiny", "--cluster", "h100-8", "--cluster", "gpus=16,ep=16"]) == 0
    out = capsys.readouterr().out
    assert out.count("a model on paper") == 2 and "EP 16 (over 2 nodes)" in out
    assert out.count("gap (step ratio / F ratio") == 2 and "step, torchtitan stock" in out
    assert "tiny-smelt best plan: " in out and "| marks the looped span" in out
    assert "span layers as units" in out
    assert budget_cli.main(["tiny-smelt", "--cluster", "h100-8"]) == 0
    assert "gap" not in capsys.readouterr().out
    assert budget_cli.main(["tiny", "--cluster", "h100-8", "--plan", "ep"]) == 0
    assert "tiny-baseline plan ep: " in capsys.readouterr().out
    # a cluster a model cannot fit is part of the answer, in one line
    assert budget_cli.main(["tiny", "--cluster", "h100-8,memory=1"]) == 0
    out = capsys.readouterr().out
    assert "tiny-smelt: no plan of" in out and "fits 1 GB per GPU" in out
    assert "gathered weights and gradients" in out


def test_a_gap_above_one_is_split_into_compute_and_exposed_traffic():
    """Where the looped step is longer than the F ratio allows, the excess is split into
    compute and exposed traffic (they add up to it, and each is the looped model's part
    less the baseline's times the F ratio), and the line gives the gap left were every
    transfer hidden. 200M-S95 with EP groups of 16: less compute, more exposed traffic."""
    pair = cluster.project_pair(*presets.pair("200M-S95"), "h100-64,ep=16")
    a, b, flops = pair.baseline, pair.looped, pair.flops_ratio
    assert pair.gap() > 1.0
    for p in (a, b):  # a step is its compute and what it waits for
        assert p.step_s == pytest.approx(p.compute_s + p.exposed_s, rel=1e-9)
    compute = b.compute_s - a.compute_s * flops
    traffic = b.exposed_s - a.exposed_s * flops
    assert compute < 0 < traffic
    assert compute + traffic == pytest.approx(b.step_s - a.step_s * flops, rel=1e-9)
    (line,) = [x for x in report.gap_lines("best plan", [a, b], [a, b], flops) if "above" in x]
    assert f"-{format_time(-compute)} from compute, +{format_time(traffic)} from exposed" in line
    assert f"the gap would be {b.compute_s / a.compute_s / flops:.4f};" in line
    assert f"above 1.00 by {pair.gap() - 1:.2%} ({format_time(b.step_s - a.step_s * flops)}" in line


def test_cli_plot(capsys, tmp_path):
    """--plot draws the projected steps: a PNG (or SVG) with every cluster's label, a
    model without a plan as text, and the pair's gap; it names the file it wrote."""
    pytest.importorskip("matplotlib")
    (tmp_path / "plots").mkdir()  # a missing folder is refused, not made
    png = tmp_path / "plots" / "steps.png"
    args = ["tiny", "--cluster", "h100-8", "--cluster", "h100-8,memory=1", "--plot", str(png)]
    assert budget_cli.main(args) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith(f"plot: {png}")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = tmp_path / "steps.svg"
    assert budget_cli.main([*args[:-1], str(svg)]) == 0
    capsys.readouterr()
    text = svg.read_text()
    for label in ("h100-8", "h100-8,memory=1", "baseline", "smelt", "no plan fits", "gap "):
        assert label in text, label


@pytest.mark.parametrize("title", ["tiny", "a_baseline_config_with_a_long_name.json"])
def test_the_plot_title_fits_the_figure(title):
    """One cluster makes a narrow figure: its title is wrapped to fit, whatever its name."""
    pytest.importorskip("matplotlib")
    names, cfgs = ["tiny-baseline", "tiny-smelt"], list(presets.pair("tiny"))
    _, cell = report.format_cluster("h100-8", names, cfgs, None, "auto", cluster.Workload())
    fig = report.draw_steps([cell], title)
    fig.canvas.draw()
    (text,) = [t for t in fig.texts if t.get_text() == fig.get_suptitle()]
    box = text.get_window_extent(fig.canvas.get_renderer())
    assert title in fig.get_suptitle().replace("\n", " ")
    assert 0 <= box.x0 < box.x1 <= fig.bbox.x1 and 0 <= box.y0 < box.y1 <= fig.bbox.y1


@pytest.mark.parametrize(
    "args,message",
    [
        (["tiny", "--cluster", "gpus=8,ep=3"], "cluster ep (3) must divide gpus"),
        (["tiny", "--cluster", "h100-9"], "unknown cluster preset"),
        (["tiny", "--cluster", "h100-8,mfu=0"], "cluster mfu must lie between"),
        (["tiny", "--cluster", "h100-8", "--ep", "4"], "give ep and gpus in the cluster SPEC"),
        (["tiny", "--ep", "0"], "argument --ep: expected a positive int"),
        (["tiny", "--ep", "3"], "ep (3) must divide dp_shard"),
        (["tiny", "--tokens-per-step", "100"], "tokens_per_step (100) must be a multiple"),
        (["tiny", "--dtype", "int8"], "dtype must be one of"),
        (["tiny", "--colour"], "unrecognized arguments: --colour"),
        (["tiny", "--plan", "auto"], "--plan auto chooses a plan for a cluster"),
        (["tiny", "--plan", "ep,gather"], "--plan ep,gather: plan 'ep,gather' has 2 entries"),
        (["200M-S95-smlet"], "unknown pair or preset '200M-S95-smlet' (did you mean"),
        (["tiny", "--plot", "steps.png"], "--plot draws the projected steps: give --cluster"),
        (["tiny", "--cluster", "h100-8", "--plot", "steps.txt"], "--plot"),
    ],
)
def test_cli_errors_are_one_line(capsys, args, message):
    assert budget_cli.main(args) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err.startswith("smelt-budget: error: ")
    assert cap.err.count("\n") == 1 and message in cap.err, cap.err


# ----------------------------------------------------------------------------- the doc
def _doc_commands() -> list[tuple[str, str]]:
    blocks = re.findall(r"```console\n(.*?)```", DOC.read_text(), flags=re.S)
    out = []
    for block in blocks:
        first, _, rest = block.partition("\n")
        assert first.startswith("$ python -m smelt_model.budget "), first
        out.append((first[len("$ python -m smelt_model.budget ") :], rest))
    return out


@pytest.mark.slow
def test_doc_tables_are_the_commands_output(capsys):
    commands = _doc_commands()
    assert len(commands) >= 2
    text = DOC.read_text()
    assert "a model on paper" in text
    outputs = []
    for args, expected in commands:
        assert budget_cli.main(shlex.split(args)) == 0
        outputs.append(capsys.readouterr().out)
        assert outputs[-1] == expected, f"docs/comm.md is stale for: {args}"
    # the ratios the prose quotes come from those outputs
    prose = re.sub(r"```console\n.*?```", "", text, flags=re.S)
    quoted = re.findall(r"\b\d\.\d{4}\b", prose)
    assert quoted and all(q in "".join(outputs) for q in quoted), quoted
