"""Running out of memory inside a native CPU kernel is an error, never a crash.

Each test runs the native ops in a subprocess whose address space (RLIMIT_AS) is capped a
few megabytes above what it already uses, from too little for anything up to enough, with a
new shape at every step, so that the GEMM micro-kernels are compiled afresh (a failed
allocation inside oneDNN's compile crashes the process unless the kernels check first).
The process must survive every step: each op either runs or raises torch.OutOfMemoryError
(or another RuntimeError / MemoryError) with the bytes it asked for, and the kernels' own
errors name the op. One intra-op thread per process; the thread pool and allocator are
warmed up before the cap.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from smelt_kernels import backends

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEADROOM_MB = (2, 16, 64, 320)

pytestmark = [
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux's"
    ),
    pytest.mark.skipif(
        backends.extension_op_missing("_cpu", "moe_ffn_fwd", "csrc") is not None,
        reason="smelt_kernels._cpu is not built",
    ),
]

SCRIPT = textwrap.dedent('''
    import resource, sys, torch
    import smelt_kernels.moe_gemm.ops as moe
    from smelt_kernels.attention import segment_attention
    from smelt_kernels.norm import rms_norm

    torch.set_num_threads(1)
    op, dtype = sys.argv[1], getattr(torch, sys.argv[2])
    headrooms = [int(a) for a in sys.argv[3:]]

    def vm_bytes():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize"))

    def inputs(step):
        """Inputs of the op at a step (-1: a small warm-up call), a little larger every step."""
        g = torch.Generator().manual_seed(step + 1)
        f = 1 if step >= 0 else 8  # the warm-up call: an eighth of the size
        step = max(step, 0)
        if op in ("moe", "moe_backward"):
            T, H, de, E = 2000 // f + 37 * step, 512 // f + 8 * step, 256 // f + 8 * step, 24
            x = torch.randn(T, H, generator=g).to(dtype)
            w1 = (torch.randn(E, 2 * de, H, generator=g) * 0.05).to(dtype)
            w2 = (torch.randn(E, H, de, generator=g) * 0.05).to(dtype)
            tw, ids = moe.route(torch.randn(T, E, generator=g), 4)
            return x, w1, w2, tw, ids
        if op == "grouped":
            M, K, N, E = 4000 // f + 29 * step, 512 // f + 8 * step, 400 // f + 16 * step, 6
            ends = torch.linspace(0, M, E + 1)[1:].round().int()
            a = torch.randn(M, K, generator=g).to(dtype)
            return a, torch.randn(E, N, K, generator=g).to(dtype), ends
        if op == "attention":
            T = 3000 // f + 41 * step
            q = torch.randn(1, T, 4, 32, generator=g).to(dtype)
            k = torch.randn(1, T, 2, 32, generator=g).to(dtype)
            lengths = torch.tensor([T // 3, T // 3, T - 2 * (T // 3)])
            seg = torch.repeat_interleave(torch.arange(3), lengths)[None]
            return q, k, k.clone(), seg
        if op == "norm":
            x = torch.randn(8192 // f + 64 * step, 512, generator=g).to(dtype)
            return x, torch.randn(512).to(dtype)
        raise SystemExit(f"unknown op {op}")

    def run(args):
        if op == "moe":
            moe.moe_ffn(*args, backend="cpu")
        elif op == "moe_backward":
            leaves = [a.requires_grad_() for a in args[:3]]
            moe.moe_ffn(*leaves, *args[3:], backend="cpu").sum().backward()
        elif op == "grouped":
            a, b, ends = args
            a.requires_grad_(), b.requires_grad_()
            moe.grouped_gemm(a, b, ends, backend="cpu").sum().backward()
        elif op == "attention":
            q, k, v, seg = args
            xs = [t.requires_grad_() for t in (q, k, v)]
            segment_attention(*xs, seg, backend="cpu").sum().backward()
        elif op == "norm":
            x, w = args
            x.requires_grad_(), w.requires_grad_()
            rms_norm(x, w).sum().backward()

    run(inputs(-1))  # warm up: thread pool, allocator arenas, oneDNN
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    for step, mb in enumerate(headrooms):
        args = inputs(step)
        torch.ops.smelt_cpu.pool_release()  # what the pool keeps would be headroom
        cap = vm_bytes() + mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
        try:
            run(args)
            outcome = "ok"
        except (RuntimeError, MemoryError) as e:
            outcome = f"{type(e).__name__}: " + " ".join(str(e).split())[:300]
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        print(f"{mb} MB | {outcome}", flush=True)
    print("survived", flush=True)
''')

# op -> the name its native kernels put in front of their out-of-memory errors
OPS = {
    "moe": "moe_ffn (cpu",
    "moe_backward": "moe_ffn (cpu",
    "grouped": "grouped_gemm",
    "attention": "segment_attention (cpu",
    "norm": "rms_norm (cpu",
}


@pytest.mark.parametrize(
    "op,dtype",
    [
        ("moe", "float32"),
        ("moe", "bfloat16"),
        ("moe_backward", "bfloat16"),
        ("grouped", "float32"),
        ("attention", "float32"),
        ("norm", "bfloat16"),
    ],
)
def test_out_of_memory_is_an_error_not_a_crash(op, dtype):
    # large blocks mapped and unmapped per allocation (no heap growth kept between steps)
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, op, dtype, *map(str, HEADROOM_MB)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, (
        f"exit status {proc.returncode} (a signal if negative)\n"
        f"{proc.stdout}\n{proc.stderr[-3000:]}"
    )
    lines = proc.stdout.strip().splitlines()
    assert lines[-1] == "survived" and len(lines) == len(HEADROOM_MB) + 1, proc.stdout
    outcomes = [line.split(" | ", 1)[1] for line in lines[:-1]]
    errors = [o for o in outcomes if o != "ok"]
    assert errors, f"no step ran out of memory, so nothing was tested: {outcomes}"
    assert outcomes[-1] == "ok", f"{HEADROOM_MB[-1]} MB of headroom should be enough: {outcomes}"
    for e in errors:
        assert "bytes" in e or "out of memory" in e, e  # says what it could not get
        if e.startswith("OutOfMemoryError") and "out of memory: could not allocate" in e:
            assert OPS[op] in e, e  # the kernels' own errors name the op
