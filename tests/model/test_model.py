"""The thin model: SMELT equals its unrolled definition, trains, saves, rejects bad input."""

import copy
import math

import pytest
import torch
from helpers import micro_config

from smelt_kernels import reference as R
from smelt_model import budget, presets
from smelt_model.block import Rotary
from smelt_model.config import LoopSpec
from smelt_model.model import SmeltLM


def micro(loop=LoopSpec(1, 2, 2), **kw):
    return micro_config(loop, **kw)


def packed_batch(B=2, T=24, V=97, cuts=(7, 15)):
    ids = torch.randint(0, V, (B, T))
    seg = torch.zeros(B, T, dtype=torch.long)
    for c in cuts:
        seg[:, c:] += 1
    return ids, seg


def unrolled_logits(model: SmeltLM, ids, seg):
    """The SMELT recipe written out: prelude, span r times with updates scaled by 1/r, coda,
    with the reference ops and no executor."""
    cfg = model.cfg
    B, T = ids.shape
    L = cfg.n_layers
    if cfg.loop is None:
        order = [(i, 1.0) for i in range(L)]
    else:
        s, e, r = cfg.loop.start, cfg.loop.end, cfg.loop.count
        order = [(i, 1.0) for i in range(s)]
        for _ in range(r):
            order += [(i, 1.0 / r) for i in range(s, e)]
        order += [(i, 1.0) for i in range(e, L)]
    cos, sin = model.rotary.tables(0, T, ids.device)
    x = model.embed(ids)
    for i, scale in order:
        blk = model.layer(i)
        at = blk.attn
        h = blk.attn_norm(x)
        q = Rotary.apply(at.q_proj(h).view(B, T, cfg.n_heads, cfg.head_dim), cos, sin)
        k = Rotary.apply(at.k_proj(h).view(B, T, cfg.n_kv_heads, cfg.head_dim), cos, sin)
        v = at.v_proj(h).view(B, T, cfg.n_kv_heads, cfg.head_dim)
        o, _, _ = R.segment_attention(q, k, v, seg)
        x = x + scale * at.o_proj(o.reshape(B, T, -1))
        h = blk.moe_norm(x).reshape(B * T, -1)
        w, e_ids = R.route(blk.moe.router(h).float(), cfg.top_k, cfg.router_renormalize)
        y = R.moe_ffn(h, blk.moe.gate_up_proj, blk.moe.down_proj, w, e_ids)
        x = x + scale * y.view(B, T, -1)
    return model.lm_head(model.norm(x))


@pytest.mark.parametrize(
    "loop",
    [
        None,
        LoopSpec(1, 2, 2),
        LoopSpec(0, 4, 2),
        LoopSpec(3, 1, 3),
        LoopSpec(0, 1, 1),
        LoopSpec(1, 3, 4),
    ],
    ids=["baseline", "middle-x2", "whole-x2", "last-x3", "first-x1", "wide-x4"],
)
def test_forward_equals_unrolled_reference(loop):
    model = SmeltLM(micro(loop=loop), backend="torch").double()
    ids, seg = packed_batch()
    got = model(ids, seg).logits
    want = unrolled_logits(model, ids, seg)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert model.schedule.executed_layers == model.cfg.executed_layers


