"""pytest-benchmark wrappers for the model's CPU paths (not part of the test suite).

pytest bench/ --benchmark-only                 # compare runs with --benchmark-compare
"""

import pytest
import torch

from smelt_model import presets
from smelt_model.model import SmeltLM

pytest.importorskip("pytest_benchmark")

T = 512


def _setup(arch):
    torch.manual_seed(0)
    cfg = presets.get(f"tiny-{arch}")
    model = SmeltLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, T))
    seg = (torch.arange(T) // 200)[None]
    return model, ids, seg


@pytest.mark.parametrize("arch", ["baseline", "smelt"])
def test_train_step(benchmark, arch):
    model, ids, seg = _setup(arch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        out = model(ids, seg, labels=ids)
        (out.loss + out.aux_loss).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    benchmark.pedantic(step, rounds=3, warmup_rounds=1)


@pytest.mark.parametrize("arch", ["baseline", "smelt"])
def test_prefill(benchmark, arch):
    model, ids, seg = _setup(arch)
    model.eval()

    def fwd():
        with torch.no_grad():
            model(ids, seg)

    benchmark.pedantic(fwd, rounds=5, warmup_rounds=1)
