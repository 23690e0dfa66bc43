"""Generation with a static KV cache that has one slot per *executed* layer.

A span layer's second visit recomputes Q, K, V from the updated residual stream, so it has
K/V of its own: the cache holds ``executed_layers`` slots, exactly as the ledger counts KV
bytes. The prompt is prefilled with the segment-masked attention kernel; each decode step
then attends from the new token to the cache (the kernel's decode form).

:class:`DecodeStep` is that single-token step without per-layer dispatch overhead: the whole
step (every executed layer, the head) compiled once with ``torch.compile``, the cache
position a symbolic int so that it compiles once, not once per position. Where compiling is
unavailable it runs eager and says why (:attr:`DecodeStep.reason`).
"""

from __future__ import annotations

import os
import shutil
import warnings
from typing import Optional

import torch

from smelt_kernels import opdef

__all__ = ["KVCache", "CacheSlot", "DecodeStep", "generate", "compile_unavailable"]

#: ``generate(compile=None)`` compiles the decode step from this many new tokens on: a
#: compile costs seconds to a minute, a few dozen eager steps much less.
COMPILE_MIN_TOKENS = 256
#: the ``torch.compile`` compiler (its ``backend=``) of :class:`DecodeStep` when none is given
DEFAULT_COMPILER = "inductor"


def _write(cache_k, cache_v, cache_seg, k, v, segment_ids, slot, pos):
    end = pos + k.shape[1]
    cache_k[slot, :, pos:end] = k
    cache_v[slot, :, pos:end] = v
    if segment_ids is not None:
        cache_seg[:, pos:end] = segment_ids


# :meth:`KVCache.update`'s writes as one in-place operator, what compiled steps call
# (registered like every smelt operator; a mutating ``torch.library.custom_op`` would cost
# about 60 us more per call in checks, once per executed layer of every decode step)
_KV_CACHE_WRITE = opdef.define(
    "kv_cache_write",
    "(Tensor(a!) cache_k, Tensor(b!) cache_v, Tensor(c!) cache_seg, Tensor k, Tensor v, "
    "Tensor? segment_ids, SymInt slot, SymInt pos) -> ()",
    _write,
    lambda cache_k, cache_v, cache_seg, k, v, segment_ids, slot, pos: None,
)


