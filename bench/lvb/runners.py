"""One architecture's measured calls: a training step, a prefill, a decode step, and the
account of a step (where its time goes, part by part); :func:`measure_block` measures them
all for one block of one round, with a :class:`~smelt_tools.watch.Watch` on each row's timed
calls.

Each runner builds the inputs and state for one architecture and returns a callable that
performs one measured call, plus facts about it.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from smelt_model.budget.memory import peak_rss
from smelt_model.config import ModelConfig
from smelt_model.executor import activation_memory, maybe_capture
from smelt_model.generation import DecodeStep, KVCache
from smelt_model.model import SmeltLM
from smelt_model.train.trainer import adamw
from smelt_tools.timing import measure, release_memory

from .account import account_step, ceiling, gemm_reference, gemm_shapes
from .workload import Workload, decode_cache_len, decode_warmup, packed_segments

__all__ = [
    "build",
    "train_runner",
    "prefill_runner",
    "decode_runner",
    "account_of",
    "measure_block",
]


def build(cfg: ModelConfig, device, dtype, backend, recompute):
    """The model of ``cfg``, seeded: the same weights every time it is built."""
    torch.manual_seed(0)
    model = SmeltLM(cfg, backend=backend, recompute=recompute)
    return model.to(device=device, dtype=dtype)


def _cuda_peak(fn: Callable[[], Any], device: torch.device) -> Optional[int]:
    """Peak CUDA memory of one call above what was allocated before it (None elsewhere)."""
    if device.type != "cuda":
        return None
    return activation_memory(fn, device=device)[1].peak_allocated_bytes


def _batch(model, wl: Workload, device, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, model.cfg.vocab_size, (wl.batch, wl.seq_len), generator=g).to(device)
    return ids, packed_segments(wl.batch, wl.seq_len, wl.mean_doc_len, device)


def train_runner(model, wl: Workload, device, args):
    """A training step; gradients stay allocated between steps (zeroed, not freed), so
    memory is the steady state's."""
    ids, seg = _batch(model, wl, device, 0)
    model.train()
    cuda = device.type == "cuda"
    opt = adamw(model.parameters(), lr=1e-4, capturable=cuda)

    def step(i, s):
        out = model(i, s, labels=i)
        loss = out.loss + out.aux_loss if out.aux_loss is not None else out.loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return out.loss.detach()

    runner = maybe_capture(step, [ids, seg], capture=args.capture and cuda)
    info = {
        "tokens": wl.tokens,
        "captured": runner.graph is not None,
        "capture_note": getattr(runner, "reason", None),
        "optimizer": "AdamW, fused" if opt.param_groups[0]["fused"] else "AdamW",
    }
    return (lambda: runner(ids, seg)), info, (ids, seg), opt


def prefill_runner(model, wl: Workload, device, args):
    """A forward over the workload's tokens without gradients."""
    ids, seg = _batch(model, wl, device, 1)
    model.eval()

    def fwd(i, s):
        with torch.no_grad():
            return model(i, s).logits

    runner = maybe_capture(fwd, [ids, seg], capture=args.capture and device.type == "cuda")
    info = {"tokens": wl.tokens, "captured": runner.graph is not None}
    return (lambda: runner(ids, seg)), info


def decode_runner(model, wl: Workload, B: int, device, args):
    """One greedy decode step per call, on a cache prefilled with a ``decode_prompt`` prompt,
    through :class:`DecodeStep` (compiled unless ``--eager-decode``)."""
    model.eval()
    g = torch.Generator(device="cpu").manual_seed(2)
    P = wl.decode_prompt
    prompt = torch.randint(0, model.cfg.vocab_size, (B, P), generator=g).to(device)
    seg1 = torch.zeros(B, 1, dtype=torch.long, device=device)
    cache = KVCache.for_model(model, B, decode_cache_len(wl, args))
    with torch.no_grad():
        logits = model(prompt, torch.zeros_like(prompt), cache=cache, cache_pos=0).logits
    state = {"tok": logits[:, -1].argmax(-1, keepdim=True), "pos": P}
    step = DecodeStep(model, compile=not args.eager_decode)

    def one():
        lg = step(state["tok"], seg1, cache, state["pos"])
        state["tok"] = lg.argmax(-1, keepdim=True)
        state["pos"] += 1

    info = {
        "batch": B,
        "context": P + decode_warmup(args) + wl.decode_steps // 2,
        "cache_bytes": cache.nbytes,
    }
    return one, info, step


