"""Helpers of the trainer tests: micro model configs, the command line in a subprocess and
the losses a run logged."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def micro_config(path: Path, looped: bool = False, vocab: int = 258, hidden: int = 64) -> Path:
    cfg = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "n_layers": 4 if looped else 2,
        "n_heads": 4,
        "n_kv_heads": 1,
        "head_dim": 16,
        "n_experts": 8,
        "expert_size": 32,
        "top_k": 2,
    }
    if looped:
        cfg["loop"] = {"start": 1, "length": 2, "count": 2}
    path.write_text(json.dumps(cfg))
    return path


def run_cli(args, env_extra=None, timeout=300) -> subprocess.CompletedProcess:
    """``python -m smelt_model.train ARGS`` in a fresh interpreter."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "smelt_model.train", *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def losses(run: Path) -> list[tuple]:
    """(step, loss, grad_norm) of every step and (step, val_loss) of every evaluation."""
    out = []
    for line in (run / "log.jsonl").read_text().splitlines():
        r = json.loads(line)
        out.append(
            (r["step"], r["val_loss"])
            if "val_loss" in r
            else (r["step"], r["loss"], r["grad_norm"], r["lr"])
        )
    return out