class KVCache:
    """Static K/V buffers: ``k``, ``v`` of shape (slots, B, max_len, n_kv_heads, head_dim),
    and the segment ids of the cached positions, (B, max_len)."""

    def __init__(
        self,
        slots: int,
        batch: int,
        max_len: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device=None,
    ):
        for name, v in (
            ("slots", slots),
            ("batch", batch),
            ("max_len", max_len),
            ("n_kv_heads", n_kv_heads),
            ("head_dim", head_dim),
        ):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        shape = (slots, batch, max_len, n_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.segment_ids = torch.zeros(batch, max_len, dtype=torch.int64, device=device)
        self.max_len = max_len

    @classmethod
    def for_config(
        cls, cfg, batch: int, max_len: int, dtype: torch.dtype = torch.float32, device=None
    ) -> "KVCache":
        """A cache with one slot per executed layer of ``cfg``."""
        return cls(
            cfg.executed_layers,
            batch,
            max_len,
            cfg.n_kv_heads,
            cfg.head_dim,
            dtype=dtype,
            device=device,
        )

    @classmethod
    def for_model(
        cls, model, batch: int, max_len: int, dtype: Optional[torch.dtype] = None
    ) -> "KVCache":
        w = model.embed.weight
        return cls.for_config(model.cfg, batch, max_len, dtype=dtype or w.dtype, device=w.device)

    @property
    def nbytes(self) -> int:
        """Bytes of K and V (the segment-id row is bookkeeping, not counted)."""
        return self.k.nbytes + self.v.nbytes

    def bytes_per_token(self) -> float:
        return self.nbytes / (self.k.shape[1] * self.max_len)

    def update(
        self,
        slot: int,
        pos: int,
        k: torch.Tensor,
        v: torch.Tensor,
        segment_ids: Optional[torch.Tensor],
    ):
        """Write this call's K/V at ``pos`` of ``slot``; return all K/V/segments so far."""
        T = k.shape[1]
        end = pos + T
        if end > self.max_len:
            raise ValueError(f"the cache holds {self.max_len} positions; writing up to {end}")
        seg = segment_ids if slot == 0 else None
        if torch.compiler.is_compiling():
            # one op that writes the buffers in place: written as slice assignments, the
            # traced graph would rebuild every buffer functionally and copy it back whole at
            # the end, so that a compiled step cost O(max_len), not O(pos)
            _KV_CACHE_WRITE(self.k, self.v, self.segment_ids, k, v, seg, slot, pos)
        else:
            _write(self.k, self.v, self.segment_ids, k, v, seg, slot, pos)
        return self.k[slot, :, :end], self.v[slot, :, :end], self.segment_ids[:, :end]

    def slot(self, slot: int, pos: int) -> "CacheSlot":
        """One executed layer's view for a call whose tokens start at ``pos``: what
        :class:`smelt_kernels.layers.SegmentAttention` takes as ``kv_cache``."""
        return CacheSlot(self, slot, pos)


class CacheSlot:
    """Slot ``slot`` of a :class:`KVCache`, written at ``pos``: ``update(k, v, segment_ids)``
    stores this call's K/V and returns all K/V/segment ids cached so far."""

    __slots__ = ("cache", "index", "pos")

    def __init__(self, cache: KVCache, index: int, pos: int):
        self.cache, self.index, self.pos = cache, index, pos

    def update(self, k: torch.Tensor, v: torch.Tensor, segment_ids: Optional[torch.Tensor]):
        return self.cache.update(self.index, self.pos, k, v, segment_ids)


def _sample(
    logits: torch.Tensor,
    temperature: float,
    top_k: Optional[int],
    generator: Optional[torch.Generator],
) -> torch.Tensor:
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def compile_unavailable(device: torch.device | str = "cpu") -> Optional[str]:
    """None when ``torch.compile`` can build a decode step for ``device``, else why not."""
    try:
        # seconds to load: only when a compiled decode step is asked for
        import torch._dynamo as dynamo
    except ImportError as e:  # pragma: no cover - every supported torch has it
        return f"torch.compile is unavailable ({e})"
    if not dynamo.is_dynamo_supported():
        return "torch.compile does not support this Python version"
    if torch.device(device).type == "cpu":
        names = [os.environ.get("CXX"), "g++", "c++", "clang++"]
        if not any(n and shutil.which(n) for n in names):
            return "torch.compile on the CPU needs a C++ compiler (none found: set CXX)"
    return None


def _decode_call(model, ids, segment_ids, cache, pos):
    return model(ids, segment_ids, cache=cache, cache_pos=pos).logits[:, -1]


_COMPILED: dict[object, object] = {}


def _compiled(compiler):
    # One compiled function per compiler, shared by every model: modules are arguments (their
    # parameters are graph inputs), so a new model of the same shapes reuses the graph, and
    # ``dynamic=True`` makes the cache position symbolic from the first call.
    if compiler not in _COMPILED:
        _COMPILED[compiler] = torch.compile(
            _decode_call, fullgraph=True, dynamic=True, backend=compiler
        )
    return _COMPILED[compiler]


def _specialising_floats(fn, *args):
    # With ``dynamic=True`` every float the model holds (a norm's eps, a step's residual
    # scale) would be a symbolic input; torch then fails to turn some of them into tensors
    # and traces the whole step a second time with them constant. Constant from the start:
    # one trace, ~40% less compile time, and each float guarded like any constant (a model
    # with another eps gets a graph of its own). Set per call, not for the process: other
    # compiled code keeps torch's default.
    config = torch._dynamo.config
    before = config.specialize_float
    config.specialize_float = True
    try:
        return fn(*args)
    finally:
        config.specialize_float = before


class DecodeStep:
    """``step(ids, segment_ids, cache, pos)`` -> next-token logits (B, V) of ``model``.

    Equal to ``model(ids, segment_ids, cache=cache, cache_pos=pos).logits[:, -1]`` (ids and
    segment ids (B, 1), the cache written at ``pos``). ``compile``: True compiles the step
    with ``compiler`` (what ``torch.compile`` takes as ``backend=``; default
    :data:`DEFAULT_COMPILER`); False runs eager. When compiling is unavailable or fails, the
    step runs eager, warns once, and keeps the reason in :attr:`reason`; :attr:`compiled`
    says which one runs.
    """

    def __init__(self, model, compile: bool = True, compiler=None):
        self.model = model
        self.compiler = DEFAULT_COMPILER if compiler is None else compiler
        self.reason: Optional[str] = None if compile else "compile=False"
        if compile:
            self.reason = compile_unavailable(next(model.parameters()).device)
            if self.reason is not None:
                warnings.warn(f"decode step runs eager: {self.reason}", stacklevel=2)
        self._fn = _compiled(self.compiler) if self.reason is None else None

    @property
    def compiled(self) -> bool:
        return self._fn is not None

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, segment_ids: torch.Tensor, cache, pos: int):
        if self._fn is not None:
            # The graph guards on its inputs' strides: a column sliced from a wider tensor
            # (stride T) compiles again whenever T happens to meet a relation of the symbolic
            # sizes (T == pos + 1, say). A contiguous (B, 1) copy costs nothing and never does.
            ids, segment_ids = (
                t.contiguous() if isinstance(t, torch.Tensor) else t for t in (ids, segment_ids)
            )
            try:
                return _specialising_floats(self._fn, self.model, ids, segment_ids, cache, pos)
            except Exception as e:  # noqa: BLE001 - decided below: bad input or compiler
                out = _decode_call(self.model, ids, segment_ids, cache, pos)  # bad input raises
                self._fn = None
                self.reason = f"torch.compile failed ({type(e).__name__}: {str(e)[:200]})"
                warnings.warn(f"decode step runs eager: {self.reason}", stacklevel=2)
                return out
        return _decode_call(self.model, ids, segment_ids, cache, pos)


