"""Padding-free packing: documents flattened into one row (positions restarting, or the
cu_seq_lens of DataCollatorWithFlattening) give each document's own outputs."""

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")

from hf_testutil import VOCAB, build, use  # noqa: E402

from smelt_kernels.hf import attention as ha  # noqa: E402

RTOL, ATOL = 1e-4, 2e-5
LENGTHS = (5, 1, 7, 3)


def documents(seed=7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g) for n in LENGTHS]


def alone(model, docs):
    return torch.cat([model(d[None], use_cache=False).logits[0] for d in docs])


@pytest.mark.parametrize("family", ["mixtral"])
def test_packed_position_ids_equal_each_document_alone(family):
    model = use(build(family), "smelt", "smelt")
    docs = documents()
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    packed = model(ids, position_ids=pos, use_cache=False).logits[0]
    torch.testing.assert_close(packed, alone(model, docs), rtol=RTOL, atol=ATOL)
    eager = alone(use(model, "eager", "eager"), docs)
    torch.testing.assert_close(packed, eager, rtol=RTOL, atol=ATOL)


def test_flattening_collator_cu_seqlens_equal_each_document_alone():
    from transformers import DataCollatorWithFlattening

    model = use(build("mixtral"), "smelt", "smelt")
    docs = documents(8)
    collate = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=True)
    batch = collate([{"input_ids": d.tolist()} for d in docs], return_tensors="pt")
    assert "cu_seq_lens_k" in batch
    out = model(**batch, use_cache=False)
    torch.testing.assert_close(out.logits[0], alone(model, docs), rtol=RTOL, atol=ATOL)
    assert torch.isfinite(out.loss)
    # cu_seq_lens alone (positions left to the model: 0..N-1, RoPE only sees offsets)
    no_pos = {k: v for k, v in batch.items() if k not in ("position_ids", "labels")}
    logits = model(**no_pos, use_cache=False).logits[0]
    torch.testing.assert_close(logits, alone(model, docs), rtol=1e-3, atol=1e-4)


def test_packed_gradients_equal_the_sum_over_documents():
    model = use(build("olmoe"), "smelt", "smelt")
    docs = documents(9)
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    w = torch.randn(ids.shape[1], VOCAB, generator=torch.Generator().manual_seed(1))
    model.zero_grad(set_to_none=True)
    (model(ids, position_ids=pos, use_cache=False).logits[0] * w).sum().backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    (alone(model, docs) * w).sum().backward()
    for n, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(packed[n], p.grad, rtol=1e-4, atol=1e-4, msg=n)


def test_segment_ids_are_made_on_the_device_without_reading_values():
    pos = torch.tensor([[0, 1, 2, 0, 0, 1, 5]])
    assert ha.segments_from_positions(pos).tolist() == [[0, 0, 0, 1, 2, 2, 3]]
    cu = torch.tensor([0, 3, 4, 7], dtype=torch.int32)
    assert ha.segments_from_cu_seqlens(cu, 7).tolist() == [[0, 0, 0, 1, 2, 2, 2]]
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    assert ha.segments_from_mask(mask).tolist() == [
        [0, 0, 1, 1, 1],
        [0, 0, 0, 1, 1],
        [0, 0, 0, 0, 0],
    ]
    assert ha.segments_from_mask(torch.tensor([[1, 0, 1]])).tolist() == [[0, 1, 2]]
    # no value is read back: the same calls run on meta tensors, which hold no data
    meta = ha.segments_from_positions(pos.to("meta"))
    assert meta.shape == pos.shape and meta.dtype == torch.int32
    assert ha.segments_from_cu_seqlens(cu.to("meta"), 7).shape == (1, 7)
    assert ha.segments_from_mask(mask.to("meta")).shape == mask.shape
