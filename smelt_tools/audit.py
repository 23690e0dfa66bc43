"""Static kernel audit for Hopper (sm_90a): what the compilers say, no GPU needed.

    python -m smelt_tools.audit [--json PATH] [--markdown PATH] [--only triton|cuda]

Every shipped Triton kernel configuration is compiled ahead of time the way a launch on an
H100/H200 would compile it: the launcher's real arguments at SMELT's shapes go through
Triton's own argument binder (so pointer alignment and integer divisibility specialise as on
the device), then LLVM and Triton's bundled ``ptxas``. Every CUDA kernel is compiled with
``nvcc -arch=sm_90a -Xptxas -v``. Per kernel and configuration the audit reports registers
per thread, spill stores and loads, shared memory (Triton: the dynamic shared memory the
launch asks for; CUDA: static shared memory), and the matrix instructions the PTX holds:
``wgmma`` (Hopper's warpgroup MMA), ``mma.sync`` or ``wmma``.

It needs Triton's bundled ptxas (the Triton part) and ``nvcc`` (the CUDA part); a missing
tool is one line on stderr and exit status 2. The first two lines of output name the tools.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

SM90_SHARED_LIMIT = 227 * 1024  # bytes of shared memory one block may use on sm_90
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_SOURCES = ("csrc/moe_gemm/cuda.cu", "csrc/attention/cuda.cu")

# The shapes the configurations are chosen for (SMELT's 200M cell and its baseline, top-8)
# and the rows per expert they are audited at: a 4k-token sequence and a 32k-token step.
MOE_SHAPES = {"smelt": dict(H=1056, de=352, E=288), "baseline": dict(H=1280, de=432, E=192)}
MOE_TOKENS = (4096, 32768)
TOP_K = 8
ATTENTION_HEAD_DIMS = (64, 72, 80, 88, 96, 112, 128)
ATTENTION_HEADS = (12, 2)  # query heads, KV heads


# ----------------------------------------------------------------------------- tools
def triton_ptxas() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    return path if os.path.exists(path) else None


def nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    path = os.path.join(home, "bin", "nvcc")
    return path if os.path.exists(path) else None


# ----------------------------------------------------------------------------- parsing
_FUNC = re.compile(r"Compiling entry function '([^']+)'")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(log: str) -> dict[str, dict]:
    """Per entry function: registers, stack, spill stores/loads and static shared memory
    from ``ptxas -v`` output."""
    out: dict[str, dict] = {}
    cur = None
    for line in log.splitlines():
        m = _FUNC.search(line)
        if m:
            cur = out.setdefault(
                m.group(1), dict(registers=0, stack=0, spill_stores=0, spill_loads=0, static_smem=0)
            )
            continue
        if cur is None:
            continue
        if m := _SPILL.search(line):
            cur["stack"], cur["spill_stores"], cur["spill_loads"] = map(int, m.groups())
        if m := _REGS.search(line):
            cur["registers"] = int(m.group(1))
        if m := _SMEM.search(line):
            cur["static_smem"] = int(m.group(1))
    return out


def mma_kind(ptx: str) -> str:
    """The matrix instructions in a PTX text: 'wgmma', 'mma.sync', 'wmma' (joined with '+'
    when mixed) or 'none'."""
    pats = (
        ("wgmma", r"wgmma\.mma_async"),
        ("mma.sync", r"(?<![\w.])mma\.sync"),
        ("wmma", r"wmma\.mma"),
    )
    kinds = [name for name, pat in pats if re.search(pat, ptx)]
    return "+".join(kinds) or "none"


def ptx_entries(ptx: str) -> dict[str, str]:
    """Split a PTX module into its entry functions' texts."""
    parts = re.split(r"\.visible \.entry |\.entry ", ptx)
    out = {}
    for part in parts[1:]:
        name = part.split("(", 1)[0].strip()
        out[name] = part
    return out


