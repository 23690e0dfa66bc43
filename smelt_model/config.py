"""Model configuration for the baseline and the SMELT looped MoE transformer.

One :class:`ModelConfig` describes both architectures: a config with ``loop=None`` is the
unlooped baseline; a config with a :class:`LoopSpec` runs the span ``[start, start+length)``
``count`` times with shared weights (SMELT: the middle 50% of the stack, twice).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from smelt_model.schedule import LoopSchedule

__all__ = ["LoopSpec", "ModelConfig", "middle_loop", "IGNORE_INDEX"]

#: the label value no loss counts (the convention of torch's cross-entropy and transformers)
IGNORE_INDEX = -100


def check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_float(name: str, value: Any, *, positive: bool = False, nonneg: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} ({value!r})")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    if nonneg and value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


@dataclass(frozen=True)
class LoopSpec:
    """A contiguous span of physical layers executed ``count`` times with shared weights.

    ``start`` is the 0-based index of the first span layer; the span covers physical layers
    ``start .. start + length - 1``. ``count`` is r, the number of visits (r = 1 is an
    ordinary stack). Inside the span every sublayer update is scaled by ``1 / count``.
    """

    start: int
    length: int
    count: int = 2

    def __post_init__(self) -> None:
        check_int("loop.start", self.start, 0)
        check_int("loop.length", self.length, 1)
        check_int("loop.count", self.count, 1)

    @property
    def end(self) -> int:
        """One past the last span layer (0-based, exclusive)."""
        return self.start + self.length

    def contains(self, layer: int) -> bool:
        return self.start <= layer < self.end

    def one_based(self) -> tuple[int, int]:
        """The span as 1-based inclusive layer numbers, as the paper writes it (e.g. 4-9)."""
        return self.start + 1, self.end


def middle_loop(n_layers: int, fraction: float = 0.5, count: int = 2) -> LoopSpec:
    """The paper's loop: the middle ``fraction`` of the stack, executed ``count`` times.

    m = round(fraction * L) layers (at least 1); floor((L - m) / 2) layers come before the
    span, the rest after. For L = 10, 12, 20, 30 this gives the 1-based spans 3-7, 4-9,
    6-15 and 8-22.
    """
    check_int("n_layers", n_layers, 1)
    _check_float("fraction", fraction, positive=True)
    if fraction > 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    length = max(1, int(math.floor(fraction * n_layers + 0.5)))
    length = min(length, n_layers)
    start = (n_layers - length) // 2
    return LoopSpec(start=start, length=length, count=count)


@dataclass(frozen=True)
class ModelConfig:
    """Geometry and options of a (looped) MoE transformer.

    Attention projects ``hidden_size`` to ``n_heads * head_dim`` queries and
    ``n_kv_heads * head_dim`` keys/values (GQA). Every FFN is a top-``top_k`` MoE of
    ``n_experts`` SwiGLU experts with intermediate size ``expert_size``.
    """

    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int
    expert_size: int
    top_k: int = 8
    loop: Optional[LoopSpec] = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    router_renormalize: bool = True
    aux_loss_weight: float = 0.01
    z_loss_weight: float = 0.0

    def __post_init__(self) -> None:
        for name, minimum in (
            ("vocab_size", 1),
            ("hidden_size", 1),
            ("n_layers", 1),
            ("n_heads", 1),
            ("n_kv_heads", 1),
            ("head_dim", 1),
            ("n_experts", 1),
            ("expert_size", 1),
            ("top_k", 1),
        ):
            check_int(name, getattr(self, name), minimum)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k ({self.top_k}) must be <= n_experts ({self.n_experts})")
        _check_float("rope_theta", self.rope_theta, positive=True)
        _check_float("norm_eps", self.norm_eps, positive=True)
        _check_float("aux_loss_weight", self.aux_loss_weight, nonneg=True)
        _check_float("z_loss_weight", self.z_loss_weight, nonneg=True)
        if not isinstance(self.router_renormalize, bool):
            raise TypeError("router_renormalize must be a bool")
        if self.loop is not None:
            if isinstance(self.loop, dict):  # tolerate dicts, e.g. from hand-written JSON
                object.__setattr__(self, "loop", LoopSpec(**self.loop))
            if not isinstance(self.loop, LoopSpec):
                raise TypeError(f"loop must be a LoopSpec or None, got {type(self.loop).__name__}")
            if self.loop.end > self.n_layers:
                raise ValueError(
                    f"loop span layers {self.loop.start}..{self.loop.end - 1} (0-based) lie "
                    f"outside the stack of n_layers={self.n_layers}"
                )

    # ------------------------------------------------------------------ derived geometry
    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def is_looped(self) -> bool:
        return self.loop is not None and self.loop.count > 1

    @property
    def schedule(self) -> LoopSchedule:
        """The loop schedule (:class:`smelt_model.schedule.LoopSchedule`): the executed layers in
        order, as (physical layer, visit) pairs by ``.pairs()``."""
        return LoopSchedule(self.n_layers, self.loop)

    @property
    def executed_layers(self) -> int:
        """L_eff = L + (r - 1) * m."""
        return self.schedule.executed_layers

    def residual_scale(self, layer: int) -> float:
        """Scale applied to each sublayer update of ``layer`` (1/r inside the span)."""
        return self.schedule.residual_scale(layer)

    # ------------------------------------------------------------------ (de)serialisation
    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["loop"] = None if self.loop is None else dataclasses.asdict(self.loop)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        if not isinstance(d, dict):
            raise TypeError(f"expected a dict, got {type(d).__name__}")
        fields = dataclasses.fields(cls)
        known = {f.name for f in fields}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig field(s): {', '.join(unknown)}")
        required = [f.name for f in fields if f.default is dataclasses.MISSING]
        missing = [name for name in required if name not in d]
        if missing:
            raise ValueError(f"missing ModelConfig field(s): {', '.join(missing)}")
        d = dict(d)
        loop = d.get("loop")
        if loop is not None:
            if not isinstance(loop, dict):
                raise TypeError(
                    f"loop must be an object with start, length, count or null, "
                    f"got {type(loop).__name__}"
                )
            loop_fields = {f.name for f in dataclasses.fields(LoopSpec)}
            bad = sorted(set(loop) - loop_fields)
            if bad:
                raise ValueError(f"unknown loop field(s): {', '.join(bad)}")
            if not {"start", "length"} <= set(loop):
                raise ValueError("loop needs start and length (count defaults to 2)")
            d["loop"] = LoopSpec(**loop)
        return cls(**d)

    def to_json(self, path: Union[str, Path, None] = None, indent: int = 2) -> str:
        text = json.dumps(self.to_dict(), indent=indent, sort_keys=True)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    @classmethod
    def from_json(cls, text_or_path: Union[str, Path]) -> "ModelConfig":
        """Parse a JSON string, or read a JSON file when given a path."""
        if isinstance(text_or_path, Path) or not str(text_or_path).lstrip().startswith("{"):
            source, text = f"{text_or_path}: ", Path(text_or_path).read_text()
        else:
            source, text = "", str(text_or_path)
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{source}malformed JSON ({e})") from None
        return cls.from_dict(d)

    def describe(self) -> str:
        loop = "none (baseline)"
        if self.loop is not None:
            a, b = self.loop.one_based()
            loop = f"layers {a}-{b} x{self.loop.count}"
        return (
            f"H={self.hidden_size} L={self.n_layers} heads={self.n_heads}/{self.n_kv_heads}"
            f"x{self.head_dim} experts={self.n_experts} top-{self.top_k} d_e={self.expert_size}"
            f" loop={loop}"
        )
