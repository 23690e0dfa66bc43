"""Corpus loading, the document split, packing and the tokenizers."""

import json
import os

import numpy as np
import pytest

from smelt_model.data import corpus as text_corpus
from smelt_model.data import tokenizer
from smelt_model.model import SmeltLM
from smelt_model.train.trainer import valid_targets


def _docs(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=int(rng.integers(1, 60))) for _ in range(n)]


@pytest.mark.parametrize("seq_len", [2, 7, 16, 64])
def test_pack_keeps_every_token_once_and_separates_documents(seq_len):
    docs = _docs(23)
    p = text_corpus.pack(docs, seq_len, pad_id=256)
    flat_ids = p.input_ids.reshape(-1)
    real = p.labels.reshape(-1) != -100
    # every token of every document exactly once, in order; padding only at the very end
    np.testing.assert_array_equal(flat_ids[real], np.concatenate(docs))
    assert real[: real.sum()].all() and not real[real.sum() :].any()
    assert (flat_ids[~real] == 256).all()
    # a new segment exactly where a new document (or the padding) starts inside a row
    starts = np.cumsum([0] + [len(d) for d in docs])
    boundary = np.zeros(p.input_ids.size, dtype=bool)
    boundary[starts[starts < p.input_ids.size]] = True
    seg = p.segment_ids
    changes = np.zeros_like(seg, dtype=bool)
    changes[:, 1:] = seg[:, 1:] != seg[:, :-1]
    expect = boundary.reshape(seg.shape).copy()
    expect[:, 0] = False  # a row always starts at segment 0
    np.testing.assert_array_equal(changes, expect)
    assert (seg[:, 0] == 0).all() and (np.diff(seg, axis=1) >= 0).all()
    np.testing.assert_array_equal(p.doc_lengths, [len(d) for d in docs])


def test_targets_across_a_boundary_are_ignored():
    # two documents in one context: the model's loss must not count the target that jumps
    import torch

    from smelt_model.config import ModelConfig

    p = text_corpus.pack([np.array([1, 2, 3]), np.array([4, 5])], 8, pad_id=0)
    assert valid_targets(p.segment_ids, p.labels) == 2 + 1  # (1->2, 2->3) and (4->5)
    cfg = ModelConfig(
        vocab_size=8,
        hidden_size=16,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        head_dim=8,
        n_experts=2,
        expert_size=8,
        top_k=1,
    )
    ids, seg, lab = (torch.from_numpy(a).long() for a in (p.input_ids, p.segment_ids, p.labels))
    logits = torch.randn(1, 8, 8)
    loss = SmeltLM.lm_loss(logits, lab, seg)
    manual = torch.nn.functional.cross_entropy(logits[0, [0, 1, 3]], ids[0, [1, 2, 4]])
    torch.testing.assert_close(loss, manual)
    del cfg


def test_split_is_deterministic_disjoint_and_order_free():
    docs = [text_corpus.Document(f"pkg/mod{i}.py", f"text {i}") for i in range(200)]
    train, val = text_corpus.split(docs, 0.2)
    keys_t, keys_v = {d.key for d in train}, {d.key for d in val}
    assert not keys_t & keys_v and len(keys_t | keys_v) == 200
    assert 20 <= len(val) <= 60
    train2, val2 = text_corpus.split(list(reversed(docs)), 0.2)
    assert {d.key for d in val2} == keys_v and {d.key for d in train2} == keys_t
    # at least one document on each side, even when the fraction rounds to none
    t, v = text_corpus.split(docs[:2], 0.01)
    assert len(t) == 1 and len(v) == 1


def test_loaders(tmp_path):
    (tmp_path / "a.txt").write_text("first doc\nline two\n\n  \nsecond doc\n\n\nthird\n")
    docs = text_corpus.load_documents(str(tmp_path / "a.txt"))
    assert [d.text for d in docs] == ["first doc\nline two", "second doc", "third"]
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in "xyz") + "\n")
    jsonl = text_corpus.load_documents(str(tmp_path / "b.jsonl"))
    assert [d.text for d in jsonl] == ["x", "y", "z"]
    folder = tmp_path / "f"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "one.py").write_text("print(1)\n")
    (folder / "two.md").write_text("# two\n")
    (folder / "blob.bin").write_bytes(b"\0\1\2")
    (folder / ".hidden").write_text("no")
    assert [d.key for d in text_corpus.load_documents(str(folder))] == ["sub/one.py", "two.md"]
    std = text_corpus.load_documents(text_corpus.STDLIB)
    keys = {d.key for d in std}
    assert "textwrap.py" in keys and len(std) > 300
    assert not any("site-packages" in k for k in keys)


def _globbed(root, pattern, skip=()):
    """The folder loader's documents by its definition: ``root.glob`` sorted, hidden and
    ``skip`` parts dropped, files only, UTF-8 text with something in it."""
    docs = []
    for path in sorted(root.glob(pattern)):
        rel = path.relative_to(root)
        if any(part.startswith(".") or part in skip for part in rel.parts):
            continue
        if path.is_file():
            data = path.read_bytes()
            try:
                text = None if b"\0" in data else data.decode("utf-8")
            except UnicodeDecodeError:
                text = None
            if text is not None and text.strip():
                docs.append((rel.as_posix(), text))
    return docs


