"""Chunked overlap in one process: SmeltTitan with its batch split in chunks, each MoE
layer's exchanges paused in flight (a one-rank gloo group, so the dispatchers exchange for
real), equals SmeltLM: logits, router losses and every gradient, with and without
activation recompute."""

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is not installed (extra 'titan')")

import torch.distributed as dist  # noqa: E402
from test_titan_model import _batch, _cfg, _objective, _pair  # noqa: E402

from smelt_model.config import LoopSpec  # noqa: E402
from smelt_model.executor import Interleaved  # noqa: E402
from smelt_model.titan.attention import segment_ids_from_positions  # noqa: E402
from smelt_model.titan.checkpoint.state_dict import to_smelt  # noqa: E402
from smelt_model.titan.moe.dispatch import DedupAllToAllTokenDispatcher  # noqa: E402


@pytest.fixture(scope="module")
def ep_mesh(tmp_path_factory):
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.utils import get_spmd_backend, set_spmd_backend

    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    backend = get_spmd_backend()
    set_spmd_backend("partial_dtensor")
    yield init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
    set_spmd_backend(backend)
    dist.destroy_process_group()


@pytest.mark.parametrize("dedup", [False, True])
@pytest.mark.parametrize("loop", [LoopSpec(1, 2, 2), None])
def test_overlap_equals_the_forward_without_it(ep_mesh, loop, dedup):
    cfg = _cfg(loop=loop)
    smelt, titan = _pair(cfg, overlap=True)
    paused = []
    for i in range(cfg.n_layers):
        routed = titan.layer(i).moe.routed_experts
        if dedup:
            cls = DedupAllToAllTokenDispatcher
            routed.token_dispatcher = cls(cls.Config(num_experts=cfg.n_experts, top_k=cfg.top_k))
        routed.token_dispatcher.wire_meshes(ep_mesh=ep_mesh)
    stock_advance = Interleaved.advance

    def advance(self, blocks, steps):  # which chunks a unit leaves paused in flight
        out = stock_advance(self, blocks, steps)
        paused.append([c.gen is not None for c in out.chunks])
        return out

    tokens, positions, labels = _batch(cfg)
    ref = smelt(tokens, segment_ids_from_positions(positions))
    Interleaved.advance = advance
    try:
        out = titan(tokens, positions=positions)
    finally:
        Interleaved.advance = stock_advance
    # chunk 0 finishes every unit; chunk 1 leaves each unit with its last combine in flight
    assert paused and all(p == [False, True] for p in paused), paused
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.aux_loss, ref.aux_loss, rtol=1e-5, atol=1e-7)
    _objective(ref.logits, ref.aux_loss, labels).backward()
    _objective(out.logits, out.aux_loss, labels).backward()
    grads = to_smelt({n: p.grad for n, p in titan.named_parameters()})
    for name, p in smelt.named_parameters():
        torch.testing.assert_close(
            grads[name], p.grad, rtol=1e-4, atol=1e-7, msg=lambda m: f"{name}: {m}"
        )


def _wired(cfg, ep_mesh, **fields):
    smelt, titan = _pair(cfg, **fields)
    for i in range(cfg.n_layers):
        routed = titan.layer(i).moe.routed_experts
        cls = DedupAllToAllTokenDispatcher
        routed.token_dispatcher = cls(cls.Config(num_experts=cfg.n_experts, top_k=cfg.top_k))
        routed.token_dispatcher.wire_meshes(ep_mesh=ep_mesh)
    return smelt, titan


def _same_gradients(smelt, titan, B=2):
    tokens, positions, labels = _batch(smelt.cfg)
    tokens, positions, labels = (t.repeat(B // 2, 1) for t in (tokens, positions, labels))
    ref = smelt(tokens, segment_ids_from_positions(positions))
    out = titan(tokens, positions=positions)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-6)
    _objective(ref.logits, ref.aux_loss, labels).backward()
    _objective(out.logits, out.aux_loss, labels).backward()
    grads = to_smelt({n: p.grad for n, p in titan.named_parameters()})
    for name, p in smelt.named_parameters():
        torch.testing.assert_close(
            grads[name], p.grad, rtol=1e-4, atol=1e-7, msg=lambda m: f"{name}: {m}"
        )


@pytest.mark.parametrize("recompute", ["visit1", "all"])
def test_recomputed_layers_exchange_again_with_the_same_gradients(ep_mesh, recompute):
    """Without overlap, a recomputed layer runs its (de-duplicated) exchanges again in the
    backward; the gradients are those of SmeltLM."""
    _same_gradients(*_wired(_cfg(), ep_mesh, recompute=recompute))


@pytest.mark.parametrize("recompute, chunks", [("visit1", 2), ("all", 4), ("all-but-2", 2)])
def test_overlap_with_recompute_equals_smeltlm(ep_mesh, recompute, chunks):
    """A recomputed layer runs its chunks together under one checkpoint, interleaved in the
    forward and again in the backward's recompute: every exchange of its forward runs twice
    (counted on the dispatchers), and the gradients are SmeltLM's."""
    from smelt_model.titan.moe import dispatch

    smelt, titan = _wired(_cfg(), ep_mesh, recompute=recompute, overlap=True, chunks=chunks)
    starts = []
    stock = dispatch.DedupAllToAllTokenDispatcher.dispatch_phases

    def counting(self, *a, **k):
        starts.append(torch.is_grad_enabled())
        return (yield from stock(self, *a, **k))

    dispatch.DedupAllToAllTokenDispatcher.dispatch_phases = counting
    try:
        _same_gradients(smelt, titan, B=4)
    finally:
        dispatch.DedupAllToAllTokenDispatcher.dispatch_phases = stock
    again = {"visit1": 2, "all": 6, "all-but-2": 4}[recompute]  # of the 6 executed layers
    assert len(starts) == (6 + again) * chunks


def test_every_chunk_issues_its_split_sizes_before_the_host_waits(ep_mesh, monkeypatch):
    """With the overlap, a dispatch starts its exchange of counts and pauses before the host
    waits for the split sizes: in a layer of 4 chunks, all four exchanges of counts are
    issued (each chunk's attention and routing already queued) before the first chunk's
    tokens leave, so the host waits while the GPU still has the others' work."""
    from smelt_model.titan.moe import dispatch

    events = []
    stock_counts, stock_start = dispatch.all_to_all_single, dispatch.start

    def counts(*a, **k):
        events.append("counts")
        return stock_counts(*a, **k)

    def start(flight, *tensors):
        if flight.kind == "dispatch":
            events.append("tokens")
        return stock_start(flight, *tensors)

    monkeypatch.setattr(dispatch, "all_to_all_single", counts)
    monkeypatch.setattr(dispatch, "start", start)
    smelt, titan = _wired(_cfg(), ep_mesh, overlap=True, chunks=4)
    tokens, positions, _ = _batch(smelt.cfg)
    tokens, positions = tokens.repeat(2, 1), positions.repeat(2, 1)
    out = titan(tokens, positions=positions)
    ref = smelt(tokens, segment_ids_from_positions(positions))
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-6)
    assert events[:8] == ["counts"] * 4 + ["tokens"] * 4, events[:8]
    assert events.count("counts") == events.count("tokens") == 6 * 4  # 6 executed layers