@torch.no_grad()
def generate(
    model,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    *,
    segment_ids: Optional[torch.Tensor] = None,
    use_cache: bool = True,
    generator: Optional[torch.Generator] = None,
    compile: Optional[bool] = None,
) -> torch.Tensor:
    """Continue ``prompt_ids`` (B, T) by ``max_new_tokens``; returns (B, T + n).

    ``temperature=0`` is greedy decoding; ``top_k`` restricts sampling to the k most likely
    tokens. ``segment_ids`` (B, T) may pack several documents in the prompt; new tokens
    continue the last one. ``use_cache=False`` recomputes the whole sequence every step
    (the reference the cache is tested against). ``compile``: run the cached decode steps
    through a compiled :class:`DecodeStep` (None: when ``max_new_tokens`` is at least
    ``COMPILE_MIN_TOKENS``; it falls back to eager with a warning when compiling is
    unavailable).
    """
    if not isinstance(prompt_ids, torch.Tensor) or prompt_ids.dim() != 2:
        raise ValueError("prompt_ids must be a (batch, seq) tensor")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
    if not (temperature >= 0):
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
    if compile not in (None, True, False):
        raise ValueError(f"compile must be None, True or False, got {compile!r}")
    was_training = model.training
    model.eval()
    try:
        B, T = prompt_ids.shape
        out = torch.empty(B, T + max_new_tokens, dtype=prompt_ids.dtype, device=prompt_ids.device)
        out[:, :T] = prompt_ids
        seg = torch.zeros_like(out) if segment_ids is None else torch.empty_like(out)
        if segment_ids is not None:
            seg[:, :T] = segment_ids
            seg[:, T:] = segment_ids[:, -1:]
        if max_new_tokens == 0:
            return out
        if not use_cache:
            for i in range(max_new_tokens):
                n = T + i
                logits = model(out[:, :n], seg[:, :n]).logits[:, -1]
                out[:, n] = _sample(logits, temperature, top_k, generator)
            return out
        cache = KVCache.for_model(model, B, T + max_new_tokens)
        logits = model(prompt_ids, seg[:, :T], cache=cache, cache_pos=0).logits[:, -1]
        if compile is None:
            compile = max_new_tokens >= COMPILE_MIN_TOKENS
        step = DecodeStep(model, compile=compile)
        for i in range(max_new_tokens):
            n = T + i
            out[:, n] = _sample(logits, temperature, top_k, generator)
            if i + 1 < max_new_tokens:
                logits = step(out[:, n : n + 1], seg[:, n : n + 1], cache, n)
        return out
    finally:
        model.train(was_training)
