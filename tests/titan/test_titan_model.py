"""SmeltTitan in one process: the same model as SmeltLM, its configs, ledger and switches."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("torchtitan", reason="torchtitan is not installed (extra 'titan')")

from torchtitan.distributed.activation_checkpoint import (
    FullAC,
    MemoryBudgetAC,  # noqa: E402
    SelectiveAC,
)
from torchtitan.models.common.moe import GroupedExperts  # noqa: E402

from smelt_kernels.layers import MoE as SmeltLayerMoE  # noqa: E402
from smelt_model import budget, presets  # noqa: E402
from smelt_model.config import LoopSpec, ModelConfig  # noqa: E402
from smelt_model.model import SmeltLM  # noqa: E402
from smelt_model.titan import config_registry  # noqa: E402
from smelt_model.titan import model as titan_model  # noqa: E402
from smelt_model.titan.attention import segment_ids_from_positions  # noqa: E402
from smelt_model.titan.checkpoint.state_dict import (
    arch_from_config_json,
    config_bytes,  # noqa: E402
    from_smelt,
    to_smelt,
)
from smelt_model.titan.moe.experts import SmeltGroupedExperts  # noqa: E402
from smelt_model.titan.moe.layer import moe_config  # noqa: E402
from smelt_model.titan.overrides import torch_kernels  # noqa: E402
from smelt_model.titan.parallel.parallelize import recompute_policy, update_model_config  # noqa: E402

SmeltTitan = titan_model.SmeltTitan


def _cfg(**kw):
    base = dict(
        vocab_size=61,
        hidden_size=32,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
        n_experts=8,
        expert_size=16,
        top_k=2,
        loop=LoopSpec(1, 2, 2),
        aux_loss_weight=0.05,
        z_loss_weight=0.01,
    )
    base.update(kw)
    return ModelConfig(**base)


def _pair(cfg, **config_fields):
    torch.manual_seed(0)
    smelt = SmeltLM(cfg, backend="torch")
    titan = SmeltTitan.from_arch(cfg, **config_fields)
    state = from_smelt(smelt.state_dict())
    state["config_json"] = config_bytes(cfg)
    titan.load_state_dict(state)
    return smelt, titan


def _batch(cfg, B=2, T=12):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    positions = torch.tensor(
        [[0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2]]
    )[:B, :T]
    labels = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    labels[0, 2] = -100
    return tokens, positions, labels


def _objective(logits, aux, labels):
    V = logits.shape[-1]
    ce = F.cross_entropy(logits.reshape(-1, V).float(), labels.reshape(-1), ignore_index=-100)
    return ce + aux


@pytest.mark.parametrize("loop", [LoopSpec(1, 2, 2), None])
def test_same_model_as_smeltlm_forward_aux_and_gradients(loop):
    cfg = _cfg(loop=loop)
    smelt, titan = _pair(cfg)
    tokens, positions, labels = _batch(cfg)
    ref = smelt(tokens, segment_ids_from_positions(positions))
    out = titan(tokens, positions=positions)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.aux_loss, ref.aux_loss, rtol=1e-5, atol=1e-7)
    _objective(ref.logits, ref.aux_loss, labels).backward()
    _objective(out.logits, out.aux_loss, labels).backward()
    grads = to_smelt({n: p.grad for n, p in titan.named_parameters()})
    for name, p in smelt.named_parameters():
        torch.testing.assert_close(
            grads[name], p.grad, rtol=1e-4, atol=1e-7, msg=lambda m: f"{name}: {m}"
        )
    titan.eval()
    assert titan(tokens, positions=positions).aux_loss is None


def test_router_loss_share_equals_smelt_router_loss_in_one_process():
    cfg = _cfg()
    layer = SmeltLayerMoE(32, 8, 16, 2, True, 0.05, 0.01)
    ours = moe_config(cfg).build()
    logits = torch.randn(20, 8, dtype=torch.float64, requires_grad=True)
    ids = torch.topk(torch.softmax(logits, -1), 2).indices
    counts = torch.bincount(ids.reshape(-1), minlength=8)
    a = layer.router_loss(logits, ids)
    b = ours.router_loss(logits, counts)
    torch.testing.assert_close(b, a)
    torch.testing.assert_close(torch.autograd.grad(b, logits)[0], torch.autograd.grad(a, logits)[0])


def test_grad_accumulation_scales_the_aux_share():
    cfg = _cfg()
    _, titan = _pair(cfg)
    _, titan4 = _pair(cfg, grad_accum_steps=4)
    tokens, positions, _ = _batch(cfg)
    torch.testing.assert_close(
        titan4(tokens, positions=positions).aux_loss,
        titan(tokens, positions=positions).aux_loss / 4,
    )


def test_state_dict_names_round_trip_and_config_travels():
    cfg = _cfg()
    smelt, titan = _pair(cfg)
    sd = smelt.state_dict()
    back = to_smelt(from_smelt(sd))
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    assert set(titan.state_dict()) == set(from_smelt(sd)) | {"config_json"}
    assert arch_from_config_json(titan.state_dict()["config_json"]) == cfg


def test_ledger_gives_torchtitans_parameter_and_flop_counts():
    cfg = presets.get("tiny-smelt")
    spec = config_registry.model_spec("tiny-smelt")
    params, flops = spec.model.get_nparams_and_flops(None, 256)
    led = budget.ledger(cfg, mean_doc_len=256, seq_len=256)
    assert flops == round(led.flops_per_token)
    assert params == led.total_params + 2 * cfg.vocab_size * cfg.hidden_size


def test_every_preset_has_a_config_under_its_own_name():
    for name in presets.names():
        config = getattr(config_registry, name)()
        model = config.model_spec.model
        assert model.arch == presets.get(name) and len(model.moe) == model.arch.n_layers
        assert config.parallelism.spmd_backend == "partial_dtensor"
    with pytest.raises(AttributeError, match="smelt presets"):
        getattr(config_registry, "tiny-nothing")
    with torch.device("meta"):
        model = config_registry.model_spec("200M-S95-smelt").model.build()
    assert model.schedule.executed_layers == 18 and model.span is not None


def test_recompute_follows_torchtitans_activation_checkpointing_choice():
    assert recompute_policy(None) == "none"
    assert recompute_policy(SelectiveAC.Config()) == "visit1"
    assert recompute_policy(FullAC.Config()) == "all"
    assert recompute_policy(FullAC.Config(), 3) == "all-but-3"
    with pytest.raises(ValueError, match="memory-budget"):
        recompute_policy(MemoryBudgetAC.Config())
    with pytest.raises(ValueError, match="add activation_checkpoint:full"):
        recompute_policy(SelectiveAC.Config(), 2)
    with pytest.raises(ValueError, match="keep_activations -1"):
        recompute_policy(FullAC.Config(), -1)
    config = config_registry.trainer_config("tiny-smelt")
    config.activation_checkpoint = FullAC.Config()
    config.training.global_batch_size = 32
    update_model_config(config.model_spec.model, config)
    assert config.model_spec.model.recompute == "all"
    assert config.model_spec.model.grad_accum_steps == 4
    config.moe_comm.keep_activations = 2  # the last two executed layers kept
    update_model_config(config.model_spec.model, config)
    assert config.model_spec.model.recompute == "all-but-2"
    assert config.model_spec.model.build().executor.recompute == "all-but-2"
    config.moe_comm.keep_activations = 99
    with pytest.raises(ValueError, match="recompute all-but-99 keeps 99 of the 6 executed"):
        update_model_config(config.model_spec.model, config)
    for option, value in (("tensor_parallel_degree", 2), ("expert_parallel_degree", 3)):
        config = config_registry.trainer_config("tiny-smelt")
        setattr(config.parallelism, option, value)
        with pytest.raises(ValueError, match=option):
            update_model_config(config.model_spec.model, config)


def test_recompute_gives_the_same_gradients():
    cfg = _cfg()
    _, plain = _pair(cfg)
    _, again = _pair(cfg, recompute="all")
    tokens, positions, labels = _batch(cfg)
    for m in (plain, again):
        out = m(tokens, positions=positions)
        _objective(out.logits, out.aux_loss, labels).backward()
    for (n, a), (_, b) in zip(plain.named_parameters(), again.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-8, msg=n)


def test_torch_kernels_switch_is_one_flag_and_keeps_the_weights():
    cfg = _cfg()
    base = SmeltTitan.Config(arch=cfg)
    both = torch_kernels(base)
    assert both.attention == "flex"
    assert all(type(m.routed_experts.inner_experts) is GroupedExperts.Config for m in both.moe)
    experts_only = torch_kernels(base, attention="smelt")
    assert experts_only.attention == "smelt"
    assert all(
        isinstance(m.routed_experts.inner_experts, SmeltGroupedExperts.Config) for m in base.moe
    )  # the source config is left alone
    with pytest.raises(ValueError, match="experts"):
        torch_kernels(base, experts="cuda")
    smelt, ours = _pair(cfg)
    stock = SmeltTitan(experts_only)
    stock.load_state_dict(ours.state_dict())
    tokens, positions, _ = _batch(cfg)
    a = ours(tokens, positions=positions).logits
    b = stock(tokens, positions=positions).logits  # torch._grouped_mm in bf16
    torch.testing.assert_close(b, a, rtol=0.05, atol=0.05)


# the unfused (uncompiled) FlexAttention is the path this test checks
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning")
def test_flex_attention_core_matches_segment_attention(monkeypatch):
    """The FlexAttention path's mask, GQA and layout (FlexAttention run uncompiled)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from torchtitan.models.common.attention import FlexAttention

    from smelt_kernels.attention import segment_attention

    monkeypatch.setattr(FlexAttention, "_compiled_flex_attn", staticmethod(flex_attention))
    monkeypatch.setattr(titan_model, "create_attention_mask", create_block_mask)
    core = titan_model.FlexSegmentAttention.Config().build()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 24, h, 8, generator=g) for h in (4, 2, 2))
    seg = torch.tensor([[0] * 5 + [1] * 11 + [2] * 8, [0] * 24], dtype=torch.int32)
    out, sink = core(q, k, v, seg)
    assert sink is None
    torch.testing.assert_close(
        out, segment_attention(q, k, v, seg, backend="torch"), rtol=1e-5, atol=1e-6
    )


def test_stock_dispatchers_can_count_their_all_to_alls():
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    from smelt_model.titan.moe.dispatch import CountingAllToAllTokenDispatcher, count_all_to_all

    new = count_all_to_all(AllToAllTokenDispatcher.Config(num_experts=4, top_k=2))
    assert isinstance(new, CountingAllToAllTokenDispatcher.Config)
    assert (new.num_experts, new.top_k) == (4, 2)
    assert isinstance(
        moe_config(_cfg()).routed_experts.token_dispatcher, CountingAllToAllTokenDispatcher.Config
    )
