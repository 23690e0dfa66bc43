"""The Triton kernels compile for Hopper (sm_90) ahead of time: LLVM and Triton's bundled
ptxas, no GPU needed. The interpreter accepts code that a real compile rejects."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ----------------------------------------------------------------------------- MoE kernels
_MOE_AOT_SCRIPT = r"""
import sys, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from smelt_kernels.moe_gemm import routing as moe_routing, triton as M

INT_PTRS = {"TOK", "TILE_E", "TILE_R0", "TILE_R1", "ORDER", "REV", "OFF", "IDX", "IDX_L", "IDX_R", "IDS",
            "COUNTS", "BASE"}
F32_PTRS = {"TW", "DTWP"}
SCALARS = {"H", "DE", "N", "K", "T", "NI", "NC", "K_TOP", "E"}

def build(kernel, dtype, consts, num_warps=4, num_stages=3):
    sig, cvals = {}, {}
    for i, p in enumerate(kernel.params):
        if p.is_constexpr:
            sig[p.name], cvals[(i,)] = "constexpr", consts[p.name]
        elif p.name in INT_PTRS:
            sig[p.name] = "*i32"
        elif p.name in F32_PTRS:
            sig[p.name] = "*fp32"
        elif p.name[0].isupper() and p.name not in SCALARS:
            sig[p.name] = "*" + dtype
        else:
            sig[p.name] = "i32"
    k = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=cvals),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))
    assert "cubin" in k.asm and k.metadata.shared <= 227 * 1024, (kernel, k.metadata.shared)

dtype, prec = sys.argv[1], (None if sys.argv[2] == "none" else sys.argv[2])
cuda = torch.device("cuda")
cfg = M.config(cuda, 200.0)
nw, ns = cfg.pop("num_warps"), cfg.pop("num_stages")
wcfg = M._wgrad_config(cuda)
wnw, wns = wcfg.pop("num_warps"), wcfg.pop("num_stages")
meta = dict(PREC=prec, UPCAST=False)
build(M._up_kernel, dtype, dict(cfg, **meta), nw, ns)
build(M._rows_kernel, dtype, dict(cfg, GATHER=True, **meta), nw, ns)
build(M._dh_kernel, dtype, dict(cfg, **meta), nw, ns)
build(M._wgrad_kernel, dtype, dict(wcfg, GATHER_L=True, GATHER_R=False, **meta), wnw, wns)
build(M._combine_kernel, dtype, dict(HAS_W=True, BT=32, BH=128))
if dtype == "bf16":
    count, scatter = moe_routing._kernels()
    build(M._rows_kernel, dtype, dict(cfg, GATHER=False, **meta), nw, ns)
    build(count, "i32", dict(BLOCK=64, EB=64))
    build(scatter, "i32", dict(BLOCK=64))
print("built")
"""


@pytest.mark.parametrize("dtype, prec", [("bf16", "none"), ("fp32", "ieee")])
def test_triton_kernels_compile_for_hopper(dtype, prec):
    """The interpreter accepts code the GPU compiler rejects: build every kernel for sm_90 with
    the GPU tile configuration (ahead of time: PTX and ptxas, no GPU needed)."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="0")
    out = subprocess.run([sys.executable, "-c", _MOE_AOT_SCRIPT, dtype, prec], capture_output=True, text=True,
                         env=env, cwd=ROOT)
    assert out.returncode == 0 and "built" in out.stdout, out.stderr[-3000:]


# ----------------------------------------------------------------------------- attention kernels
_ATTENTION_AOT_SCRIPT = r"""
import os
os.environ.pop("TRITON_INTERPRET", None)
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from smelt_kernels.attention import triton as at

PTRS = {"Q", "K", "V", "O", "DO", "DK", "DV", "DQ", "LSE", "PSINK", "DELTA", "START", "END"}
STATS = {"LSE", "PSINK", "DELTA"}


def build(kernel, kind, D, extra):
    dp = at.head_dim_pad(D)
    cfg = at.block_config(kind, dp, torch.device("cuda"), torch.bfloat16)
    opts = dict(num_warps=cfg.pop("num_warps"), num_stages=cfg.pop("num_stages"))
    consts = dict(G=6, D=D, D_PAD=dp, HAS_SEG=True, PRECISION=None, UPCAST=False, **cfg, **extra)
    consts = {k: v for k, v in consts.items() if k in kernel.arg_names}
    sig, attrs = {}, {}
    for i, n in enumerate(kernel.arg_names):
        if n in consts:
            sig[n] = "constexpr"
        elif n in PTRS:
            sig[n] = "*fp32" if n in STATS else "*i32" if n in ("START", "END") else "*bf16"
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[n] = "fp32" if n.endswith("scale") else "i32"
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    assert compiled.asm["cubin"], kernel
    print(kernel.__name__, D, "ok")


for D in (88, 128):
    build(at._fwd_kernel, "fwd", D, dict(WANT_SINK=True))
    build(at._bwd_dq_kernel, "dq", D, {})
    build(at._bwd_dkdv_kernel, "dkdv", D, {})
build(at._bwd_delta, "dq", 88, dict(BLOCK=64))
"""


def test_triton_kernels_compile_for_sm90a():
    """Compile the GPU configurations ahead of time for Hopper (LLVM + Triton's bundled
    ptxas, no device needed): the interpreter accepts code a real compile rejects."""
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("this Triton install has no bundled ptxas")
    out = subprocess.run([sys.executable, "-c", _ATTENTION_AOT_SCRIPT], capture_output=True, text=True,
                         cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.count(" ok") == 7, out.stdout