def test_folder_documents_are_the_sorted_glob_of_the_folder(tmp_path):
    # names whose order as paths differs from their order as strings ("a/b" < "a-b/c"),
    # hidden and skipped folders, links to a file (counted) and to a folder (not entered),
    # a broken link, a link loop, a pipe, a folder named like a file, binary and blank files
    root = tmp_path / "corpus"
    for rel, text in {
        "a/b.py": "ab",
        "a-b/c.py": "a-b c",
        "a b/d.py": "a b d",
        "A.py": "upper",
        "_.py": "underscore",
        "é.py": "accent",
        ".hid/e.py": "hidden folder",
        ".f.py": "hidden file",
        "sub/site-packages/g.py": "skipped",
        "sub/__pycache__/h.py": "skipped",
        "sub/keep.py": "kept",
        "deep/x/y/z/i.py": "deep",
        "deep/j.txt": "not .py",
        "dir.py/k.py": "in a folder named like a file",
        "blank.py": "  \n",
        "empty.py": "",
    }.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "bin.py").write_bytes(b"x\0y")
    (root / "latin1.py").write_bytes(b"\xff\xfe")
    (root / "link.py").symlink_to(root / "a" / "b.py")
    (root / "linkdir").symlink_to(root / "a", target_is_directory=True)
    (root / "broken.py").symlink_to(root / "nowhere")
    (root / "loop1.py").symlink_to(root / "loop2.py")
    (root / "loop2.py").symlink_to(root / "loop1.py")
    os.mkfifo(root / "fifo.py")
    got = [(d.key, d.text) for d in text_corpus.load_documents(str(root))]
    assert got == _globbed(root, "**/*")
    skip = ("site-packages", "__pycache__")
    got = [(d.key, d.text) for d in text_corpus._folder(root, ".py", skip=skip)]
    assert got == _globbed(root, "**/*.py", skip)
    assert [k for k, _ in got] == [
        "A.py",
        "_.py",
        "a/b.py",
        "a b/d.py",
        "a-b/c.py",
        "deep/x/y/z/i.py",
        "dir.py/k.py",
        "link.py",
        "sub/keep.py",
        "é.py",
    ]


@pytest.mark.parametrize(
    "content,fragment",
    [
        (None, "no such file"),
        ("", "corpus is empty"),
        ("{bad json\n", "not valid JSON"),
        ('{"txt": "x"}\n', 'string "text"'),
    ],
)
def test_loader_errors(tmp_path, content, fragment):
    path = tmp_path / "c.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=fragment):
        text_corpus.load_documents(str(path))


def test_bytes_tokenizer_round_trip():
    tok = tokenizer.BytesTokenizer()
    ids = tok.encode("héllo\n")
    assert ids[-1] == tok.eos_id and ids.max() < tok.vocab_size == 258
    assert tok.decode(ids) == "héllo\n"


def test_bpe_tokenizer(tmp_path, corpus):
    pytest.importorskip("tokenizers", reason="the BPE tokenizer needs Hugging Face tokenizers")
    texts = [d.text for d in text_corpus.load_documents(str(corpus))]
    tok = tokenizer.make("bpe:400", texts)
    assert tok.vocab_size == 400 and {tok.pad_id, tok.eos_id} == {0, 1}
    ids = tok.encode(texts[0])
    assert ids[-1] == tok.eos_id and len(ids) < len(texts[0].encode()) and ids.max() < 400
    assert tok.decode(ids) == texts[0]
    tok.save(tmp_path)
    again = tokenizer.load(tmp_path)
    np.testing.assert_array_equal(again.encode(texts[1]), tok.encode(texts[1]))
    with pytest.raises(ValueError, match="N must be an int"):
        tokenizer.parse_spec("bpe:100")
    with pytest.raises(ValueError, match="'bytes' or 'bpe:N'"):
        tokenizer.parse_spec("words")


def test_pack_matches_a_direct_construction():
    # every context row against a plain loop over the token stream
    docs = _docs(9, seed=3)
    p = text_corpus.pack(docs, 10, pad_id=256)
    assert p.input_ids.dtype == p.segment_ids.dtype == p.labels.dtype == np.int32
    stream = [(int(t), d) for d, doc in enumerate(docs) for t in doc]
    stream += [(256, len(docs))] * (p.input_ids.size - len(stream))
    for r in range(len(p)):
        row = stream[r * 10 : (r + 1) * 10]
        seg, want = 0, []
        for j, (_, d) in enumerate(row):
            seg += j > 0 and d != row[j - 1][1]
            want.append(seg)
        assert p.input_ids[r].tolist() == [t for t, _ in row]
        assert p.segment_ids[r].tolist() == want
        assert p.labels[r].tolist() == [t if d < len(docs) else -100 for t, d in row]
