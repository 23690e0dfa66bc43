"""The main job's FLOPs and bytes are the ledger's: the account's parts, calls and decode
reads."""

import pytest
from lvb import account, accounting
from lvb.workload import Workload

from smelt_model import budget, presets

WL = Workload(
    batch=2, seq_len=64, mean_doc_len=40.0, decode_prompt=8, decode_steps=2, decode_batches=(1, 8)
)


@pytest.mark.parametrize("name", ["tiny", "100M-S85"])
@pytest.mark.parametrize("arch", [0, 1])
def test_the_accounts_parts_cover_the_ledgers_step(name, arch):
    cfg = presets.pair(name)[arch]
    led = budget.ledger(cfg, WL.mean_doc_len, WL.seq_len)
    by = led.flops_by_part
    for train, per_token in ((True, led.flops_per_token), (False, led.forward_flops_per_token)):
        parts = accounting.part_flops(led, WL.tokens, train)
        step = accounting.flops_for("train" if train else "prefill", led, cfg, WL)
        assert step == pytest.approx(per_token * WL.tokens)
        share = per_token / led.flops_per_token
        # every ledger FLOP of the step, each ledger part in exactly one part of the account
        assert list(parts) == list(account.PARTS)
        assert sum(parts.values()) == pytest.approx(step)
        assert parts["attention"] == pytest.approx(share * WL.tokens * by["attention_scores"])
        assert parts["projections"] == pytest.approx(share * WL.tokens * by["attention"])
        assert parts["moe"] == pytest.approx(share * WL.tokens * by["experts"])
        assert parts["head"] == parts["optimizer"] == parts["rest"] == 0


def test_decode_flops_and_bytes_read_the_ledger():
    cfg = presets.pair("tiny")[1]
    led = budget.ledger(cfg, kv_dtype_bytes=4)
    assert accounting.flops_for("decode", led, cfg, WL, ctx=100, batch=8) == pytest.approx(
        8 * budget.decode_flops_per_token(cfg, 100)
    )
    with pytest.raises(ValueError, match="mode"):
        accounting.flops_for("sideways", led, cfg, WL)
    # the KV cache: the ledger's bytes per token, per cached position and sequence
    step = accounting.decode_bytes(cfg, led, 8, 101, 4) - accounting.decode_bytes(
        cfg, led, 8, 100, 4
    )
    assert step == pytest.approx(8 * led.kv_bytes_per_token)
    # a batch that selects every expert reads every executed layer's whole weights
    parts = led.params_by_part
    E, H = cfg.n_experts, cfg.hidden_size
    big = 100_000
    assert accounting.distinct_experts(E, cfg.top_k, big) == pytest.approx(E)
    assert accounting.distinct_experts(E, cfg.top_k, 1) == pytest.approx(cfg.top_k)
    layers = sum(v for k, v in parts.items() if k != "final_norm")
    want = (
        led.executed_layers * layers / cfg.n_layers
        + parts["final_norm"]
        + cfg.vocab_size * H
        + big * H
    ) * 4
    assert accounting.decode_bytes(cfg, led, big, 0, 4) == pytest.approx(want)
