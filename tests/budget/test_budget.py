"""The ledger reproduces the paper's appendix; the matcher finds matched looped configs."""

import json

import pytest

from smelt_model import budget, presets
from smelt_model.budget import cli as budget_cli
from smelt_model.config import LoopSpec, ModelConfig

# The paper's appendix: (scale, S) -> active B (base, smelt), total B (base, smelt),
# F ratio, KV ratio
PAPER = {
    ("100M", 85): ((0.100, 0.067), (0.71, 0.71), 1.024, 0.964),
    ("100M", 95): ((0.101, 0.069), (2.12, 2.12), 1.031, 0.964),
    ("100M", 97): ((0.102, 0.070), (3.70, 3.70), 1.039, 0.964),
    ("200M", 85): ((0.207, 0.140), (1.32, 1.32), 1.021, 1.031),
    ("200M", 95): ((0.209, 0.142), (3.87, 3.89), 1.029, 1.031),
    ("200M", 97): ((0.212, 0.145), (6.74, 6.78), 1.037, 1.031),
    ("600M", 85): ((0.665, 0.443), (4.28, 4.31), 1.007, 1.031),
    ("600M", 95): ((0.670, 0.453), (12.54, 12.44), 1.024, 0.984),
    ("600M", 97): ((0.675, 0.459), (21.83, 21.70), 1.031, 0.984),
    ("1.6B", 85): ((1.632, 1.081), (10.55, 10.45), 1.000, 0.984),
    ("1.6B", 95): ((1.641, 1.091), (30.94, 30.90), 1.004, 0.984),
    ("1.6B", 97): ((1.651, 1.103), (53.89, 53.90), 1.008, 0.984),
}


@pytest.mark.parametrize("cell", sorted(PAPER))
def test_ledger_reproduces_paper_appendix(cell):
    scale, s = cell
    (act_b, act_s), (tot_b, tot_s), f_ratio, kv_ratio = PAPER[cell]
    base, smelt = presets.pair(f"{scale}-S{s}")
    lb, ls = budget.ledger(base), budget.ledger(smelt)
    assert lb.active_params / 1e9 == pytest.approx(act_b, rel=0.01)
    assert ls.active_params / 1e9 == pytest.approx(act_s, rel=0.01)
    assert lb.total_params / 1e9 == pytest.approx(tot_b, rel=0.01)
    assert ls.total_params / 1e9 == pytest.approx(tot_s, rel=0.01)
    r = budget.compare(base, smelt)
    assert abs(r.flops - f_ratio) <= 0.005
    assert abs(r.kv - kv_ratio) <= 0.005
    assert r.within((0.04, 0.01, 0.04))
    assert lb.executed_layers == base.n_layers
    assert ls.executed_layers == smelt.n_layers * 3 // 2


def test_worked_example_200m_s95():
    base, smelt = presets.pair("200M-S95")
    lb, ls = budget.ledger(base), budget.ledger(smelt)
    assert lb.flops_per_token == pytest.approx(1.33e9, rel=0.005)
    assert ls.flops_per_token == pytest.approx(1.37e9, rel=0.005)
    assert lb.kv_bytes_per_token == 2 * 12 * 2 * 128 * 2
    assert ls.kv_bytes_per_token == 2 * 18 * 2 * 88 * 2
    # S is about 95%: the preset name's sparsity
    assert lb.sparsity == pytest.approx(0.95, abs=0.01)


def test_ledger_formulas_by_hand():
    cfg = ModelConfig(
        vocab_size=10,
        hidden_size=16,
        n_layers=3,
        n_heads=2,
        n_kv_heads=1,
        head_dim=8,
        n_experts=4,
        expert_size=6,
        top_k=2,
        loop=LoopSpec(1, 1, 3),
    )
    H = 16
    attn = 2 * H * 16 + 2 * H * 8
    shared = attn + H * 4 + 2 * H
    act_layer = shared + 2 * 3 * H * 6
    tot_layer = shared + 4 * 3 * H * 6
    led = budget.ledger(cfg, mean_doc_len=4, seq_len=10)
    # two 4-token documents (10 keys) and a 2-token remainder (3 keys): c_bar = 23 / 10
    assert led.mean_attended == pytest.approx(23 / 10)
    assert led.active_params == 3 * act_layer + H
    assert led.total_params == 3 * tot_layer + H
    assert led.executed_layers == 5
    assert led.flops_per_token == pytest.approx(6 * (5 * act_layer + H) + 12 * 5 * 16 * 2.3)
    assert led.kv_bytes_per_token == 2 * 5 * 8 * 2


