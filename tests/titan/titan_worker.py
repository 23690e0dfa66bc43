"""A torchtitan run of a SMELT preset, instrumented for the tests (run under torchrun).

    torchrun ... titan_worker.py OUT_DIR [torchtitan options]

Runs torchtitan's trainer as ``python -m smelt_model.titan`` would (same patches, same
config), and writes into OUT_DIR (rank 0):

* ``run.json``: the objective of every step (summed over ranks), and FSDP's collectives
  per unit (all-gathers and reduce-scatters, with their phase and step; ``units`` names
  the looped span ``span``, ``layers`` names each span layer ``span.layers.<i>``);
* ``step1.safetensors``: the global batch of step 1 (``input``, ``positions``,
  ``labels``), the full gradient of every parameter before the first optimizer step
  (``grad.<name>``) and, after training, the model's logits on that batch in eval mode
  (``logits``, SMELT models only).

With ``--compare-stock-dispatch`` (first, before the torchtitan options) step 1's batch is
also run through the model, before the step itself, once as configured and once with every
expert-parallel dispatcher replaced by the stock-row one (same meshes): their summed losses
go to ``run.json`` (``compare``) and their gradients to ``grad_as_run.<name>`` and
``grad_stock.<name>``.
"""

import json
import os
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def _gather_rows(t: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def _unit_of(fqn: str) -> str:
    parts = fqn.split(".")
    if parts[0] in ("prelude", "coda"):
        return ".".join(parts[:2])
    if parts[0] == "span":
        return "span"
    return "root"


def _layer_of(fqn: str) -> str:
    parts = fqn.split(".")
    return ".".join(parts[:3]) if parts[0] == "span" else _unit_of(fqn)


def main() -> None:
    out_dir = Path(sys.argv[1])
    args = sys.argv[2:]
    compare = args[:1] == ["--compare-stock-dispatch"]
    args = args[1:] if compare else args
    from smelt_model.titan import patches

    patches.apply()
    args = patches.launch_args(args)
    # a torchtitan subcommand (activation_checkpoint:full ...) takes the options after it
    subcommands = [a for a in args if re.fullmatch(r"[a-z_]+:[a-z-]+", a)]
    args = [a for a in args if a not in subcommands] + subcommands
    if "--module" not in args:
        args = ["--module", "smelt_model.titan"] + args

    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as fpg
    from torchtitan.config import ConfigManager
    from torchtitan.observability import structured_logger as sl
    from torchtitan.tools.logging import init_logger

    init_logger()
    collectives = []

    def recording(kind, real, group_arg):
        def call(fsdp_params, *a, **k):
            fqns = sorted({_unit_of(p._param_fqn) for p in fsdp_params})
            group = a[group_arg] if len(a) > group_arg else None
            size = group.size() if hasattr(group, "size") else None
            phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
            collectives.append(
                {
                    "kind": kind,
                    "units": fqns,
                    "layers": sorted({_layer_of(p._param_fqn) for p in fsdp_params}),
                    "phase": phase,
                    "step": sl.get_step(),
                    "group_size": size,
                }
            )
            return real(fsdp_params, *a, **k)

        return call

    fpg.foreach_all_gather = recording("all_gather", fpg.foreach_all_gather, 0)
    fpg.foreach_reduce = recording("reduce_scatter", fpg.foreach_reduce, 1)

    config = ConfigManager().parse_args(args)
    trainer = config.build()
    model = trainer.model_parts[0]
    rank = dist.get_rank()
    tensors, losses, compared = {}, [], []
    stock_fb = trainer.forward_backward_step

    def full_grads(prefix):
        for name, p in model.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            tensors[f"{prefix}.{name}"] = g.detach().clone()
            p.grad = None

    def dispatchers():
        from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

        for m in model.modules():
            d = getattr(m, "token_dispatcher", None)
            if isinstance(d, AllToAllTokenDispatcher) and d.ep_mesh is not None:
                yield m, d

    def compare_dispatchers(**batch):
        from smelt_model.titan.moe.dispatch import CountingAllToAllTokenDispatcher as Stock

        for label in ("as_run", "stock"):
            if label == "stock":
                for m, d in list(dispatchers()):
                    stock = Stock(Stock.Config(num_experts=d.num_experts, top_k=d.top_k))
                    stock.wire_meshes(ep_mesh=d.ep_mesh)
                    m._as_run, m.token_dispatcher = d, stock
            total = stock_fb(**batch).detach().clone()
            dist.all_reduce(total)
            compared.append(float(total))
            full_grads(f"grad_{label}")
        for m in model.modules():
            if hasattr(m, "_as_run"):
                m.token_dispatcher = m._as_run
                del m._as_run

    def forward_backward_step(*, input_dict, labels, global_valid_tokens):
        if compare and trainer.step == 1 and not compared:
            compare_dispatchers(
                input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
            )
        loss = stock_fb(
            input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
        )
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total))
        if trainer.step == 1:
            for key in ("input", "positions"):
                tensors[key] = _gather_rows(input_dict[key])
            tensors["labels"] = _gather_rows(labels)
        return loss

    trainer.forward_backward_step = forward_backward_step
    stock_step = trainer.optimizers.step

    def optimizer_step(*a, **k):
        if trainer.step == 1:
            for name, p in model.named_parameters():
                g = p.grad
                g = g.full_tensor() if hasattr(g, "full_tensor") else g
                tensors[f"grad.{name}"] = g.detach().clone()
        return stock_step(*a, **k)

    trainer.optimizers.step = optimizer_step
    try:
        trainer.train()
        model.eval()
        with torch.no_grad():
            n = tensors["input"].shape[0] // dist.get_world_size()
            mine = slice(rank * n, (rank + 1) * n)
            if args[args.index("--module") + 1] == "smelt_model.titan":  # a SMELT model
                out = model(tensors["input"][mine], positions=tensors["positions"][mine])
                tensors["logits"] = _gather_rows(out.logits.float())
    finally:
        trainer.close()
    if rank == 0:
        from safetensors.torch import save_file

        out_dir.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "step1.safetensors")
        )
        (out_dir / "run.json").write_text(
            json.dumps({"losses": losses, "collectives": collectives, "compare": compared})
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
