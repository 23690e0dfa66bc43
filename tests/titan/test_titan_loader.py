"""smelt's packed documents as torchtitan's tokenizer and dataloader."""

import numpy as np
import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is not installed (extra 'titan')")

import titan_helpers as th  # noqa: E402
from torchtitan.components.tokenizer import HuggingFaceTokenizer  # noqa: E402
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader  # noqa: E402

from smelt_model.data import tokenizer as smelt_tok  # noqa: E402
from smelt_model.titan.loader import (
    IGNORE_INDEX,
    PackedDocuments,
    SmeltTokenizer,  # noqa: E402
    batch_from_packed,
    smelt_data,
    smelt_tokenizer,
)


def _loader(dataset, rank=0, world=1, batch=2, seq_len=32, **cfg):
    tok = SmeltTokenizer.Config().build()
    return PackedDocuments.Config(dataset=dataset, **cfg).build(
        dp_world_size=world, dp_rank=rank, tokenizer=tok, seq_len=seq_len, local_batch_size=batch
    )


def _take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def test_batches_follow_smelts_packing_rules():
    ids = np.array([[10, 11, 12, 20, 21, 22, 23, 30], [30, 31, 9, 9, 9, 9, 9, 9]])
    segs = np.array([[0, 0, 0, 1, 1, 1, 1, 2], [0, 0, 1, 1, 1, 1, 1, 1]])
    labels = ids.copy()
    labels[1, 2:] = IGNORE_INDEX  # padding
    inputs, target = batch_from_packed(ids, segs, labels)
    assert inputs["input"].tolist() == ids[:, :-1].tolist()
    assert inputs["positions"].tolist() == [[0, 1, 2, 0, 1, 2, 3], [0, 1, 0, 1, 2, 3, 4]]
    # a target in another document than its input, or padding, is ignored
    assert target.tolist() == [
        [11, 12, -100, 21, 22, 23, -100],
        [31, -100, -100, -100, -100, -100, -100],
    ]


def test_loader_is_deterministic_and_splits_contexts_between_ranks(tmp_path):
    corpus = tmp_path / "docs.txt"
    corpus.write_text("\n\n".join(f"document number {i} " * (3 + i % 5) for i in range(40)))
    one = _take(_loader(str(corpus), batch=1), 6)
    again = _take(_loader(str(corpus), batch=1), 6)
    assert all(torch.equal(a[0]["input"], b[0]["input"]) for a, b in zip(one, again))
    r0 = _take(_loader(str(corpus), rank=0, world=2, batch=1), 3)
    r1 = _take(_loader(str(corpus), rank=1, world=2, batch=1), 3)
    for k in range(3):  # context i goes to rank i % 2
        assert torch.equal(r0[k][0]["input"], one[2 * k][0]["input"])
        assert torch.equal(r1[k][0]["input"], one[2 * k + 1][0]["input"])
    for inputs, labels in one:
        assert inputs["input"].shape == labels.shape == inputs["positions"].shape == (1, 32)
        assert int(inputs["input"].max()) < SmeltTokenizer.Config().build().get_vocab_size()


def test_loader_resumes_from_its_state(tmp_path):
    corpus = tmp_path / "docs.txt"
    corpus.write_text("\n\n".join(f"text {i} " * 20 for i in range(30)))
    loader = _loader(str(corpus))
    first = _take(loader, 3)
    state = loader.state_dict()
    assert state == {"dp_rank_0": {"batches": 3}, "world_size": 1}
    resumed = _loader(str(corpus))
    resumed.load_state_dict(state)
    nxt = next(iter(resumed))
    assert not torch.equal(nxt[0]["input"], first[-1][0]["input"])
    assert torch.equal(nxt[0]["input"], _take(_loader(str(corpus)), 4)[-1][0]["input"])
    with pytest.raises(ValueError, match="data-parallel ranks"):
        _loader(str(corpus)).load_state_dict({"dp_rank_0": {"batches": 1}, "world_size": 4})


def test_python_stdlib_is_a_corpus_and_bad_corpora_are_refused(tmp_path):
    ((inputs, labels),) = _take(_loader("python-stdlib", seq_len=16), 1)
    assert inputs["input"].shape == (2, 16) and (labels != IGNORE_INDEX).any()
    with pytest.raises(ValueError, match="no such file"):
        _loader(str(tmp_path / "missing.jsonl"))
    with pytest.raises(TypeError, match="SmeltTokenizer"):
        PackedDocuments.Config(dataset=th.SMALL_CORPUS).build(
            dp_world_size=1, dp_rank=0, tokenizer=object(), seq_len=8, local_batch_size=1
        )


def test_saved_smelt_tokenizer_and_stock_config_overrides(tmp_path):
    smelt_tok.BytesTokenizer().save(tmp_path)
    tok = SmeltTokenizer.Config(path=str(tmp_path)).build()
    assert tok.encode("ab") == [97, 98, tok.eos_id] and tok.decode([104, 105]) == "hi"
    data = smelt_data(HuggingFaceTextDataLoader.Config(dataset="c4_test"))
    assert isinstance(data, PackedDocuments.Config) and data.dataset == "python-stdlib"
    data = smelt_data(HuggingFaceTextDataLoader.Config(dataset=th.SMALL_CORPUS))
    assert data.dataset == th.SMALL_CORPUS
    assert isinstance(smelt_tokenizer(HuggingFaceTokenizer.Config()), SmeltTokenizer.Config)


def test_train_and_val_sides_are_smelts_split(tmp_path):
    corpus = tmp_path / "docs.txt"
    corpus.write_text("\n\n".join(f"doc {i}" for i in range(50)))
    tok = SmeltTokenizer.Config().build()
    sides = {}
    for split in ("all", "train", "val"):
        loader = PackedDocuments.Config(dataset=str(corpus), split=split, val_fraction=0.2).build(
            dp_world_size=1, dp_rank=0, tokenizer=tok, seq_len=8, local_batch_size=1
        )
        sides[split] = {d.key for d in loader.docs}
    assert sides["train"] | sides["val"] == sides["all"] and not sides["train"] & sides["val"]
    assert 0 < len(sides["val"]) < len(sides["train"])
    with pytest.raises(ValueError, match="split"):
        PackedDocuments.Config(dataset=str(corpus), split="test").build(
            dp_world_size=1, dp_rank=0, tokenizer=tok, seq_len=8, local_batch_size=1
        )