def test_mean_attended():
    assert budget.mean_attended(1, 7) == 1.0
    assert budget.mean_attended(10_000, 4) == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert budget.mean_attended(800, 4096) == pytest.approx(392.2, abs=0.1)
    with pytest.raises(ValueError, match="mean_doc_len"):
        budget.mean_attended(0, 10)


def test_sparsity_against_a_given_control():
    base = presets.get("200M-S95-baseline")
    dense = base.replace(n_experts=8)
    assert budget.ledger(dense).sparsity == pytest.approx(0.0, abs=1e-12)
    assert budget.ledger(base, control=dense).sparsity == pytest.approx(
        budget.ledger(base).sparsity
    )


def test_tiny_pair_is_matched_and_shaped_like_the_paper():
    base, smelt = presets.pair("tiny")
    assert budget.compare(base, smelt).within((0.04, 0.01, 0.04))
    assert smelt.hidden_size < base.hidden_size and smelt.head_dim < base.head_dim
    assert smelt.n_experts > base.n_experts and smelt.top_k == base.top_k == 8
    assert smelt.loop.length == base.n_layers // 2 and smelt.loop.count == 2
    # the preset is exactly what the matcher finds
    found, _ = budget.match(base)
    assert found == smelt


def test_matcher_on_a_baseline_not_in_the_paper():
    base = ModelConfig(
        vocab_size=32768,
        hidden_size=1536,
        n_layers=16,
        n_heads=12,
        n_kv_heads=2,
        head_dim=128,
        n_experts=192,
        expert_size=512,
    )
    cfg, ratios = budget.match(base)
    assert ratios.within((0.04, 0.01, 0.04))
    assert ratios == budget.compare(base, cfg)
    assert cfg.loop.one_based() == (5, 12) and cfg.loop.count == 2
    assert cfg.n_layers == 16 and cfg.top_k == 8
    assert cfg.head_dim % 8 == 0 and cfg.expert_size % 8 == 0 and cfg.n_experts % 8 == 0
    assert cfg.hidden_size == cfg.n_heads * cfg.head_dim


def test_matcher_recovers_a_paper_cell():
    cfg, ratios = budget.match(presets.get("100M-S95-baseline"))
    assert cfg == presets.get("100M-S95-smelt")


def test_matcher_errors():
    base = presets.get("tiny-baseline")
    with pytest.raises(budget.MatchError, match="no looped config"):
        budget.match(base, tolerances=(1e-6, 1e-6, 1e-6))
    with pytest.raises(ValueError, match="already looped"):
        budget.match(presets.get("tiny-smelt"))
    with pytest.raises(ValueError, match="tolerances"):
        budget.match(base, tolerances=(0.1, 0.1))


def test_cli_pair(capsys):
    assert budget_cli.main(["200M-S95"]) == 0
    out = capsys.readouterr().out
    assert "F 1.0288" in out and "KV 1.0312" in out


def test_cli_match(capsys, tmp_path):
    path = tmp_path / "b.json"
    presets.get("tiny-baseline").to_json(path)
    assert budget_cli.main([str(path), "--match"]) == 0
    out = capsys.readouterr().out
    assert "matched config (JSON)" in out
    assert (
        budget_cli.main(["tiny-baseline", "--match", "--tolerances", "1e-6", "1e-6", "1e-6"]) == 1
    )


def _run_cli(*args):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    return subprocess.run(
        [sys.executable, "-m", "smelt_model.budget", *args],
        capture_output=True,
        text=True,
        cwd=root,
    )


def test_cli_as_a_module_prints_no_runpy_warning():
    out = _run_cli("tiny")
    assert out.returncode == 0, out.stderr
    assert "RuntimeWarning" not in out.stderr and out.stderr == ""
    assert "ratios (looped / baseline)" in out.stdout


