"""FSDP2 on two CPU processes (gloo) with the package's recipe
(:func:`smelt_model.titan.parallel.fsdp.shard`:
every block its own unit, the shared span one unit or one unit per span layer): same loss
and grads as one process, over two steps of gradient accumulation, each unit gathered
once per pass and reduced once per backward, whatever its visits, and the gathers issued in
the order the prefetch (``next`` or ``loop``) says."""

import os
import tempfile
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import micro_config

from smelt_model.model import SmeltLM

WORLD = 2
#: (span_units, reshard_after_forward, recompute, router loss weight, prefetch) the workers
#: shard a model with; with a router loss each rank's is its own batch's (SmeltLM sums no
#: statistics over ranks), so only the collectives are compared
SETUPS = [
    ("span", True, "none", 0.0, "next"),
    ("layer", True, "none", 0.0, "loop"),
    ("layer", False, "all-but-1", 0.0, "loop"),
    ("layer", True, "none", 0.01, "next"),
]


def _cfg(aux_loss_weight=0.0):
    return micro_config(aux_loss_weight=aux_loss_weight)


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 97, (2 * WORLD, 16), generator=g)


def _unit(fqn: str) -> str:
    parts = fqn.split(".")
    if parts[0] == "span":
        return ".".join(parts[:3])
    return ".".join(parts[:2]) if parts[0] in ("prelude", "coda") else "root"


def _worker(rank, init_file, out_file):
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as fpg

    from smelt_model.titan.parallel.fsdp import shard, units

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    log = []
    stock_gather, stock_reduce = fpg.foreach_all_gather, fpg.foreach_reduce

    def gather(params, *a, **k):
        phase = "bwd" if torch._C._current_graph_task_id() != -1 else "fwd"
        log.append(("gather", _unit(params[0]._param_fqn), phase))
        return stock_gather(params, *a, **k)

    def reduce(params, *a, **k):
        log.append(("reduce", _unit(params[0]._param_fqn), "bwd"))
        return stock_reduce(params, *a, **k)

    fpg.foreach_all_gather, fpg.foreach_reduce = gather, reduce
    try:
        results = {}
        for span_units, reshard, recompute, aux, prefetch in SETUPS:
            torch.manual_seed(0)
            model = SmeltLM(_cfg(aux), backend="torch", recompute=recompute).double()
            shard(model, span_units=span_units, reshard_after_forward=reshard, prefetch=prefetch)
            assert all(hasattr(u, "unshard") for u in units(model, span_units))
            for i in range(model.cfg.n_layers):  # runs after the shard's own hooks

                def enter(block, args):
                    if torch._C._current_graph_task_id() == -1:
                        log.append(("enter", args[2].slot, "fwd"))

                def leave(block, args, output):  # the backward of the layer starts
                    if torch._C._current_graph_task_id() == -1 and output[0].requires_grad:
                        slot = args[2].slot
                        output[0].register_hook(lambda g, s=slot: log.append(("enter", s, "bwd")))

                model.layer(i).register_forward_pre_hook(enter)
                model.layer(i).register_forward_hook(leave)
            ids = _batch()[2 * rank : 2 * rank + 2]
            loss = 0.0
            for _ in range(2):  # two micro-batches: the gradients accumulate
                log.clear()
                out = model(ids, labels=ids)
                objective = out.loss if out.aux_loss is None else out.loss + out.aux_loss
                objective.backward()
                total = out.loss.detach().clone()
                dist.all_reduce(total)
                loss += total.item() / WORLD
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            results[(span_units, reshard, recompute, aux, prefetch)] = (loss, grads, list(log))
        if rank == 0:
            torch.save(results, out_file)
        # every rank's collectives done before the group goes: without it, a rank that gets
        # there first can abort ("terminate called without an active exception") on a busy
        # machine
        dist.barrier()
    finally:
        fpg.foreach_all_gather, fpg.foreach_reduce = stock_gather, stock_reduce
        dist.destroy_process_group()


@pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="torch.distributed with gloo is not available",
)
@pytest.mark.slow
def test_fsdp2_two_processes_match_single_process():
    with tempfile.TemporaryDirectory() as tmp:
        init_file, out_file = os.path.join(tmp, "init"), os.path.join(tmp, "out.pt")
        mp.start_processes(
            _worker, args=(init_file, out_file), nprocs=WORLD, join=True, start_method="spawn"
        )
        results = torch.load(out_file)
    torch.manual_seed(0)
    model = SmeltLM(_cfg(), backend="torch").double()
    ids = _batch()
    out = model(ids, labels=ids)
    out.loss.backward()
    names = dict(model.named_parameters())
    # prelude 0, span layers 1-2 (executed 1, 2, 1, 2), coda 3
    layers = {"span": ["span.layers.0"], "layer": ["span.layers.0", "span.layers.1"]}
    for (span_units, reshard, _, aux, prefetch), (loss, grads, events) in results.items():
        log = Counter(e for e in events if e[0] != "enter")
        # the ranks' losses averaged, twice (accumulated)
        assert loss / 2 == pytest.approx(out.loss.item(), rel=1e-12)
        assert set(grads) == set(names)
        for n, p in names.items():
            if not aux:
                torch.testing.assert_close(grads[n], 2 * p.grad, rtol=1e-10, atol=1e-13)
        # the last micro-batch: every unit gathered once each way (none again for the
        # backward without resharding, and never the root's) and reduced once, the span's
        # at both visits
        for unit in ["root", "prelude.0", "coda.0"] + layers[span_units]:
            again = 1 if reshard and unit != "root" else 0
            assert log[("gather", unit, "fwd")] == 1, (span_units, unit, log)
            assert log[("gather", unit, "bwd")] == again, (unit, log)
            assert log[("reduce", unit, "bwd")] == 1, (unit, log)
        assert sum(log.values()) == (2 + reshard) * (2 + len(layers[span_units])) + 2
        # a unit first used at executed layer p is gathered when layer p - 1 starts (the
        # first one with the root), before layer p - 1 computes: FSDP alone would gather
        # it only when layer p starts. Following the loop, the coda's is issued when the
        # span's last visit starts (executed layer 3)
        enters = {e[1:]: i for i, e in enumerate(events) if e[0] == "enter"}
        first = {"prelude.0": 0, "span.layers.0": 1, "span.layers.1": 2, "coda.0": 5}
        if prefetch == "loop":
            first["coda.0"] = 4
        for unit in ["prelude.0", "coda.0"] + layers[span_units]:
            at, p = events.index(("gather", unit, "fwd")), first[unit]
            lo = enters[(p - 2, "fwd")] if p >= 2 else -1
            assert lo < at < enters[(max(p - 1, 0), "fwd")], (prefetch, unit, events)
        if (
            reshard and span_units == "layer"
        ):  # backward: the prelude's gathered when the span's layer 2 at visit 1
            # (executed layer 2) starts its backward, else when executed layer 1 does
            at = events.index(("gather", "prelude.0", "bwd"))
            p = 2 if prefetch == "loop" else 1
            assert enters[(p + 1, "bwd")] < at < enters[(p, "bwd")], (prefetch, events)
        # in the backward one layer ahead too, not all at its start: only the first two
        # layers of the backward (coda 0 and the next) before coda 0's gradients are reduced
        if reshard:
            for unit in ["prelude.0"] + (["span.layers.0"] if span_units == "layer" else []):
                gather = events.index(("gather", unit, "bwd"))
                assert events.index(("reduce", "coda.0", "bwd")) < gather, (unit, events)