def account_of(model, fn, wl: Workload, train: bool, args, device) -> Optional[dict[str, Any]]:
    """The account of the step ``fn`` (:mod:`.account`): its parts measured inside profiled
    steps, re-taken (up to ``--max-tries``) while the profiled step exceeds the plain one by
    more than ``--tolerance``; the host's GEMM time for each part's GEMMs and its GEMM
    ceiling, measured right after. None on CUDA (a CUDA step's time is on the device, not in
    the host's events)."""
    if device.type != "cpu":
        return None
    tries = 1
    acc = account_step(model, fn, args.account_steps)
    while acc.overhead > args.tolerance and tries < args.max_tries:
        tries += 1
        acc = account_step(model, fn, args.account_steps)
    shapes = gemm_shapes(model.cfg, wl.tokens, train)
    return dict(acc.to_dict(), tries=tries, gemm_ms=gemm_reference(shapes), ceiling=ceiling())


def measure_block(
    cfg: ModelConfig,
    wl: Workload,
    args,
    device,
    dtype,
    modes,
    first: bool,
    watch,
    account: bool = True,
) -> dict[str, Any]:
    """One architecture's block of one round: build it, measure every mode, free it.

    Train and prefill time the step (:func:`smelt_tools.timing.measure`) and, with
    ``account`` (the first ``--account-rounds``), then profile it for the account
    (:func:`account_of`); every row's timing carries what ``watch`` saw while it was timed
    (``Timing.load``). The first block of a run also records the activations a step saves
    and, on CUDA, its peak allocation."""
    model = build(cfg, device, dtype, args.backend, args.recompute)
    timed = dict(device=device, warmup=args.warmup, repeats=args.repeats, watch=watch)
    out: dict[str, Any] = {
        "params_total": model.num_params("total"),
        "params_active": model.num_params("active"),
    }
    if "train" in modes:
        fn, info, (ids, seg), opt = train_runner(model, wl, device, args)
        out["train"] = dict(info, step=measure(fn, **timed))
        if account:
            out["train"]["account"] = account_of(model, fn, wl, True, args, device)
        if first:
            params = list(model.parameters())
            act = activation_memory(
                lambda: model(ids, seg, labels=ids).loss,  # noqa: F821 (model is deleted later)
                device=device,
                exclude=params,
            )[1]  # graph freed here
            del params
            out["train"].update(activation_bytes=act.saved_bytes, peak_bytes=_cuda_peak(fn, device))
        del fn, opt
        model.zero_grad(set_to_none=True)
    if "prefill" in modes:
        fn, info = prefill_runner(model, wl, device, args)
        out["prefill"] = dict(
            info,
            step=measure(fn, **timed),
            peak_bytes=_cuda_peak(fn, device) if first else None,
        )
        if account:
            out["prefill"]["account"] = account_of(model, fn, wl, False, args, device)
        del fn
    if "decode" in modes:
        out["decode"] = {}
        for B in wl.decode_batches:
            fn, info, step = decode_runner(model, wl, B, device, args)
            t = measure(
                fn, device=device, warmup=decode_warmup(args), repeats=wl.decode_steps, watch=watch
            )
            out["decode"][f"batch{B}"] = dict(
                info, timing=t, compiled=step.compiled, eager_reason=step.reason
            )
            del fn, step
    del model
    release_memory()
    out["peak_rss_bytes"] = peak_rss()
    return out