# ----------------------------------------------------------------------------- Triton
class TritonCompiler:
    """Compile a JIT kernel for sm_90a from launch arguments, without a GPU."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, compile, make_backend
        from triton.runtime.jit import create_function_from_signature

        self.target = GPUTarget("cuda", 90, 32)
        self.backend = make_backend(self.target)
        self._ast, self._compile, self._binder = ASTSource, compile, create_function_from_signature
        self._seen: dict = {}

    def compile(self, fn, args: tuple, kwargs: dict) -> dict:
        import triton

        binder = self._binder(fn.signature, fn.params, self.backend)
        bound, spec, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(
            self.backend, kwargs, bound, spec, options
        )
        key = (
            fn.__name__,
            repr(signature),
            repr(sorted(constexprs.items(), key=repr)),
            repr(sorted(attrs.items(), key=repr)),
            repr(sorted(options.__dict__.items(), key=repr)),
        )
        if key in self._seen:
            return dict(self._seen[key], reused=True)
        src = self._ast(fn, signature, constexprs, attrs)
        buf = io.StringIO()
        old = triton.knobs.nvidia.dump_ptxas_log
        triton.knobs.nvidia.dump_ptxas_log = True
        try:
            with contextlib.redirect_stdout(buf):
                kernel = self._compile(src, target=self.target, options=options.__dict__)
        finally:
            triton.knobs.nvidia.dump_ptxas_log = old
        log = buf.getvalue()
        if "Used" not in log:  # a cache hit skips ptxas: run it on the cached PTX
            log = self._ptxas(kernel.asm["ptx"])
        stats = next(iter(parse_ptxas(log).values()), None)
        if stats is None:
            raise RuntimeError(f"no ptxas report for {fn.__name__}")
        row = dict(
            registers=stats["registers"],
            spill_stores=stats["spill_stores"],
            spill_loads=stats["spill_loads"],
            stack_bytes=stats["stack"],
            shared_bytes=int(kernel.metadata.shared) + stats["static_smem"],
            mma=mma_kind(kernel.asm["ptx"]),
            num_warps=kernel.metadata.num_warps,
            num_stages=kernel.metadata.num_stages,
        )
        self._seen[key] = row
        return row

    @staticmethod
    def _ptxas(ptx: str) -> str:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "k.ptx")
            with open(path, "w") as f:
                f.write(ptx)
            out = subprocess.run(
                [
                    triton_ptxas(),
                    "-v",
                    "--gpu-name=sm_90a",
                    path,
                    "-o",
                    os.path.join(tmp, "k.cubin"),
                ],
                capture_output=True,
                text=True,
            )
            if out.returncode != 0:
                raise RuntimeError(out.stderr[-2000:])
            return out.stderr + out.stdout


def triton_jobs(shapes=None, head_dims=None) -> list[dict]:
    """Every shipped GPU configuration of the Triton kernels (or those at the named MoE
    shapes and head dims), as launch descriptions: dict(kernel, config, fn, args, kwargs, hot)."""
    shapes = {n: MOE_SHAPES[n] for n in (shapes or MOE_SHAPES)}
    return moe_launches(shapes, MOE_TOKENS, TOP_K) + attention_launches(
        head_dims or ATTENTION_HEAD_DIMS, ATTENTION_HEADS
    )


def moe_launches(shapes: dict, tokens, top_k: int) -> list[dict]:
    """The GPU launches of the MoE Triton kernels the static audit compiles: every kernel
    of forward, backward and the grouped GEMM, bf16, at each shape ({name: dict(H, de, E)})
    and token count, with the arguments their launchers pass (meta tensors: nothing is
    allocated)."""
    import torch

    from smelt_kernels.moe_gemm import routing
    from smelt_kernels.moe_gemm import triton as mt

    meta, cuda, bf16, i32, f32 = (
        torch.device("meta"),
        torch.device("cuda"),
        torch.bfloat16,
        torch.int32,
        torch.float32,
    )

    def t(*shape, dtype=bf16):
        return torch.empty(shape, dtype=dtype, device=meta)

    jobs, ms = [], dict(PREC=None, UPCAST=False)

    def job(kernel, fn, args, kwargs, label, hot=False):
        cfg = " ".join(
            f"{k}{v}" for k, v in kwargs.items() if k[:2] in ("BM", "BN", "BK", "BI", "BC")
        )
        jobs.append(
            dict(
                kernel=f"moe.{kernel}",
                fn=fn,
                args=args,
                kwargs=kwargs,
                hot=hot,
                config=f"bf16 {label} {cfg}",
            )
        )

    for name, sh in shapes.items():
        H, de, E = sh["H"], sh["de"], sh["E"]
        for T in tokens:
            TK = T * top_k
            m = TK / E
            label = f"{name} H{H} d_e{de} E{E} T{T} ({m:.0f} rows/expert)"
            x, w1, w2, dy = t(T, H), t(E, 2 * de, H), t(E, H, de), t(T, H)
            pre, hid, out, idx, tiles = (
                t(TK, 2 * de),
                t(TK, de),
                t(TK, H),
                t(TK, dtype=i32),
                t(64, dtype=i32),
            )
            up = mt.config(cuda, m, de, H, kind="up")
            job(
                "up_proj",
                mt._up_kernel,
                (
                    x,
                    w1,
                    idx,
                    tiles,
                    tiles,
                    tiles,
                    pre,
                    hid,
                    64,
                    H,
                    de,
                    x.stride(0),
                    w1.stride(0),
                    w1.stride(1),
                ),
                dict(up, **ms),
                label,
                hot=True,
            )
            down = dict(mt.config(cuda, m, H, de), BM=up["BM"])
            job(
                "down_proj",
                mt._rows_kernel,
                (
                    hid,
                    w2,
                    out,
                    tiles,
                    tiles,
                    tiles,
                    tiles,
                    64,
                    H,
                    de,
                    hid.stride(0),
                    w2.stride(0),
                    w2.stride(2),
                    w2.stride(1),
                    out.stride(0),
                    -1,
                ),
                dict(down, GATHER=False, **ms),
                label,
                hot=True,
            )
            job(
                "combine",
                mt._combine_kernel,
                (out, idx, t(TK, dtype=f32), dy, T, H, top_k),
                dict(HAS_W=True, BT=32, BH=128),
                label,
            )
            job(
                "dgrad_swiglu",
                mt._dh_kernel,
                (
                    dy,
                    w2,
                    pre,
                    t(TK, dtype=f32),
                    idx,
                    idx,
                    tiles,
                    tiles,
                    tiles,
                    pre,
                    hid,
                    t(8, TK, dtype=f32),
                    64,
                    TK,
                    H,
                    de,
                    dy.stride(0),
                    w2.stride(0),
                ),
                dict(mt.config(cuda, m, de, H, kind="dgrad"), **ms),
                label,
            )
            dx = dict(mt.config(cuda, m, H, 2 * de), BM=up["BM"])
            job(
                "dgrad_x",
                mt._rows_kernel,
                (
                    pre,
                    w1,
                    out,
                    tiles,
                    tiles,
                    tiles,
                    tiles,
                    64,
                    H,
                    2 * de,
                    pre.stride(0),
                    w1.stride(0),
                    w1.stride(1),
                    w1.stride(2),
                    out.stride(0),
                    -1,
                ),
                dict(dx, GATHER=False, **ms),
                label,
            )
            offs = t(E + 1, dtype=i32)
            for kname, L, R, il, ir, NI, NC, out_w in (
                ("wgrad_w1", pre, x, None, idx, 2 * de, H, w1),
                ("wgrad_w2", dy, hid, idx, None, H, de, w2),
            ):
                wc = mt._wgrad_config(cuda, NI, NC)
                job(
                    kname,
                    mt._wgrad_kernel,
                    (
                        L,
                        R,
                        out_w,
                        il if il is not None else offs,
                        ir if ir is not None else offs,
                        offs,
                        NI,
                        NC,
                        L.stride(0),
                        R.stride(0),
                        out_w.stride(0),
                        out_w.stride(1),
                    ),
                    dict(wc, GATHER_L=il is not None, GATHER_R=ir is not None, **ms),
                    label,
                )
            gm = mt.config(cuda, m, de, H)
            job(
                "grouped_mm",
                mt._rows_kernel,
                (
                    x,
                    w1,
                    hid,
                    idx,
                    tiles,
                    tiles,
                    tiles,
                    64,
                    de,
                    H,
                    x.stride(0),
                    w1.stride(0),
                    w1.stride(2),
                    w1.stride(1),
                    hid.stride(0),
                    E,
                ),
                dict(gm, GATHER=True, **ms),
                label,
            )
    # fp32 (IEEE products) at the first shape and token count: the up, down and dgrad GEMMs
    name, sh = next(iter(shapes.items()))
    H, de, E, T = sh["H"], sh["de"], sh["E"], tokens[0]
    m, fp = T * top_k / E, dict(PREC="ieee", UPCAST=False)
    x, w1, w2 = t(T, H, dtype=f32), t(E, 2 * de, H, dtype=f32), t(E, H, de, dtype=f32)
    pre, hid, tiles, idx = (
        t(T * top_k, 2 * de, dtype=f32),
        t(T * top_k, de, dtype=f32),
        t(64, dtype=i32),
        t(T * top_k, dtype=i32),
    )
    label = f"float32 {name} T{T}"
    up = mt.config(cuda, m, de, H, kind="up")
    jobs.append(
        dict(
            kernel="moe.up_proj",
            fn=mt._up_kernel,
            hot=False,
            config=f"{label} BM{up['BM']} BN{up['BN']}",
            args=(
                x,
                w1,
                idx,
                tiles,
                tiles,
                tiles,
                pre,
                hid,
                64,
                H,
                de,
                x.stride(0),
                w1.stride(0),
                w1.stride(1),
            ),
            kwargs=dict(up, **fp),
        )
    )
    down = dict(mt.config(cuda, m, H, de, dtype=f32), BM=up["BM"])
    jobs.append(
        dict(
            kernel="moe.down_proj",
            fn=mt._rows_kernel,
            hot=False,
            config=f"{label} BM{down['BM']} BN{down['BN']}",
            args=(
                hid,
                w2,
                x,
                tiles,
                tiles,
                tiles,
                tiles,
                64,
                H,
                de,
                hid.stride(0),
                w2.stride(0),
                w2.stride(2),
                w2.stride(1),
                x.stride(0),
                -1,
            ),
            kwargs=dict(down, GATHER=False, **fp),
        )
    )
    dh = mt.config(cuda, m, de, H, kind="dgrad")
    jobs.append(
        dict(
            kernel="moe.dgrad_swiglu",
            fn=mt._dh_kernel,
            hot=False,
            config=f"{label} BM{dh['BM']} BN{dh['BN']}",
            args=(
                x,
                w2,
                pre,
                t(T * top_k, dtype=f32),
                idx,
                idx,
                tiles,
                tiles,
                tiles,
                pre,
                hid,
                t(8, T * top_k, dtype=f32),
                64,
                T * top_k,
                H,
                de,
                x.stride(0),
                w2.stride(0),
            ),
            kwargs=dict(dh, **fp),
        )
    )
    count, scatter = routing._kernels()
    ids = t(4096 * top_k, dtype=i32)
    job("route_count", count, (ids, ids, ids.numel(), 288), dict(BLOCK=64, EB=64), "routing")
    job(
        "route_scatter",
        scatter,
        (ids, ids, ids, ids, ids, ids.numel(), 288, top_k),
        dict(BLOCK=64),
        "routing",
    )
    return jobs


def attention_launches(head_dims, heads, tokens: int = 4096) -> list[dict]:
    """The GPU launches the static audit compiles: forward, dK/dV and dQ in bf16 and in fp32
    at every head dim (segments, sink), from meta tensors shaped like one ``tokens``-long
    sequence (nothing is allocated)."""
    import torch

    from smelt_kernels.attention import triton as at

    meta, cuda = torch.device("meta"), torch.device("cuda")
    hq, hkv = heads
    jobs = []
    for dtype, D in [(torch.bfloat16, d) for d in head_dims] + [
        (torch.float32, d) for d in head_dims
    ]:
        da, dt = at.head_dim_split(D)
        name = "bf16" if dtype == torch.bfloat16 else "float32"
        label = f"{name} D{D} (blocks {da}{f'+{dt}' if dt else ''})"
        q = torch.empty((1, tokens, hq, D), dtype=dtype, device=meta)
        k = torch.empty((1, tokens, hkv, D), dtype=dtype, device=meta)
        stat = torch.empty((1, hq, tokens), dtype=torch.float32, device=meta)
        seg = torch.empty((1, tokens), dtype=torch.int32, device=meta)
        cfgs = {kind: at.block_config(kind, D, cuda, dtype) for kind in ("fwd", "dkdv", "dq")}
        launches = [
            (at._fwd_kernel, None)
            + at._fwd_launch(q, k, k, q, stat, stat, seg, 0.1, True, cfgs["fwd"])[1:]
        ]
        launches += at._bwd_launches(
            q, q, k, k, stat, stat, q, k, k, seg, seg, 0.1, cfgs["dkdv"], cfgs["dq"]
        )
        for kernel, _, args, kw in launches:
            if dtype == torch.float32:
                kw = dict(kw, PRECISION="ieee")
            name = {at._fwd_kernel: "forward", at._bwd_dkdv_kernel: "backward_dkdv"}.get(
                kernel, "backward_dq"
            )
            jobs.append(
                dict(
                    kernel=f"attention.{name}",
                    fn=kernel,
                    args=args,
                    kwargs=kw,
                    hot=(name, dtype) == ("forward", torch.bfloat16),
                    config=f"{label} BM{kw['BLOCK_M']} BN{kw['BLOCK_N']} heads {hq}/{hkv}",
                )
            )
    bf16 = torch.bfloat16
    jobs.append(
        dict(
            kernel="attention.backward_delta",
            fn=at._bwd_delta,
            hot=False,
            config="bf16 D88 BLOCK64",
            args=(torch.empty(8, dtype=bf16, device=meta),) * 2
            + (torch.empty(8, dtype=torch.float32, device=meta), tokens * hq, tokens, hq),
            kwargs=dict(D=88, D_PAD=128, BLOCK=64),
        )
    )
    return jobs


def audit_triton(progress, shapes=None, head_dims=None) -> list[dict]:
    compiler = TritonCompiler()
    rows = []
    jobs = triton_jobs(shapes, head_dims)
    for i, job in enumerate(jobs, 1):
        t0 = time.time()
        stats = compiler.compile(job["fn"], job["args"], job["kwargs"])
        row = dict(
            kernel=job["kernel"],
            config=job["config"],
            source="triton",
            hot=job["hot"],
            registers=stats["registers"],
            spill_bytes=stats["spill_stores"] + stats["spill_loads"],
            spill_stores=stats["spill_stores"],
            spill_loads=stats["spill_loads"],
            stack_bytes=stats["stack_bytes"],
            shared_bytes=stats["shared_bytes"],
            mma=stats["mma"],
            num_warps=stats["num_warps"],
            num_stages=stats["num_stages"],
        )
        rows.append(row)
        how = "same code as above" if stats.get("reused") else f"{time.time() - t0:.1f} s"
        progress(
            f"[{i}/{len(jobs)}] {row['kernel']} {row['config']}: {row['registers']} regs, "
            f"{row['spill_bytes']} B spilled, {row['shared_bytes']} B smem, {row['mma']} ({how})"
        )
    return rows


# ----------------------------------------------------------------------------- CUDA
def audit_cuda(progress, nvcc_path: str) -> list[dict]:
    rows = []
    for i, rel in enumerate(CUDA_SOURCES, 1):
        t0 = time.time()
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [
                nvcc_path,
                "-cubin",
                "-arch=sm_90a",
                "-Xptxas",
                "-v",
                "--expt-relaxed-constexpr",
                "-I",
                os.path.join(ROOT, "csrc"),
                "--keep",
                "--keep-dir",
                tmp,
                os.path.join(ROOT, rel),
                "-o",
                os.path.join(tmp, "k.cubin"),
            ]
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)
            if out.returncode != 0:
                raise RuntimeError(f"nvcc failed on {rel}:\n{out.stderr[-3000:]}")
            ptx = ""
            for name in os.listdir(tmp):
                if name.endswith(".ptx"):
                    with open(os.path.join(tmp, name)) as f:
                        ptx += f.read()
        entries = ptx_entries(ptx)
        for func, st in parse_ptxas(out.stderr + out.stdout).items():
            rows.append(
                dict(
                    kernel=_demangle(func),
                    config=f"{rel} sm_90a",
                    source="cuda",
                    hot=False,
                    registers=st["registers"],
                    spill_bytes=st["spill_stores"] + st["spill_loads"],
                    spill_stores=st["spill_stores"],
                    spill_loads=st["spill_loads"],
                    stack_bytes=st["stack"],
                    shared_bytes=st["static_smem"],
                    mma=mma_kind(entries.get(func, "")),
                    num_warps=None,
                    num_stages=None,
                )
            )
        progress(
            f"[cuda {i}/{len(CUDA_SOURCES)}] {rel}: {len(entries)} kernels "
            f"({time.time() - t0:.1f} s)"
        )
    return rows


def _demangle(name: str) -> str:
    """A readable name for a mangled CUDA kernel: its identifier (the last name of the nested
    name, past any anonymous namespace) and its template arguments, e.g.
    'rows_kernel<__nv_bfloat16, true>'."""
    if not name.startswith("_ZN"):
        return name
    pos, ident = 3, name
    while pos < len(name) and name[pos].isdigit():
        m = re.match(r"\d+", name[pos:])
        n = int(m.group())
        pos += len(m.group())
        ident = name[pos : pos + n]
        pos += n
    if pos >= len(name) or name[pos] != "I":
        return ident
    args = []
    for tok in re.finditer(
        r"(\d+)(__nv_bfloat16|__half)|6__half|Lb([01])E|Li(\d+)E|(?<=[IE])f", name[pos:]
    ):
        text = tok.group(0)
        if tok.group(2) or text == "6__half":
            args.append(tok.group(2) or "__half")
        elif tok.group(3) is not None:
            args.append("true" if tok.group(3) == "1" else "false")
        elif tok.group(4) is not None:
            args.append(tok.group(4))
        else:
            args.append("float")
    return f"{ident}<{', '.join(args)}>"


# ----------------------------------------------------------------------------- report
GPU_ONLY_BF16 = (
    "The bf16 tensor-core products themselves (wgmma with bf16 operands in every Triton MoE and "
    "attention GEMM): the interpreter's bf16 `tl.dot` is wrong, so the kernels' UPCAST switch "
    "feeds it fp32 copies of the bf16 tiles.",
    "Attention's P and dS rounded to bf16 before the PV, dS K and dS^T Q products: under UPCAST "
    "they stay fp32 in the interpreter.",
    "Round-to-nearest-even fp32 -> bf16 stores: Triton 3.6's interpreter truncates instead "
    "(the tests emulate that rounding there and expect nearest-even on a GPU).",
    "Every CUDA kernel (csrc/*/cuda.cu, bf16 and fp16): there is no interpreter for them.",
)


def to_markdown(rows: list[dict], tools: dict) -> str:
    lines = [
        "# Kernel audit for sm_90a (Hopper)",
        "",
        f"Compiled ahead of time, no GPU: Triton {tools.get('triton', '?')} with its bundled "
        f"ptxas; CUDA with {tools.get('nvcc', '?')}. Registers per thread, spills (stores + "
        "loads, bytes), shared memory per block (Triton: dynamic, what the launch asks for; "
        "CUDA: static) and the matrix instructions in the PTX. Limit: 227 KB shared memory.",
        "",
        "| kernel | config | regs | spill B | smem B | mma | warps | stages |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['kernel']}{' (hot)' if r['hot'] else ''} | {r['config']} | {r['registers']} | "
            f"{r['spill_bytes']} | {r['shared_bytes']} | {r['mma']} | {r['num_warps'] or ''} | "
            f"{r['num_stages'] or ''} |"
        )
    spills = [r for r in rows if r["spill_bytes"]]
    lines += [
        "",
        "Spills: none."
        if not spills
        else "Spills: "
        + "; ".join(f"{r['kernel']} ({r['config']}): {r['spill_bytes']} B" for r in spills)
        + ".",
    ]
    cuda = [r for r in rows if r["source"] == "cuda"]
    if cuda and not any("wgmma" in r["mma"] for r in cuda):
        kinds = sorted({r["mma"] for r in cuda} - {"none"})
        lines += [
            "",
            f"The CUDA kernels use {', '.join(kinds) or 'no matrix instructions'} only (no "
            "wgmma, no TMA; 'none' rows are gather/sum kernels): they run on "
            "Hopper at Ampere-style tensor-core rates. A Hopper-grade CUDA path (wgmma + TMA, "
            "for example on CUTLASS's grouped GEMM from the `nvidia-cutlass` package) is the "
            "next step there.",
        ]
    lines += ["", "## bf16 paths only a GPU can verify", ""] + [f"- {s}" for s in GPU_ONLY_BF16]
    lines += [
        "",
        "Checked without a GPU: the bf16 Triton MoE forward and attention forward and "
        "backward run in the interpreter on bf16 inputs with fp32 dots (UPCAST) and match an "
        "emulated reference (exact products of the bf16 inputs, outputs and stored "
        "intermediates rounded as the kernel rounds them) to one bf16 step; the MoE backward "
        "in bf16 is checked against the fp64 reference at bf16 tolerance.",
    ]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- command line
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m smelt_tools.audit", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--json", help="write the rows as a JSON list here")
    ap.add_argument("--markdown", help="write a Markdown table here")
    ap.add_argument("--only", choices=("triton", "cuda"), help="audit one kind of kernel")
    ap.add_argument(
        "--shapes", help=f"comma-separated MoE shapes (default all: {','.join(MOE_SHAPES)})"
    )
    ap.add_argument(
        "--head-dims",
        help="comma-separated attention head dims (default "
        f"{','.join(map(str, ATTENTION_HEAD_DIMS))})",
    )
    args = ap.parse_args(argv)
    shapes = args.shapes.split(",") if args.shapes else None
    if shapes and any(s not in MOE_SHAPES for s in shapes):
        print(
            f"audit: --shapes must name shapes from {', '.join(MOE_SHAPES)}; got {args.shapes}",
            file=sys.stderr,
        )
        return 2
    try:
        head_dims = [int(d) for d in args.head_dims.split(",")] if args.head_dims else None
    except ValueError:
        head_dims = []
    if head_dims is not None and not all(8 <= d <= 128 and d % 8 == 0 for d in head_dims):
        print(
            f"audit: --head-dims must be multiples of 8 from 8 to 128; got {args.head_dims}",
            file=sys.stderr,
        )
        return 2
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        # kernels defined under the interpreter cannot be compiled: rerun without it
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        return subprocess.call(
            [sys.executable, "-m", "smelt_tools.audit", *sys.argv[1:]]
            if argv is None
            else [sys.executable, "-m", "smelt_tools.audit", *argv],
            env=env,
        )
    need_triton, need_cuda = args.only in (None, "triton"), args.only in (None, "cuda")
    ptxas, nv = triton_ptxas(), nvcc()
    if need_triton and ptxas is None:
        print(
            "audit: Triton with its bundled ptxas is required (pip install triton); not found",
            file=sys.stderr,
        )
        return 2
    if need_cuda and nv is None:
        print(
            "audit: nvcc is required for the CUDA kernels (put it on PATH or set CUDA_HOME; "
            "--only triton skips them); not found",
            file=sys.stderr,
        )
        return 2

    def progress(msg):
        print(msg, file=sys.stderr, flush=True)

    tools = {}
    if need_triton:
        import triton

        tools["triton"] = triton.__version__
        progress(f"triton {triton.__version__}, ptxas {ptxas}")
    if need_cuda:
        ver = (
            subprocess.run([nv, "--version"], capture_output=True, text=True)
            .stdout.strip()
            .splitlines()
        )
        tools["nvcc"] = "nvcc " + (ver[-1] if ver else "?")
        progress(f"{tools['nvcc']} at {nv}")
    t0 = time.time()
    try:
        rows = (audit_triton(progress, shapes, head_dims) if need_triton else []) + (
            audit_cuda(progress, nv) if need_cuda else []
        )
    except RuntimeError as e:
        print(f"audit: compile failed: {str(e).splitlines()[0] if str(e) else e}", file=sys.stderr)
        return 1
    progress(f"{len(rows)} kernels audited in {time.time() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
            f.write("\n")
    md = to_markdown(rows, tools)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(md)
    if not args.json and not args.markdown:
        print(md)
    bad = [r for r in rows if r["spill_bytes"] or r["shared_bytes"] > SM90_SHARED_LIMIT]
    for r in bad:
        progress(
            f"over budget: {r['kernel']} {r['config']} ({r['spill_bytes']} B spilled, "
            f"{r['shared_bytes']} B smem)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
