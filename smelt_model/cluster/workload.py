"""The options every communication count and projection shares, in one place.

:class:`Workload` holds the element types that travel (``dtype`` of the all-to-alls and
the gathered weights, ``reduce_dtype`` of the reduced gradients), the document mix the
FLOPs count assumes (``mean_doc_len`` in contexts of ``seq_len``), and whether a projected
step computes the output head (``head``: its matmul, ``6 x vocab x hidden`` FLOPs per token,
which F leaves out and a training step runs; False projects F's parts alone), and whose
expert compute and combine keep the activations (``experts``: ``"smelt"``, smelt's grouped
GEMM and dispatchers on torchtitan, or ``"stock"``, torchtitan's own; the memory each keeps
per routed row is :func:`smelt_model.cluster.footprint`'s).
:func:`~smelt_model.cluster.comm`, :func:`~smelt_model.cluster.ratios`,
:func:`~smelt_model.cluster.project`, :func:`~smelt_model.cluster.project_pair` and
:func:`~smelt_model.cluster.best_plan` take either ``workload=Workload(...)`` or the same names as
keywords (``dtype="float32"``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from smelt_model.budget.ledger import mean_attended

__all__ = ["DTYPE_BYTES", "EXPERTS", "Workload", "dtype_bytes", "workload_of"]

#: whose expert compute and combine a step runs (:attr:`Workload.experts`)
EXPERTS = ("smelt", "stock")

#: element sizes of the dtypes communication may use
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1}


def dtype_bytes(dtype: Any, name: str = "dtype") -> int:
    """Bytes per element of ``dtype``: a name from :data:`DTYPE_BYTES` or a torch dtype."""
    key = str(dtype).removeprefix("torch.")
    if key not in DTYPE_BYTES:
        raise ValueError(f"{name} must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    return DTYPE_BYTES[key]


@dataclass(frozen=True)
class Workload:
    """What travels and what the FLOPs assume (see the module docstring)."""

    dtype: str = "bfloat16"
    reduce_dtype: str = "float32"
    mean_doc_len: float = 800
    seq_len: int = 4096
    head: bool = True
    experts: str = "smelt"

    def __post_init__(self) -> None:
        if not isinstance(self.head, bool):
            raise TypeError(f"head must be a bool, got {self.head!r}")
        if self.experts not in EXPERTS:
            raise ValueError(f"experts must be one of {', '.join(EXPERTS)}, got {self.experts!r}")
        for name in ("dtype", "reduce_dtype"):
            value = getattr(self, name)
            dtype_bytes(value, name)
            object.__setattr__(self, name, str(value).removeprefix("torch."))
        mean_attended(self.mean_doc_len, self.seq_len)  # checks both

    @property
    def act_bytes(self) -> int:
        """Bytes per element of ``dtype``."""
        return DTYPE_BYTES[self.dtype]

    @property
    def reduce_bytes(self) -> int:
        """Bytes per element of ``reduce_dtype``."""
        return DTYPE_BYTES[self.reduce_dtype]

    @property
    def doc(self) -> tuple[float, int]:
        """``(mean_doc_len, seq_len)``, the ledger's arguments."""
        return self.mean_doc_len, self.seq_len


_FIELDS = tuple(f.name for f in dataclasses.fields(Workload))


def workload_of(workload: Optional[Workload], options: Mapping[str, Any], where: str) -> Workload:
    """``workload`` (default :class:`Workload`) with ``options`` (keywords of the same
    names) applied; TypeError naming ``where`` for anything else."""
    if workload is None:
        workload = Workload()
    elif not isinstance(workload, Workload):
        raise TypeError(f"workload must be a Workload, got {type(workload).__name__}")
    bad = sorted(set(options) - set(_FIELDS))
    if bad:
        raise TypeError(
            f"{where}() got unexpected keyword argument(s) {', '.join(bad)}; its workload "
            f"options are {', '.join(_FIELDS)}"
        )
    return dataclasses.replace(workload, **options) if options else workload