def test_shared_weight_gradients_are_the_sum_over_visits():
    """Untie the span into one copy per visit: the looped model's gradient on each shared
    weight equals the sum of the copies' gradients."""
    cfg = micro(loop=LoopSpec(1, 2, 2), aux_loss_weight=0.0)
    looped = SmeltLM(cfg, backend="torch").double()
    ids, seg = packed_batch()
    looped(ids, seg, labels=ids).loss.backward()

    s, e, r = cfg.loop.start, cfg.loop.end, cfg.loop.count
    copies = {(i, v): copy.deepcopy(looped.layer(i)) for i in range(s, e) for v in range(r)}
    for blk in copies.values():
        blk.zero_grad(set_to_none=True)
    unrolled = copy.deepcopy(looped)
    unrolled.zero_grad(set_to_none=True)

    def layer(i, visit):
        return copies[(i, visit)] if s <= i < e else unrolled.layer(i)

    # run the same executed sequence with separate weights per visit
    from smelt_model.block import ForwardContext
    from smelt_model.executor import LoopSchedule

    B, T = ids.shape
    cos, sin = unrolled.rotary.tables(0, T, ids.device)
    ctx = ForwardContext(cos=cos, sin=sin, segment_ids=seg)
    x = unrolled.embed(ids)
    for step in LoopSchedule.from_config(cfg).steps:
        x, _ = layer(step.layer, step.visit)(x, ctx, step)
    logits = unrolled.lm_head(unrolled.norm(x))
    SmeltLM.lm_loss(logits, ids, seg).backward()

    for i in range(s, e):
        shared = dict(looped.layer(i).named_parameters())
        for name, p in shared.items():
            summed = sum(dict(copies[(i, v)].named_parameters())[name].grad for v in range(r))
            torch.testing.assert_close(p.grad, summed, rtol=1e-9, atol=1e-12)
            assert all(
                dict(copies[(i, v)].named_parameters())[name].grad.abs().sum() > 0 for v in range(r)
            ), name
    torch.testing.assert_close(looped.embed.weight.grad, unrolled.embed.weight.grad)


@pytest.mark.parametrize("name", ["tiny-baseline", "tiny-smelt"])
def test_num_params_matches_ledger_exactly(name):
    cfg = presets.get(name)
    model = SmeltLM(cfg)
    led = budget.ledger(cfg)
    assert model.num_params("total") == led.total_params
    assert model.num_params("active") == led.active_params
    emb = 2 * cfg.vocab_size * cfg.hidden_size
    assert model.num_params("total", embeddings=True) == led.total_params + emb


@pytest.mark.parametrize("name", ["tiny-baseline", "tiny-smelt"])
def test_tiny_presets_train_and_loss_falls(name):
    torch.manual_seed(0)
    cfg = presets.get(name)
    model = SmeltLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids, seg = packed_batch(B=2, T=32, V=cfg.vocab_size, cuts=(13,))
    losses = []
    for _ in range(6):
        out = model(ids, seg, labels=ids)
        assert out.aux_loss is not None and torch.isfinite(out.aux_loss)
        (out.loss + out.aux_loss).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.5, losses


def test_loss_ignores_targets_across_segments():
    model = SmeltLM(micro(), backend="torch")
    ids, seg = packed_batch(B=1, T=12, cuts=(5,))
    out = model(ids, seg, labels=ids)
    logp = torch.log_softmax(out.logits[0].float(), -1)
    terms = [-logp[t, ids[0, t + 1]] for t in range(11) if t != 4]
    torch.testing.assert_close(out.loss, torch.stack(terms).mean())
    labels = ids.clone()
    labels[0, 1:] = -100
    assert model(ids, seg, labels=labels).loss.item() == 0.0


def test_aux_loss_only_in_training_and_weighted():
    model = SmeltLM(micro(aux_loss_weight=0.0, z_loss_weight=0.0), backend="torch")
    ids, seg = packed_batch()
    assert model(ids, seg).aux_loss is None
    model = SmeltLM(micro(aux_loss_weight=0.5, z_loss_weight=0.1), backend="torch")
    aux = model(ids, seg).aux_loss
    assert aux is not None and aux.item() > 0.5  # E * sum f P >= 1 for any routing
    model.eval()
    assert model(ids, seg).aux_loss is None


def test_save_and_load_round_trip(tmp_path):
    model = SmeltLM(micro(), backend="torch")
    ids, seg = packed_batch()
    model.save_pretrained(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "config.json").exists()
    loaded = SmeltLM.from_pretrained(tmp_path / "ckpt", backend="torch")
    assert loaded.cfg == model.cfg
    torch.testing.assert_close(loaded(ids, seg).logits, model(ids, seg).logits, rtol=0, atol=0)
    with pytest.raises(FileNotFoundError, match="save_pretrained"):
        SmeltLM.from_pretrained(tmp_path / "nothing")
    (tmp_path / "ckpt" / "config.json").write_text("{")
    with pytest.raises(ValueError, match="config.json: malformed JSON"):
        SmeltLM.from_pretrained(tmp_path / "ckpt")


