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

It needs Triton's bundled ptxas (the Triton part) and ``nvcc`` (the CUDA part). Bad options,
output paths that cannot be written (``--json``, ``--markdown``: checked before any work) and
a missing tool are one line ``python -m smelt_tools.audit: error: ...`` on stderr and exit
status 2; a kernel that fails to compile, one line and exit status 1. The first two lines of
output name the tools. The launches compiled are described in :mod:`.launches`.
"""

from __future__ import annotations

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

from ..cli import CommandError, Parser, UsageError, command, output_path
from .launches import triton_jobs  # what is compiled: every shipped configuration

SM90_SHARED_LIMIT = 227 * 1024  # bytes of shared memory one block may use on sm_90
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
        # optional (Linux only): without it the audit says its Triton part cannot run
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
        # Triton, optional: only when its kernels are compiled (see triton_ptxas)
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, compile, make_backend
        from triton.runtime.jit import create_function_from_signature

        self.target = GPUTarget("cuda", 90, 32)
        self.backend = make_backend(self.target)
        self._ast, self._compile, self._binder = ASTSource, compile, create_function_from_signature
        self._seen: dict = {}

    def compile(self, fn, args: tuple, kwargs: dict) -> tuple[dict, bool]:
        """(what :func:`_row` takes: ptxas's report, shared memory, matrix instructions,
        warps, stages; whether the same code was compiled before)."""
        # optional, as in __init__
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
            return self._seen[key], True
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
            ptxas=stats,
            shared_bytes=int(kernel.metadata.shared) + stats["static_smem"],
            mma=mma_kind(kernel.asm["ptx"]),
            num_warps=kernel.metadata.num_warps,
            num_stages=kernel.metadata.num_stages,
        )
        self._seen[key] = row
        return row, False

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


def _row(kernel, config, source, hot, ptxas, shared_bytes, mma, num_warps=None, num_stages=None):
    """One row of the audit: a kernel's configuration, what ``ptxas -v`` said of it
    (registers, stack, spill stores and loads), its shared memory and matrix instructions."""
    return dict(
        kernel=kernel,
        config=config,
        source=source,
        hot=hot,
        registers=ptxas["registers"],
        spill_bytes=ptxas["spill_stores"] + ptxas["spill_loads"],
        spill_stores=ptxas["spill_stores"],
        spill_loads=ptxas["spill_loads"],
        stack_bytes=ptxas["stack"],
        shared_bytes=shared_bytes,
        mma=mma,
        num_warps=num_warps,
        num_stages=num_stages,
    )


def audit_triton(progress, shapes=None, head_dims=None) -> list[dict]:
    compiler = TritonCompiler()
    rows = []
    jobs = triton_jobs(shapes, head_dims)
    for i, job in enumerate(jobs, 1):
        t0 = time.time()
        stats, reused = compiler.compile(job["fn"], job["args"], job["kwargs"])
        row = _row(job["kernel"], job["config"], "triton", job["hot"], **stats)
        rows.append(row)
        how = "same code as above" if reused else f"{time.time() - t0:.1f} s"
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
                _row(
                    _demangle(func),
                    f"{rel} sm_90a",
                    "cuda",
                    False,
                    st,
                    st["static_smem"],
                    mma_kind(entries.get(func, "")),
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
PROG = "python -m smelt_tools.audit"


def _parser() -> Parser:
    p = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the rows as a JSON list here")
    p.add_argument("--markdown", help="write a Markdown table here")
    p.add_argument("--only", choices=("triton", "cuda"), help="audit one kind of kernel")
    p.add_argument(
        "--shapes", help=f"comma-separated MoE shapes (default all: {','.join(MOE_SHAPES)})"
    )
    p.add_argument(
        "--head-dims",
        help="comma-separated attention head dims (default "
        f"{','.join(map(str, ATTENTION_HEAD_DIMS))})",
    )
    return p


def _options(args) -> tuple:
    """(MoE shapes, head dims, tools) of the parsed options, checked before any work;
    UsageError for a bad value or a missing tool."""
    args.json = output_path(args.json, "--json")
    args.markdown = output_path(args.markdown, "--markdown")
    shapes = args.shapes.split(",") if args.shapes else None
    if shapes and any(s not in MOE_SHAPES for s in shapes):
        raise UsageError(
            f"--shapes must name shapes from {', '.join(MOE_SHAPES)}; got {args.shapes}"
        )
    try:
        head_dims = [int(d) for d in args.head_dims.split(",")] if args.head_dims else None
    except ValueError:
        head_dims = []
    if head_dims is not None and not all(8 <= d <= 128 and d % 8 == 0 for d in head_dims):
        raise UsageError(f"--head-dims must be multiples of 8 from 8 to 128; got {args.head_dims}")
    need_triton, need_cuda = args.only in (None, "triton"), args.only in (None, "cuda")
    ptxas, nv = triton_ptxas() if need_triton else None, nvcc() if need_cuda else None
    if need_triton and ptxas is None:
        raise UsageError(
            "Triton with its bundled ptxas is required (pip install triton); not found"
        )
    if need_cuda and nv is None:
        raise UsageError(
            "nvcc is required for the CUDA kernels (put it on PATH or set CUDA_HOME; "
            "--only triton skips them); not found"
        )
    return shapes, head_dims, ptxas, nv


def _run(argv=None) -> int:
    args = _parser().parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        # kernels defined under the interpreter cannot be compiled: rerun without it
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        rest = sys.argv[1:] if argv is None else list(argv)
        return subprocess.call([sys.executable, "-m", "smelt_tools.audit", *rest], env=env)
    shapes, head_dims, ptxas, nv = _options(args)

    def progress(msg):
        print(msg, file=sys.stderr, flush=True)

    tools = {}
    if ptxas is not None:
        # found with its ptxas: installed (see triton_ptxas)
        import triton

        tools["triton"] = triton.__version__
        progress(f"triton {triton.__version__}, ptxas {ptxas}")
    if nv is not None:
        ver = (
            subprocess.run([nv, "--version"], capture_output=True, text=True)
            .stdout.strip()
            .splitlines()
        )
        tools["nvcc"] = "nvcc " + (ver[-1] if ver else "?")
        progress(f"{tools['nvcc']} at {nv}")
    t0 = time.time()
    try:
        rows = (audit_triton(progress, shapes, head_dims) if ptxas else []) + (
            audit_cuda(progress, nv) if nv else []
        )
    except RuntimeError as e:
        raise CommandError(f"compile failed: {str(e).splitlines()[0] if str(e) else e}") from None
    progress(f"{len(rows)} kernels audited in {time.time() - t0:.0f} s")
    md = to_markdown(rows, tools)
    for path, text in ((args.json, json.dumps(rows, indent=1) + "\n"), (args.markdown, md)):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if args.json is None and args.markdown is None:
        print(md)
    bad = [r for r in rows if r["spill_bytes"] or r["shared_bytes"] > SM90_SHARED_LIMIT]
    for r in bad:
        progress(
            f"over budget: {r['kernel']} {r['config']} ({r['spill_bytes']} B spilled, "
            f"{r['shared_bytes']} B smem)"
        )
    return 0


main = command(PROG, _run)
