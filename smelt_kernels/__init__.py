"""smelt_kernels: Triton/CUDA/CPU kernels for SMELT models, their pure-torch references, the
one backend registry, and the drop-in layers built on them (and on transformers, in ``hf``).

Import the op modules, or the layers built on them, directly::

    from smelt_kernels.moe_gemm import route, moe_ffn
    from smelt_kernels.attention import segment_attention
    from smelt_kernels.norm import rms_norm
    from smelt_kernels.rotary import apply_rotary
    from smelt_kernels.layers import MoE, SegmentAttention, RMSNorm, Rotary

The native extensions (``smelt_kernels._cpu``, ``smelt_kernels._cuda``) are optional: the
registry (:mod:`smelt_kernels.backends`, imported by every op) loads them once, behind a
guard, and ``backends.report(device)`` says what runs and why. This file imports nothing.

The package owns ops and nothing else: it imports no model code (:mod:`smelt_model`), no
developer tools (:mod:`smelt_tools`) and nothing of ``bench``; the loop that runs a looped
model's blocks lives in :mod:`smelt_model`.
"""

__version__ = "0.1.0"
