"""The main job's account of a step: which module of a SmeltLM is which part, the GEMMs each
part runs (their FLOPs are the ledger's), and the host's GEMM times and ceiling."""

import pytest
import torch
from lvb import account, accounting

from smelt_kernels.layers import MoE, RMSNorm, SegmentAttention
from smelt_model import budget, presets
from smelt_model.model import SmeltLM


@pytest.mark.parametrize("arch", [0, 1])
def test_every_module_with_a_part_of_its_own_is_scoped(arch):
    model = SmeltLM(presets.pair("tiny")[arch])
    sc = account.scopes(model)
    assert sc[model] == "head" and sc[model.lm_head] == "head" and sc[model.embed] == "rest"
    attn = [m for m in model.modules() if isinstance(m, SegmentAttention)]
    assert len(attn) == model.cfg.n_layers  # the span's layers once: each visit runs them
    for m in attn:
        assert sc[m] == "attention"
        assert {sc[p] for p in (m.q_proj, m.k_proj, m.v_proj, m.o_proj)} == {"projections"}
    assert all(sc[m] == "norms" for m in model.modules() if isinstance(m, RMSNorm))
    assert all(sc[m] == "routing" for m in model.modules() if isinstance(m, MoE))
    assert set(sc.values()) <= set(account.PARTS)


@pytest.mark.parametrize("arch", [0, 1])
@pytest.mark.parametrize("train", [True, False])
def test_the_parts_gemms_are_the_ledgers_flops(arch, train):
    cfg = presets.pair("tiny")[arch]
    tokens = 4096
    led = budget.ledger(cfg, 800, 2048)
    want = accounting.part_flops(led, tokens, train)
    shapes = account.gemm_shapes(cfg, tokens, train)

    def flops(part):
        return sum(2 * M * N * K * c for M, N, K, c in shapes[part])

    assert flops("projections") == pytest.approx(want["projections"], rel=1e-9)
    assert flops("routing") == pytest.approx(want["routing"], rel=1e-9)
    # the experts' rows are even routing's, rounded to whole rows
    assert flops("moe") == pytest.approx(want["moe"], rel=2e-3)
    head = 2 * tokens * cfg.hidden_size * cfg.vocab_size * (3 if train else 1)
    assert flops("head") == head  # the ledger counts no head
    assert len(shapes["moe"]) == (6 if train else 2)


def test_gemm_times_and_the_ceiling():
    t = account.gemm_ms(33, 17, 9, repeats=1)
    assert t["mkl"] > 0 and set(t) <= {"mkl", "onednn"}
    shapes = {"a": [(8, 8, 8, 3), (16, 8, 8, 1)], "b": [(8, 8, 8, 2)]}
    ref = account.gemm_reference(shapes, repeats=1)
    assert set(ref) == {"a", "b"} and ref["a"] > ref["b"] * 1.0 > 0  # (8,8,8) timed once
    c = account.ceiling(64, repeats=1)
    assert c["best"] == max(v for k, v in c.items() if k != "best") > 0


def test_an_account_of_a_prefill_finds_the_experts():
    torch.manual_seed(0)
    model = SmeltLM(presets.pair("tiny")[1]).eval()
    ids = torch.randint(0, 512, (1, 64))
    seg = torch.zeros(1, 64, dtype=torch.long)

    def fwd():
        with torch.no_grad():
            model(ids, seg)

    fwd()
    acc = account.account_step(model, fwd, 1)
    assert list(acc.parts_ms) == list(account.PARTS)
    assert min(acc.parts_ms[p] for p in ("moe", "attention", "projections", "routing")) > 0
    assert acc.parts_ms["optimizer"] == 0.0
