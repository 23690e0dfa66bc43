"""A torchtitan run of a SMELT preset that records every step's loss at full precision (run
under torchrun).

    torchrun ... titan_loss_worker.py OUT_JSON [torchtitan options]

Runs torchtitan's trainer as ``python -m smelt_model.titan`` would (same patches, same
config, a resume from the run's own checkpoint included) and writes, on rank 0, OUT_JSON:
``{"steps": [...], "losses": [...]}`` with each trained step's objective summed over the
ranks (torchtitan's log rounds it).
"""

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist


def main() -> None:
    out = Path(sys.argv[1])
    args = sys.argv[2:]
    from smelt_model.titan import patches

    patches.apply()
    args = patches.launch_args(args)
    if "--module" not in args:
        args = ["--module", "smelt_model.titan"] + args

    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger

    init_logger()
    trainer = ConfigManager().parse_args(args).build()
    steps, losses = [], []
    stock = trainer.forward_backward_step

    def forward_backward_step(**kwargs):
        loss = stock(**kwargs)
        total = loss.detach().clone()
        dist.all_reduce(total)
        steps.append(trainer.step)
        losses.append(float(total))
        return loss

    trainer.forward_backward_step = forward_backward_step
    try:
        trainer.train()
    finally:
        trainer.close()
    if dist.get_rank() == 0:
        out.write_text(json.dumps({"steps": steps, "losses": losses}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
