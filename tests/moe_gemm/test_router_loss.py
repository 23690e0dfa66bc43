"""smelt_kernels.moe_gemm.router_loss: the Switch load-balancing and z losses against a
plain float64 formula (value and gradient), shares over a split batch that sum to the
whole, one error per bad argument, and a token sum that ignores the thread count."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from smelt_kernels.layers import MoE
from smelt_kernels.moe_gemm import router_loss
from smelt_kernels.moe_gemm.loss import token_sum


def _plain(logits, ids, E, aux_w, z_w):
    """The textbook form: softmax probabilities, means over tokens."""
    p = torch.softmax(logits, -1)
    f = torch.bincount(ids.reshape(-1), minlength=E).to(logits.dtype) / ids.numel()
    aux = aux_w * E * (f * p.mean(0)).sum()
    return aux + z_w * torch.logsumexp(logits, -1).pow(2).mean()


def _case(N=37, E=6, k=2, dtype=torch.float64):
    logits = torch.randn(N, E, dtype=dtype, requires_grad=True)
    ids = torch.topk(logits.detach(), k).indices
    return logits, ids, torch.bincount(ids.reshape(-1), minlength=E)


def test_equals_the_plain_formula_value_and_gradient():
    logits, ids, counts = _case()
    ours = router_loss(logits, counts, top_k=2, aux_loss_weight=0.3, z_loss_weight=0.05)
    ref = _plain(logits, ids, 6, 0.3, 0.05)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=0)
    g_ours, g_ref = (torch.autograd.grad(v, logits)[0] for v in (ours, ref))
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-10, atol=1e-14)
    assert router_loss(logits, counts, top_k=2).item() == 0.0  # both weights 0


def test_shares_of_a_split_batch_sum_to_the_whole():
    logits, ids, counts = _case(N=40)
    whole = router_loss(logits, counts, top_k=2, aux_loss_weight=0.2, z_loss_weight=0.1)
    parts = [
        router_loss(half, counts, top_k=2, aux_loss_weight=0.2, z_loss_weight=0.1, n_tokens=40)
        for half in (logits[:25], logits[25:])
    ]
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=1e-12, atol=0)


def test_the_drop_in_layer_calls_it():
    moe = MoE(8, 6, 4, top_k=2, aux_loss_weight=0.3, z_loss_weight=0.05).double()
    logits, ids, counts = _case()
    expect = router_loss(logits, counts, top_k=2, aux_loss_weight=0.3, z_loss_weight=0.05)
    assert torch.equal(moe.router_loss(logits, ids), expect)


@pytest.mark.parametrize(
    "over, err, match",
    [
        (dict(logits=torch.randn(4, 6, 2)), ValueError, "logits must be a floating"),
        (dict(logits=torch.ones(4, 6, dtype=torch.int64)), ValueError, "logits must be"),
        (dict(counts=torch.ones(5)), ValueError, r"counts must have shape \(6,\)"),
        (dict(counts=[1, 2]), TypeError, "must be tensors"),
        (dict(counts=torch.ones(6, device="meta")), ValueError, "counts is on meta"),
        (dict(top_k=0), ValueError, "top_k"),
        (dict(top_k=7), ValueError, "top_k"),
        (dict(aux_loss_weight=-1.0), ValueError, "aux_loss_weight"),
        (dict(z_loss_weight=float("nan")), ValueError, "z_loss_weight"),
    ],
)
def test_bad_arguments_name_themselves(over, err, match):
    args = dict(logits=torch.randn(4, 6), counts=torch.ones(6), top_k=2, aux_loss_weight=0.1)
    args.update(over)
    with pytest.raises(err, match=match):
        router_loss(args.pop("logits"), args.pop("counts"), **args)


ROOT = Path(__file__).resolve().parents[2]
_SUM = """
import sys, torch
from smelt_kernels.moe_gemm.loss import token_sum
torch.set_num_threads(int(sys.argv[1]))
x = torch.randn(70001, generator=torch.Generator().manual_seed(0))
print(token_sum(x).item().hex())
"""


def test_token_sum_is_a_sum_and_ignores_the_thread_count():
    x = torch.randn(70001, dtype=torch.float64)
    torch.testing.assert_close(token_sum(x), x.sum(), rtol=1e-12, atol=0)
    assert token_sum(torch.ones(3)).item() == 3.0 and token_sum(torch.ones(0)).item() == 0.0
    # 70001 values: one plain sum would be split over the threads (ATen's grain is 32768)
    runs = [
        subprocess.run(
            [sys.executable, "-c", _SUM, str(n)],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )
        for n in (1, 2)
    ]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr + runs[1].stderr
    assert runs[0].stdout == runs[1].stdout
