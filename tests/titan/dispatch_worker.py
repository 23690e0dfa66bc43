"""The token dispatchers against a one-process reference (run under torchrun, gloo).

    torchrun --nproc_per_node N dispatch_worker.py OUT.json

Each rank routes its own tokens (a different seed per rank, some experts left empty) to
E experts held E/N per rank. The experts are a per-expert ``tanh(x @ W_e)``, the weights the
same full tensor on every rank. For the stock and the de-duplicating dispatcher, blocking
and in two chunks interleaved through their phases (on a process group of their own), rank
0 writes the largest differences to the reference (output, and the gradients of the inputs,
the scores and the local experts' weights) and the rows each exchange sent.
"""

import json
import sys

import torch
import torch.distributed as dist

T, D, E, K = 37, 12, 16, 4


def experts(w_local, rows, counts):
    out, start = [], 0
    for i, n in enumerate(counts.tolist()):
        out.append(torch.tanh(rows[start : start + n] @ w_local[i]))
        start += n
    return torch.cat(out) if out else rows[:0]


def problem(rank):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, D, generator=g, requires_grad=True)
    logits = torch.randn(T, E, generator=g)
    logits[:, 3] -= 50.0  # expert 3 never chosen
    scores, ids = torch.softmax(logits, -1).topk(K, dim=-1)
    scores = (scores / scores.sum(-1, keepdim=True)).requires_grad_()
    w = torch.randn(E, D, D, generator=torch.Generator().manual_seed(7)) / D**0.5
    return x, scores, ids, w


def reference(x, scores, ids, w):
    w = w.clone().requires_grad_()
    y = torch.tanh(torch.einsum("td,tkde->tke", x, w[ids]))
    out = (y * scores.unsqueeze(-1)).sum(1)
    return out, w


def run(dispatcher, x, scores, ids, w_local, chunks, mesh, upstream):
    counts_of = lambda i: torch.zeros(E, dtype=torch.int64).scatter_add_(  # noqa: E731
        0, i.reshape(-1), torch.ones(i.numel(), dtype=torch.int64)
    )
    if chunks == 1:
        c = counts_of(ids)
        rows, counts, meta = dispatcher.dispatch(x, scores, ids, c)
        out = dispatcher.combine(experts(w_local, rows, counts), meta, x)
    else:  # two chunks through the phases: a's exchanges in flight while b computes
        parts = [slice(0, T // 2), slice(T // 2, T)]

        def program(sl, chunk):
            xc, sc, ic = x[sl], scores[sl], ids[sl]
            _, rows, counts, meta = yield from dispatcher.dispatch_phases(
                xc, sc, ic, counts_of(ic), chunk=chunk
            )
            _, out = yield from dispatcher.combine_phases(experts(w_local, rows, counts), meta, xc)
            return out

        gens = [program(sl, i) for i, sl in enumerate(parts)]
        carries = [next(g) for g in gens]
        outs = [None, None]
        while any(o is None for o in outs):
            for i, g in enumerate(gens):
                if outs[i] is None:
                    try:
                        carries[i] = g.send(carries[i])
                    except StopIteration as stop:
                        outs[i] = stop.value
        out = torch.cat(outs)
    (out * upstream).sum().backward()
    return out


def main():
    out_path = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.utils import set_spmd_backend

    from smelt_model.titan.moe import traffic
    from smelt_model.titan.moe.dispatch import (
        CountingAllToAllTokenDispatcher,
        DedupAllToAllTokenDispatcher,
        token_ranks,
    )
    from smelt_model.titan.moe.exchange import dedicated_group

    set_spmd_backend("partial_dtensor")  # the backend the SMELT runs use
    traffic.enable(out_path + ".comm")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    side = dedicated_group(mesh.get_group())
    e = E // world
    x, scores, ids, w = problem(rank)
    upstream = torch.randn(T, D, generator=torch.Generator().manual_seed(300 + rank))
    ref, w_ref = reference(x, scores, ids, w)
    (ref * upstream).sum().backward()
    dist.all_reduce(w_ref.grad)  # every rank's tokens reach the experts
    ref_x, ref_s, ref_w = x.grad.clone(), scores.grad.clone(), w_ref.grad[rank * e : (rank + 1) * e]
    results = {"token_ranks": token_ranks(ids, world, E).tolist()}
    kinds = (("stock", CountingAllToAllTokenDispatcher), ("dedup", DedupAllToAllTokenDispatcher))
    for name, cls in kinds:
        for chunks in (1, 2):
            d = cls(cls.Config(num_experts=E, top_k=K))
            d.wire_meshes(ep_mesh=mesh)
            if chunks == 2:
                d.exchange_group = side
            x.grad = scores.grad = None
            w_local = w[rank * e : (rank + 1) * e].clone().requires_grad_()
            first = len(traffic.RECORDER.events)
            out = run(d, x, scores, ids, w_local, chunks, mesh, upstream)
            events = traffic.RECORDER.events[first:]
            results[f"{name}{chunks}"] = {
                "out": (out - ref).abs().max().item(),
                "x": (x.grad - ref_x).abs().max().item(),
                "scores": (scores.grad - ref_s).abs().max().item(),
                "w": (w_local.grad - ref_w).abs().max().item(),
                "events": [
                    [ev["kind"], ev["phase"], ev["rows_to"], ev["row_bytes"]] for ev in events
                ],
            }
    everyone = [None] * world
    dist.all_gather_object(everyone, results)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(everyone, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
