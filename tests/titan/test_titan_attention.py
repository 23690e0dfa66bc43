"""smelt's segment attention as torchtitan's varlen attention, from torchtitan's own
document metadata: against a dense masked softmax, forward and gradients."""

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is not installed (extra 'titan')")

from torchtitan.models.common.attention import (
    FlexAttention,
    VarlenAttention,  # noqa: E402
    create_varlen_metadata_for_document,
)

from smelt_model.titan.attention import (
    SmeltVarlenAttention,
    segment_ids_from_cu_seqlens,  # noqa: E402
    segment_ids_from_positions,
    smelt_attention,
    smelt_attention_from_varlen,
)


def _positions(doc_lengths_per_row):
    rows = []
    for lengths in doc_lengths_per_row:
        rows.append(torch.cat([torch.arange(n) for n in lengths]))
    return torch.stack(rows)


def _dense(q, k, v, positions, scale):
    """Causal attention inside documents by an explicit mask (documents start at position 0)."""
    B, T, Hq, D = q.shape
    doc = torch.cumsum(positions == 0, dim=1)
    i = torch.arange(T)
    mask = (doc[:, :, None] == doc[:, None, :]) & (i[None, None, :] <= i[None, :, None])
    rep = Hq // k.shape[2]
    kk, vv = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    s = s.masked_fill(~mask[:, None], float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), vv)


POSITIONS = [[[5, 1, 9, 1]], [[16]], [[3, 3, 3, 7], [1, 1, 14]]]


@pytest.mark.parametrize("lengths", POSITIONS)
def test_segment_ids_on_the_device_match_the_positions(lengths):
    positions = _positions(lengths)
    B, T = positions.shape
    meta = create_varlen_metadata_for_document(positions)
    from_cu = segment_ids_from_cu_seqlens(meta.cu_seq_q, B, T)
    from_pos = segment_ids_from_positions(positions)
    assert from_cu.dtype == from_pos.dtype == torch.int32
    # same documents: equal ids where the positions agree, changes at the same places
    assert torch.equal(from_cu[:, 1:] != from_cu[:, :-1], from_pos[:, 1:] != from_pos[:, :-1])
    assert (from_cu[:, 1:] >= from_cu[:, :-1]).all()


@pytest.mark.parametrize("lengths", POSITIONS)
@pytest.mark.parametrize("heads,v_dim", [((4, 2), 16), ((3, 3), 16), ((2, 2), 8)])
def test_forward_and_gradients_match_a_dense_mask(lengths, heads, v_dim):
    positions = _positions(lengths)
    B, T = positions.shape
    Hq, Hkv = heads
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, T, Hq, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, T, Hkv, 16, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, T, Hkv, v_dim, generator=g, dtype=torch.float64, requires_grad=True)
    attn = SmeltVarlenAttention.Config().build()
    meta = create_varlen_metadata_for_document(positions)
    out = attn(q, k, v, attention_masks=meta, scale=0.3, enable_gqa=Hq != Hkv)
    v_pad = torch.nn.functional.pad(v, (0, 16 - v_dim))
    ref = _dense(q, k, v_pad, positions, 0.3)[..., :v_dim]
    assert out.shape == (B, T, Hq, v_dim)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="window_size"):
        SmeltVarlenAttention.Config(window_size=(8, 0)).build()
    attn = SmeltVarlenAttention.Config().build()
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(TypeError, match="VarlenMetadata"):
        attn(q, q, q, attention_masks=None)
    meta = create_varlen_metadata_for_document(_positions([[4]]))
    with pytest.raises(ValueError, match="out_transform"):
        attn(q, q, q, attention_masks=meta, out_transform=lambda o, lse: o)


def test_overrides_replace_the_stock_configs():
    flex = FlexAttention.Config()
    new = smelt_attention(flex, backend="torch")
    assert isinstance(new, SmeltVarlenAttention.Config) and new.backend == "torch"
    assert isinstance(new, VarlenAttention.Config)  # the trainer then builds varlen metadata
    new = smelt_attention_from_varlen(VarlenAttention.Config())
    assert isinstance(new, SmeltVarlenAttention.Config) and new.backend is None
