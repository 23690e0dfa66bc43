"""smelt_kernels: Triton/CUDA/CPU kernels, drop-in layers and the looped-block executor for
SMELT models.

Import the op modules, or the layers built on them, directly::

    from smelt_kernels.moe_gemm import route, moe_ffn
    from smelt_kernels.attention import segment_attention
    from smelt_kernels.norm import rms_norm
    from smelt_kernels.attention import apply_rotary
    from smelt_kernels.layers import MoE, SegmentAttention, RMSNorm, Rotary
    from smelt_kernels.executor import LoopPlan, Executor, LoopedSpan

The native extensions (``smelt_kernels._cpu``, ``smelt_kernels._cuda``) are optional: the
registry (:mod:`smelt_kernels.backends`, imported by every op) loads them once, behind a
guard, and ``backends.report(device)`` says what runs and why. This file imports nothing.
"""

__version__ = "0.1.0"
