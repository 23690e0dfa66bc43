"""smelt's GPU kernels against the peers a user would pick instead, on one GPU in one run.

    python bench/bench_peers.py [--device cuda] [--out runs/bench] [--tokens 32768] [--quick]

MoE at the 200M SMELT cell (E 288, H 1056, d_e 352, top-8, bf16): smelt's Triton
``moe_ffn`` against a ``torch._grouped_mm`` composite (sort, gather, two grouped GEMMs,
SwiGLU, weighted scatter-add) and sonic-moe where importable. Segment attention at head dim
88, 12/2 heads, documents of mixed length (mean 800): smelt's Triton kernel (also at d 128,
for the useful-FLOP rate ratio), FlexAttention with a document block mask, cuDNN SDPA (on
equal-length documents: it has no document mask, so each document is a batch row) and
FlashAttention-3's varlen kernel where importable.

Each implementation is timed with CUDA events (``triton.testing.do_bench``, medians of
its repeats), interleaved over ``--rounds`` rounds; the table gives the median over rounds,
the spread (max - min over rounds) and TFLOP/s of useful work. A peer that is missing or
fails is listed with the reason. Needs a CUDA device: on a CPU-only machine it says so in
one line and exits with status 2.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from output_paths import out_folder

from smelt_kernels.attention import segment_attention
from smelt_kernels.moe_gemm import moe_ffn, route
from smelt_tools import cli
from smelt_tools.cli import UsageError

PROG = "bench_peers"


def _moe_cases(T, dev):
    E, H, de, k = 288, 1056, 352, 8
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, H, device=dev, generator=g, dtype=torch.bfloat16)
    w1 = (torch.randn(E, 2 * de, H, device=dev, generator=g) * H**-0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, de, device=dev, generator=g) * de**-0.5).to(torch.bfloat16)
    tw, ids = route(torch.randn(T, E, device=dev, generator=g), k)
    dy = torch.randn_like(x)
    flops = 6.0 * T * k * H * de  # forward: 2 T k (H 2de + de H)

    def smelt_fwd():
        return moe_ffn(x, w1, w2, tw, ids, backend="triton", check_values=False)

    def composite(xx, ww1, ww2, tww):
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tok = order // k
        offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
        gu = torch._grouped_mm(xx[tok], ww1.transpose(1, 2), offs=offs)
        h = F.silu(gu[:, :de]) * gu[:, de:]
        o = torch._grouped_mm(h, ww2.transpose(1, 2), offs=offs)
        o = o * tww.reshape(-1)[order, None].to(o.dtype)
        return torch.zeros_like(xx).index_add_(0, tok, o)

    leaves = [t.detach().clone().requires_grad_() for t in (x, w1, w2, tw)]

    def smelt_fwd_bwd():
        y = moe_ffn(*leaves, ids, backend="triton", check_values=False)
        torch.autograd.grad(y, leaves, dy)

    def composite_fwd_bwd():
        torch.autograd.grad(composite(*leaves), leaves, dy)

    cases = [
        ("moe fwd", "smelt triton", smelt_fwd, flops),
        ("moe fwd", "torch._grouped_mm composite", lambda: composite(x, w1, w2, tw), flops),
        ("moe fwd+bwd", "smelt triton", smelt_fwd_bwd, 3 * flops),
        ("moe fwd+bwd", "torch._grouped_mm composite", composite_fwd_bwd, 3 * flops),
    ]
    try:
        # optional peer: missing, it is a row that says so
        import sonicmoe  # noqa: F401

        cases.append(
            ("moe fwd", "sonic-moe", None, "installed; no adapter for its API in this script yet")
        )
    except Exception as e:  # noqa: BLE001
        cases.append(("moe fwd", "sonic-moe", None, f"not importable ({type(e).__name__})"))
    return cases


def _doc_lengths(T, mean, gen):
    lens, total = [], 0
    while total < T:
        n = int(torch.empty(1).exponential_(1.0 / mean, generator=gen).clamp(16, 4 * mean))
        n = min(n, T - total)
        lens.append(n)
        total += n
    return lens


def _attention_cases(T, dev):
    hq, hkv = 12, 2
    gen = torch.Generator().manual_seed(0)
    lens = _doc_lengths(T, 800, gen)
    seg = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).to(dev)[None]
    pairs = sum(n * (n + 1) / 2 for n in lens)
    cases = []
    for D in (88, 128):
        q = torch.randn(1, T, hq, D, device=dev, dtype=torch.bfloat16)
        kv = [torch.randn(1, T, hkv, D, device=dev, dtype=torch.bfloat16) for _ in range(2)]
        flops = 4.0 * D * hq * pairs
        cases.append(
            (
                f"attention fwd d{D}",
                "smelt triton",
                lambda q=q, kv=kv: segment_attention(
                    q, *kv, seg, backend="triton", check_values=False
                ),
                flops,
            )
        )
        if D != 88:
            continue
        qt, kt, vt = (t.transpose(1, 2) for t in (q, *kv))  # (B, H, T, D)
        try:
            # a peer this torch build may lack: missing, it is a row that says why
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            doc = seg[0]

            def mask(b, h, qi, ki):
                return (doc[qi] == doc[ki]) & (ki <= qi)

            bm = create_block_mask(mask, 1, None, T, T, device=dev)
            flex = torch.compile(flex_attention)
            cases.append(
                (
                    f"attention fwd d{D}",
                    "FlexAttention (document block mask)",
                    lambda: flex(qt, kt, vt, block_mask=bm, enable_gqa=True),
                    flops,
                )
            )
        except Exception as e:  # noqa: BLE001
            cases.append((f"attention fwd d{D}", "FlexAttention", None, f"unavailable ({e!s:.80})"))
        try:
            # a peer this torch build may lack, as FlexAttention above
            from torch.nn.attention import SDPBackend, sdpa_kernel

            L = 800
            nb = T // L
            qd, kd, vd = (
                t[:, :, : nb * L].reshape(t.shape[1], nb, L, D).transpose(0, 1)
                for t in (qt, kt, vt)
            )
            kd, vd = (t.repeat_interleave(hq // hkv, dim=1) for t in (kd, vd))

            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)

            cases.append(
                (
                    f"attention fwd d{D}",
                    f"cuDNN SDPA ({nb} equal documents of {L})",
                    cudnn,
                    4.0 * D * hq * nb * L * (L + 1) / 2,
                )
            )
        except Exception as e:  # noqa: BLE001
            cases.append((f"attention fwd d{D}", "cuDNN SDPA", None, f"unavailable ({e!s:.80})"))
        try:
            # optional peer, as sonic-moe
            from flash_attn_interface import flash_attn_varlen_func

            cu = torch.tensor([0] + lens, device=dev).cumsum(0).to(torch.int32)
            q3, k3, v3 = (t[0] for t in (q, *kv))
            cases.append(
                (
                    f"attention fwd d{D}",
                    "FlashAttention-3 varlen",
                    lambda: flash_attn_varlen_func(
                        q3, k3, v3, cu, cu, max(lens), max(lens), causal=True
                    ),
                    flops,
                )
            )
        except Exception as e:  # noqa: BLE001
            cases.append(
                (
                    f"attention fwd d{D}",
                    "FlashAttention-3",
                    None,
                    f"not importable ({type(e).__name__})",
                )
            )
    return cases


def _parser() -> cli.Parser:
    ap = cli.Parser(prog="bench_peers.py", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--device",
        default="cuda",
        choices=("cuda",),
        help="the one device the peers run on (refused where no CUDA device is visible)",
    )
    ap.add_argument("--out", default=None, help="folder for peers_cuda.json and peers_cuda.md")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="8k tokens, 2 rounds (a smoke run)")
    return ap


def _run(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.tokens < 1024 or args.rounds < 1:
        raise UsageError("--tokens must be >= 1024 and --rounds >= 1")
    out_folder(args.out)
    if not torch.cuda.is_available():
        raise UsageError(
            f"--device {args.device}: needs a CUDA device (torch.cuda.is_available() is False)"
        )
    # Triton (Linux only) times the calls: imported once a CUDA device is there
    import triton.testing

    T, rounds = (8192, 2) if args.quick else (args.tokens, args.rounds)
    dev = torch.device("cuda")
    cases = []
    for build in (_moe_cases, _attention_cases):
        try:
            cases += build(T, dev)
        except Exception as e:  # noqa: BLE001
            cases.append((build.__name__[1:], "setup", None, f"failed ({e!s:.120})"))
    times = {i: [] for i, c in enumerate(cases) if c[2] is not None}
    notes = {i: c[3] for i, c in enumerate(cases) if c[2] is None}
    for r in range(rounds):
        for i in list(times):
            name = f"{cases[i][0]} / {cases[i][1]}"
            try:
                times[i].append(
                    triton.testing.do_bench(cases[i][2], warmup=25, rep=100, return_mode="median")
                )
            except Exception as e:  # noqa: BLE001
                notes[i] = f"failed ({type(e).__name__}: {e!s:.100})"
                del times[i]
                continue
            print(
                f"[round {r + 1}/{rounds}] {name}: {times[i][-1]:.3f} ms",
                file=sys.stderr,
                flush=True,
            )
    rows = []
    for i, (task, impl, _, work) in enumerate(cases):
        row = dict(task=task, implementation=impl)
        if i in times and times[i]:
            ms = statistics.median(times[i])
            row.update(ms=ms, spread_ms=max(times[i]) - min(times[i]), tflops=work / ms / 1e9)
        else:
            row.update(note=notes.get(i, "not run"))
        rows.append(row)
    info = dict(
        date=time.strftime("%Y-%m-%d", time.gmtime()),
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        python=platform.python_version(),
        tokens=T,
        rounds=rounds,
    )
    lines = [
        f"# smelt vs peers on {info['device']} ({info['date']}, torch {info['torch']}, "
        f"triton {info['triton']}, {T} tokens, median of {rounds} interleaved rounds)",
        "",
        "| task | implementation | ms | spread ms | TFLOP/s |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if "ms" in r:
            lines.append(
                f"| {r['task']} | {r['implementation']} | {r['ms']:.3f} | {r['spread_ms']:.3f} | "
                f"{r['tflops']:.0f} |"
            )
        else:
            lines.append(f"| {r['task']} | {r['implementation']} | - | - | {r['note']} |")
    md = "\n".join(lines) + "\n"
    print(md)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "peers_cuda.json"), "w") as f:
            json.dump(dict(info, rows=rows), f, indent=1)
        with open(os.path.join(args.out, "peers_cuda.md"), "w") as f:
            f.write(md)
    return 0


main = cli.command(PROG, _run)


if __name__ == "__main__":
    raise SystemExit(main())
