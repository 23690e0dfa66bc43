"""Drop-in layers: each against the reference ops, a small model of a user's own built from
them alone (trains on the CPU, compiles with fullgraph=True), and a pure-Python install
compiling the SMELT model."""

import os
import subprocess
import sys

import helpers
import pytest
import torch
from torch import nn

from smelt_kernels import backends
from smelt_kernels import reference as R
from smelt_kernels.layers import MoE, RMSNorm, Rotary, SegmentAttention

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _moe(**kw):
    torch.manual_seed(0)
    m = MoE(24, 6, 10, top_k=2, **kw).double()
    with torch.no_grad():  # O(1)-scale weights, so routing is far from uniform
        for p in m.parameters():
            p.normal_(0.0, 0.5)
    return m


def test_moe_any_leading_dims_equals_reference():
    moe = _moe(backend="torch")
    x = torch.randn(2, 3, 5, 24, dtype=torch.float64)
    y = moe(x)
    assert y.shape == x.shape
    flat = x.reshape(-1, 24)
    w, ids = R.route(moe.router(flat).float(), 2, True)
    want = R.moe_ffn(flat, moe.gate_up_proj, moe.down_proj, w, ids).view(x.shape)
    torch.testing.assert_close(y, want, rtol=1e-10, atol=1e-10)
    assert moe.aux_loss is None  # both weights 0
    assert moe.gate_up_proj.shape == (6, 20, 24) and moe.down_proj.shape == (6, 24, 10)
    assert isinstance(moe.router, nn.Linear) and moe.router.bias is None
    # a 1-D token and a single row work too
    torch.testing.assert_close(moe(x[0, 0, 0]), y[0, 0, 0], rtol=1e-10, atol=1e-10)


def test_moe_router_losses_kept_not_added():
    plain, lossy = (
        _moe(backend="torch"),
        _moe(aux_loss_weight=0.5, z_loss_weight=0.1, backend="torch"),
    )
    x = torch.randn(7, 24, dtype=torch.float64)
    y = lossy(x)
    torch.testing.assert_close(y, plain(x), rtol=0, atol=0)
    aux = lossy.aux_loss
    assert aux is not None and aux.dim() == 0 and aux.item() > 0.5  # E * sum f P >= 1
    aux.backward()
    assert lossy.router.weight.grad.abs().sum() > 0
    lossy.eval()
    lossy(x)
    assert lossy.aux_loss is None
    with pytest.raises(ValueError, match="hidden_size=24"):
        plain(torch.randn(3, 25, dtype=torch.float64))
    with pytest.raises(ValueError, match="top_k"):
        MoE(8, 4, 4, top_k=5)


def _attention():
    torch.manual_seed(0)
    return SegmentAttention(32, 4, 2, 8, rope_theta=500.0, backend="torch").double()


def test_segment_attention_equals_reference():
    attn = _attention()
    B, T = 2, 11
    x = torch.randn(B, T, 32, dtype=torch.float64)
    seg = (torch.arange(T) >= 4).long().expand(B, T).contiguous()
    cos, sin = attn.rotary.tables(0, T, x.device)
    q = Rotary.apply(attn.q_proj(x).view(B, T, 4, 8), cos, sin)
    k = Rotary.apply(attn.k_proj(x).view(B, T, 2, 8), cos, sin)
    v = attn.v_proj(x).view(B, T, 2, 8)
    o, _, _ = R.segment_attention(q, k, v, seg)
    want = attn.o_proj(o.reshape(B, T, 32))
    torch.testing.assert_close(attn(x, seg), want, rtol=1e-10, atol=1e-10)
    pos = torch.arange(T).expand(B, T)
    torch.testing.assert_close(attn(x, seg, pos), want, rtol=1e-10, atol=1e-10)
    # RoPE sees only offsets inside a document: per-document positions change nothing
    per_doc = torch.where(seg == 0, pos, pos - 4)
    torch.testing.assert_close(attn(x, seg, per_doc), want, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="positions"):
        attn(x, seg, pos[:, :3])
    with pytest.raises(ValueError, match="n_kv_heads"):
        SegmentAttention(32, 3, 2, 8)


