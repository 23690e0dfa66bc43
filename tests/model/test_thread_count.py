"""A whole training step of the SMELT model (forward, router losses, backward, the trainer's
AdamW, fused on the CPU) gives the same bits at any thread count: every smelt kernel reduces
in a fixed order, and the router loss avoids ATen's softmax backward, whose result depends on
the thread count."""

import torch

from smelt_model import presets
from smelt_model.model import SmeltLM
from smelt_model.train.trainer import adamw


def _step(threads: int) -> dict[str, torch.Tensor]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cfg = presets.get("tiny-smelt").replace(aux_loss_weight=0.01, z_loss_weight=1e-3)
        torch.manual_seed(0)
        model = SmeltLM(cfg)
        opt = adamw(model.parameters(), lr=1e-3)
        assert opt.param_groups[0]["fused"]
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, cfg.vocab_size, (2, 256), generator=g)
        segments = torch.arange(256).expand(2, 256) // 100
        out = model(ids, segments, labels=ids)
        (out.loss + out.aux_loss).backward()
        grads = {f"grad:{n}": p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        return {**grads, **{n: p.detach().clone() for n, p in model.named_parameters()}}
    finally:
        torch.set_num_threads(before)


def test_a_training_step_is_bitwise_the_same_at_one_and_two_threads():
    one, two = _step(1), _step(2)
    differ = [name for name in one if not torch.equal(one[name], two[name])]
    assert not differ, differ