def test_parameter_names_follow_the_hf_layout_and_old_checkpoints_load(tmp_path):
    from safetensors.torch import load_file, save_file

    model = SmeltLM(micro(), backend="torch")
    names = set(model.state_dict())
    for name in (
        "attn.q_proj.weight",
        "attn.k_proj.weight",
        "attn.v_proj.weight",
        "attn.o_proj.weight",
        "moe.router.weight",
        "moe.gate_up_proj",
        "moe.down_proj",
        "attn_norm.weight",
        "moe_norm.weight",
    ):
        assert f"prelude.0.{name}" in names and f"span.layers.1.{name}" in names, name
    assert not any(".wq." in n or n.endswith(".w1") for n in names)
    cfg = model.cfg
    assert model.layer(0).moe.gate_up_proj.shape == (
        cfg.n_experts,
        2 * cfg.expert_size,
        cfg.hidden_size,
    )
    # a folder round-trips; one with other parameter names is refused, naming them
    path = model.save_pretrained(tmp_path / "ckpt")
    loaded = SmeltLM.from_pretrained(path, backend="torch")
    ids, seg = packed_batch()
    torch.testing.assert_close(loaded(ids, seg).logits, model(ids, seg).logits, rtol=0, atol=0)
    old = {
        k.replace(".attn.q_proj.", ".attn.wq.")
        .replace(".attn.o_proj.", ".attn.wo.")
        .replace(".moe.gate_up_proj", ".moe.w1")
        .replace(".moe.down_proj", ".moe.w2"): v
        for k, v in load_file(str(path / "model.safetensors")).items()
    }
    save_file(old, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing .*unexpected .*attn\.wo\.weight"):
        SmeltLM.from_pretrained(path, backend="torch")


def test_bad_inputs_fail_clearly():
    model = SmeltLM(micro(), backend="torch")
    ids, seg = packed_batch()
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, 97\)"):
        model(torch.full_like(ids, 97), seg)
    with pytest.raises(ValueError, match="input_ids must lie"):
        model(ids - 100, seg)
    with pytest.raises(TypeError, match="input_ids must be int64 or int32"):
        model(ids.float(), seg)
    with pytest.raises(ValueError, match="segment_ids must be non-decreasing"):
        model(ids, seg.flip(1))
    with pytest.raises(ValueError, match="segment_ids has shape"):
        model(ids, seg[:, :5])
    with pytest.raises(ValueError, match=r"\(batch, seq\)"):
        model(ids[0], None)
    with pytest.raises(ValueError, match="labels must lie"):
        model(ids, seg, labels=torch.full_like(ids, 200))
    with pytest.raises(TypeError, match="segment_ids must be a torch.Tensor"):
        model(ids, [0] * 24)
    with pytest.raises(ValueError, match="backend must be one of"):
        SmeltLM(micro(), backend="jax")
    with pytest.raises(ValueError, match="recompute must be one of"):
        SmeltLM(micro(), recompute="some")
    with pytest.raises(TypeError, match="ModelConfig"):
        SmeltLM({"hidden_size": 3})


def test_backend_is_passed_to_the_ops(monkeypatch):
    import smelt_kernels.layers as layers

    seen = []
    real_moe, real_attn = layers.moe_ffn, layers.segment_attention

    def spy_moe(*a, backend=None, **k):
        seen.append(("moe", backend))
        return real_moe(*a, backend=backend, **k)

    def spy_attn(*a, backend=None, **k):
        seen.append(("attn", backend))
        return real_attn(*a, backend=backend, **k)

    monkeypatch.setattr(layers, "moe_ffn", spy_moe)
    monkeypatch.setattr(layers, "segment_attention", spy_attn)
    model = SmeltLM(micro(), backend="torch")
    model(*packed_batch())
    assert len(seen) == 2 * model.schedule.executed_layers
    assert set(seen) == {("moe", "torch"), ("attn", "torch")}
    seen.clear()
    model.backend = "auto"
    model(*packed_batch())
    assert set(seen) == {("moe", None), ("attn", None)}
