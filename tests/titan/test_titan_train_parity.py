"""The two trainers of a preset agree: ``python -m smelt_model.train`` and the torchtitan
config of ``python -m smelt_model.titan`` start from the same recipe (learning rate at
every step, decayed and undecayed parameters, context length, batch, clipping), and one
training step of tiny-smelt on the same weights and batch gives the same loss, router loss
and gradient norm through both (fp32, one process)."""

import warnings

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is not installed (extra 'titan')")

import titan_helpers as th  # noqa: E402

from smelt_model import presets  # noqa: E402
from smelt_model.config import IGNORE_INDEX  # noqa: E402
from smelt_model.model import valid_targets  # noqa: E402
from smelt_model.titan import config_registry  # noqa: E402
from smelt_model.titan.checkpoint.state_dict import config_bytes, from_smelt  # noqa: E402
from smelt_model.train import cli  # noqa: E402
from smelt_model.train.lockstep import build_trainers  # noqa: E402

PRESET = "tiny-smelt"


def _trainer(tmp_path, *extra):
    """smelt-train's Trainer of PRESET with the command's defaults (the recipe's)."""
    args = cli.parse_args(
        ["--preset", PRESET, "--data", th.SMALL_CORPUS, "--out", str(tmp_path / "run"), *extra]
    )
    trainers, _ = build_trainers(args, {"smelt": tmp_path / "run"}, "cpu")
    return trainers[0]


def _titan(steps=None):
    """torchtitan's config, model, optimizers and (for ``steps``) LR schedulers of PRESET."""
    config = config_registry.trainer_config(PRESET)
    model = config.model_spec.model.build()
    optimizers = config.optimizer.build(model_parts=[model])
    schedulers = None
    if steps is not None:
        schedulers = config.lr_scheduler.build(optimizers=optimizers, training_steps=steps)
    return config, model, optimizers, schedulers


@pytest.mark.parametrize("steps", [40, 6])  # 6: a warm-up longer than the run is cut
def test_both_trainers_use_the_same_learning_rate_at_every_step(tmp_path, steps):
    trainer = _trainer(tmp_path, "--steps", str(steps))
    _, _, optimizers, schedulers = _titan(steps)
    ours, theirs = [], []
    with warnings.catch_warnings():  # the schedulers step without an optimizer step
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(steps):
            ours.append([g["lr"] for g in trainer.optimizer.param_groups])
            theirs.append([g["lr"] for o in optimizers for g in o.param_groups])
            trainer.scheduler.step()
            schedulers.step()
    assert ours == theirs  # exactly, step by step and group by group
    assert max(lr[0] for lr in ours) == presets.recipe(PRESET).lr  # the warm-up's end
    assert ours[0][0] < ours[1][0] and (steps <= 10 or ours[-1][0] < ours[-2][0])


def test_both_trainers_read_the_same_recipe(tmp_path):
    recipe = presets.recipe(PRESET)
    trainer = _trainer(tmp_path, "--steps", "1")
    config, model, optimizers, _ = _titan()
    spec = trainer.spec
    assert (spec.lr, spec.warmup_steps, spec.min_lr_ratio) == (
        recipe.lr,
        recipe.warmup_steps,
        recipe.min_lr_factor,
    )
    assert (spec.seq_len, spec.tokens_per_step, spec.grad_clip) == (
        config.training.seq_len,
        config.training.seq_len * config.training.local_batch_size,
        config.training.max_norm,
    )
    assert config.lr_scheduler.warmup_steps == recipe.warmup_steps
    # weight decay: the same parameters decayed, at the same rate
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    ours = {
        (g["weight_decay"], frozenset(names[id(p)] for p in g["params"]))
        for g in trainer.optimizer.param_groups
    }
    theirs = set()
    for o in optimizers:
        for g in o.param_groups:
            plain = {n.replace("router.gate.", "router.") for n in g["param_names"]}
            plain = {n for n in plain if "routed_experts" not in n}  # named differently
            theirs.add((g["weight_decay"], frozenset(plain)))
    no_decay = {n for n, p in trainer.model.named_parameters() if p.ndim < 2}
    assert (0.0, frozenset(no_decay)) in ours
    assert any(wd == 0.0 and names_ == frozenset(no_decay) for wd, names_ in theirs)
    assert {wd for wd, _ in ours} == {wd for wd, _ in theirs} == {0.0, recipe.weight_decay}
    betas = {tuple(g["betas"]) for o in optimizers for g in o.param_groups}
    assert {tuple(g["betas"]) for g in trainer.optimizer.param_groups} == betas == {(0.9, 0.95)}
    assert model.cfg == trainer.cfg  # the preset is one model in both (vocabulary included)


def test_one_training_step_gives_the_same_losses_through_both(tmp_path):
    trainer = _trainer(tmp_path, "--steps", "1", "--seq-len", "64", "--tokens-per-step", "256")
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    rows = trainer.step_rows(0)
    d = trainer.train_data
    rec = trainer.step()

    config, model, _, _ = _titan()
    state = from_smelt(weights)
    state["config_json"] = config_bytes(model.cfg)
    model.load_state_dict(state)
    model.train()
    # the trainer's contexts as torchtitan's batch: every one of the T tokens an input, its
    # position inside its document, the next token its label (-100 where the trainer's
    # loss counts none: across a document boundary, and the last position)
    ids, seg, lab = (
        torch.from_numpy(a[rows]).long() for a in (d.input_ids, d.segment_ids, d.labels)
    )
    B, T = ids.shape
    starts = torch.ones(B, T, dtype=torch.bool)
    starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
    positions = torch.arange(T) - torch.where(starts, torch.arange(T), 0).cummax(1).values
    labels = torch.full((B, T), IGNORE_INDEX)
    labels[:, :-1] = torch.where(valid_targets(lab, seg), lab[:, 1:], IGNORE_INDEX)
    loss_fn = config.loss.build(compile_config=config.compile)
    out = model(ids, positions=positions)
    objective, _ = loss_fn(out, labels, (labels != IGNORE_INDEX).sum())
    objective.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    # fp32: the two MoE paths add the expert outputs in different orders (torchtitan's
    # dispatcher and grouped GEMM against the fused moe_ffn), so the results agree to
    # rounding (about 1e-7 relative per op over 6 executed layers), not bitwise
    assert rec["aux_loss"] == pytest.approx(out.aux_loss.item(), rel=1e-5)
    assert rec["loss"] == pytest.approx((objective - out.aux_loss).item(), rel=1e-5)
    assert rec["grad_norm"] == pytest.approx(norm.item(), rel=1e-4)