class _ListCache:
    """The smallest kv_cache: keeps every call's K/V and segment ids."""

    def __init__(self):
        self.k = self.v = self.seg = None

    def update(self, k, v, seg):
        cat = lambda a, b: b if a is None else torch.cat((a, b), 1)
        self.k, self.v, self.seg = cat(self.k, k), cat(self.v, v), cat(self.seg, seg)
        return self.k, self.v, self.seg


def test_segment_attention_kv_cache_decodes_like_the_full_forward():
    attn = _attention()
    B, T = 2, 9
    x = torch.randn(B, T, 32, dtype=torch.float64)
    seg = (torch.arange(T) >= 3).long().expand(B, T).contiguous()
    full = attn(x, seg)
    cache = _ListCache()
    pos = torch.arange(T).expand(B, T)
    outs = [attn(x[:, :6], seg[:, :6], pos[:, :6], kv_cache=cache)]
    for t in range(6, T):
        outs.append(attn(x[:, t : t + 1], seg[:, t : t + 1], pos[:, t : t + 1], kv_cache=cache))
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-10, atol=1e-10)


# ----------------------------------------------------------------------------- a user's model
class TinyLM(nn.Module):
    """embedding -> SegmentAttention -> MoE -> head, pre-norm, from the drop-in layers only."""

    def __init__(self, vocab=61, hidden=32, backend=None):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.norm1, self.norm2, self.norm = RMSNorm(hidden), RMSNorm(hidden), RMSNorm(hidden)
        self.attn = SegmentAttention(hidden, 4, 2, 8, backend=backend)
        self.moe = MoE(hidden, 8, 16, top_k=2, aux_loss_weight=0.01, backend=backend)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids, segment_ids):
        x = self.embed(ids)
        x = x + self.attn(self.norm1(x), segment_ids)
        x = x + self.moe(self.norm2(x))
        return self.head(self.norm(x))


def _loss(model, ids, seg):
    logits = model(ids, seg)
    ce = nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
    )
    return ce, ce + model.moe.aux_loss


def _data(T=24):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 61, (2, T), generator=g)
    seg = (torch.arange(T) >= 10).long().expand(2, T).contiguous()
    return ids, seg


def _needs(backend):
    if backend == "cpu" and backends.extension("_cpu") is None:
        pytest.skip(f"the CPU extension is not built ({backends.extension_error('_cpu')})")


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_drop_in_model_trains_on_the_cpu(backend):
    _needs(backend)
    torch.manual_seed(0)
    model = TinyLM(backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids, seg = _data()
    losses = []
    for _ in range(8):
        ce, total = _loss(model, ids, seg)
        total.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(ce.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.3, losses


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_drop_in_model_compiles_fullgraph(backend):
    """Forward, loss with the router loss and backward traced as one graph; equal to eager."""
    _needs(backend)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyLM(backend=backend)
    ids, seg = _data()

    def step(i, s):
        return _loss(model, i, s)[1]

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(ids, seg)
    got.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    want = step(ids, seg)
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)
    with torch.no_grad():
        torch.testing.assert_close(
            torch.compile(model, fullgraph=True, backend="aot_eager")(ids, seg),
            model(ids, seg),
            rtol=1e-5,
            atol=1e-6,
        )


def test_pure_python_install_compiles_the_model():
    """With the native extensions unloadable (the ops run their torch paths), the tiny SMELT
    model traces as one graph: torch.compile(fullgraph=True), with dynamo's own backend so no
    C++ compiler is needed. Fewer experts than the preset keep the trace of the reference's
    per-expert loop short."""
    code = helpers.BLOCK_NATIVE + (
        "import torch\n"
        "from smelt_kernels import backends\n"
        "from smelt_model import presets\n"
        "from smelt_model.model import SmeltLM\n"
        "torch.manual_seed(0)\n"
        "cfg = presets.get('tiny-smelt').replace(n_experts=16)\n"
        "model = SmeltLM(cfg).eval()\n"
        "ids = torch.randint(0, cfg.vocab_size, (1, 16))\n"
        "seg = (torch.arange(16) >= 5).long()[None]\n"
        "with torch.no_grad():\n"
        "    got = torch.compile(model, fullgraph=True, backend='eager')(ids, seg).logits\n"
        "    torch.testing.assert_close(got, model(ids, seg).logits, rtol=1e-5, atol=1e-6)\n"
        "assert backends.extension('_cpu') is None\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")