@pytest.mark.parametrize(
    "text,message",
    [
        ('{"vocab_size": 8,', "malformed JSON"),
        ('{"vocab_size": 8}', "missing ModelConfig field(s): hidden_size"),
        (None, "unknown ModelConfig field(s): colour"),
        (None, "already looped"),
        (None, "no such config file"),
        ("[1, 2]", "expected a dict"),
        (None, "unknown loop field(s): stride"),
    ],
    ids=[
        "malformed",
        "incomplete",
        "unknown-field",
        "looped-to-match",
        "missing-file",
        "not-an-object",
        "bad-loop",
    ],
)
def test_cli_bad_configs_exit_with_one_line(tmp_path, capsys, text, message):
    path = tmp_path / "c.json"
    base = presets.get("tiny-baseline").to_dict()
    if message.startswith("unknown ModelConfig"):
        text = json.dumps({**base, "colour": "blue"})
    elif message == "already looped":
        text = presets.get("tiny-smelt").to_json()
    elif message.startswith("unknown loop"):
        text = json.dumps({**base, "loop": {"start": 1, "length": 2, "stride": 1}})
    if text is not None:
        path.write_text(text)
    args = [str(path if text is not None else tmp_path / "absent.json"), "--match"]
    assert budget_cli.main(args) == 1  # a file the user gave that cannot be used
    err = capsys.readouterr().err
    assert message in err and err.startswith("smelt-budget: error: ")
    assert err.count("\n") == 1, err


def test_cli_match_error_options_exist(capsys):
    args = [
        "tiny-baseline",
        "--match",
        "--tolerances",
        "1e-6",
        "1e-6",
        "1e-6",
        "--head-dim-multiple",
        "4",
        "--expert-size-multiple",
        "4",
        "--kv-heads",
        "1",
        "2",
    ]
    assert budget_cli.main(args) == 1
    err = capsys.readouterr().err
    for option in ("--tolerances", "--head-dim-multiple", "--expert-size-multiple", "--kv-heads"):
        assert option in err


@pytest.mark.parametrize("name", ["200m-s95", "TINY", "Tiny-Smelt"])
def test_cli_takes_preset_names_in_any_case(name, capsys):
    assert budget_cli.main([name]) == 0
    out = capsys.readouterr().out
    canonical = presets.resolve(name)
    assert all(f"{n}: " in out for n in canonical)  # the columns spelt as the presets are
    assert out.startswith(f"{'':19}  {canonical[0]:>18}") or len(canonical) == 1


def test_cli_match_says_why_it_differs_from_the_preset(capsys):
    assert budget_cli.main(["200M-S95-baseline", "--match"]) == 0
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("matched-smelt differs")]
    assert "the preset 200M-S95-smelt (H=1056" in line
    assert "within the tolerances (F 0.04, N 0.01, KV 0.04)" in line
    assert "both have the worst mismatch 0.0312" in line
    assert "prefers the wider hidden size (H 1232 against 1056)" in line
    # a params tolerance of 0.0042 keeps the match (N 1.0038) and leaves out the preset (1.0043)
    args = ["200M-S95-baseline", "--match", "--tolerances", "0.04", "0.0042", "0.04"]
    assert budget_cli.main(args) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if "differs" in x]
    assert line.endswith("the preset lies outside these tolerances")
    assert budget_cli.main(["tiny-baseline", "--match"]) == 0  # the match is the preset
    assert "differs" not in capsys.readouterr().out


def test_cli_tokens_the_cluster_cannot_share_are_refused_first(capsys):
    assert budget_cli.main(["tiny", "--tokens-per-step", "12", "--cluster", "h100-8"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert "--tokens-per-step (12) must be a multiple of the 8 GPUs of --cluster h100-8" in line


@pytest.mark.parametrize(
    "where, message",
    [
        ("/proc/x.png", "the folder /proc is not writable"),
        ("{tmp}/file/x.png", "is not a folder"),
        ("{tmp}/missing/x.png", "no folder"),
    ],
)
def test_cli_plot_path_is_tried_before_any_work(where, message, tmp_path, capsys):
    """Writing is tried (root may write almost anywhere, but not in /proc), and a missing
    folder is refused, not made."""
    (tmp_path / "file").write_text("")
    path = where.format(tmp=tmp_path)
    assert budget_cli.main(["tiny", "--cluster", "h100-8", "--plot", path]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and message in captured.err and len(captured.err.splitlines()) == 1
    assert not (tmp_path / "missing").exists()
