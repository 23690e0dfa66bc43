"""FSDP2 on two CPU processes (gloo) with the package's recipe (:func:`smelt_model.parallel.shard`:
every block its own unit, the shared span one unit): same loss and grads as one process."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import micro_config

from smelt_model.model import SmeltLM

WORLD = 2


def _cfg():
    return micro_config(aux_loss_weight=0.0)


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 97, (2 * WORLD, 16), generator=g)


def _worker(rank, init_file, out_file):
    from smelt_model.parallel import shard, units

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)
        model = SmeltLM(_cfg(), backend="torch").double()
        shard(model)  # the shared span: gathered once, used r times
        assert model.span in units(model) and all(hasattr(u, "unshard") for u in units(model))
        ids = _batch()[2 * rank : 2 * rank + 2]
        out = model(ids, labels=ids)
        out.loss.backward()
        loss = out.loss.detach().clone()
        dist.all_reduce(loss)
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        if rank == 0:
            torch.save((loss.item() / WORLD, grads), out_file)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="torch.distributed with gloo is not available",
)
def test_fsdp2_two_processes_match_single_process():
    with tempfile.TemporaryDirectory() as tmp:
        init_file, out_file = os.path.join(tmp, "init"), os.path.join(tmp, "out.pt")
        mp.start_processes(
            _worker, args=(init_file, out_file), nprocs=WORLD, join=True, start_method="spawn"
        )
        loss, grads = torch.load(out_file)
    torch.manual_seed(0)
    model = SmeltLM(_cfg(), backend="torch").double()
    ids = _batch()
    out = model(ids, labels=ids)
    out.loss.backward()
    assert loss == pytest.approx(out.loss.item(), rel=1e-12)
    names = dict(model.named_parameters())
    assert set(grads) == set(names)
    for n, p in names.items():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-10, atol=1e-13)
