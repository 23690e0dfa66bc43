"""The launches the static audit compiles: every shipped GPU configuration of the Triton
kernels, as launch descriptions ``dict(kernel, config, fn, args, kwargs, hot)`` with the
arguments their launchers pass, on meta tensors (nothing is allocated). The shapes they are
chosen for live in :mod:`smelt_tools.audit`.

torch and the kernels' modules (Triton, optional) are imported inside the functions that
build launches, so that the audit's ``--help`` and its option errors answer without them."""

from __future__ import annotations

__all__ = ["triton_jobs", "moe_launches", "attention_launches"]


def triton_jobs(shapes=None, head_dims=None) -> list[dict]:
    """Every shipped GPU configuration of the Triton kernels (or those at the named MoE
    shapes and head dims)."""
    # the audit's shapes: its __init__ imports this module, so not at the top
    from . import ATTENTION_HEAD_DIMS, ATTENTION_HEADS, MOE_SHAPES, MOE_TOKENS, TOP_K

    shapes = {n: MOE_SHAPES[n] for n in (shapes or MOE_SHAPES)}
    return moe_launches(shapes, MOE_TOKENS, TOP_K) + attention_launches(
        head_dims or ATTENTION_HEAD_DIMS, ATTENTION_HEADS
    )


def _meta(*shape, dtype):
    import torch  # lazy: see the module docstring

    return torch.empty(shape, dtype=dtype, device=torch.device("meta"))


def _gemm_launches(H: int, de: int, E: int, T: int, top_k: int, dtype, prec: dict) -> list:
    """(kernel, fn, args, kwargs) of the up projection, the down projection and the dSwiGLU
    dgrad of T tokens at one shape, operands in ``dtype``, ``prec``: the kernels'
    PREC/UPCAST switches."""
    import torch  # lazy: see the module docstring

    from smelt_kernels.moe_gemm import triton as mt  # lazy: see the module docstring

    cuda, i32, f32 = torch.device("cuda"), torch.int32, torch.float32
    TK = T * top_k
    m = TK / E
    x, w1, w2 = (
        _meta(T, H, dtype=dtype),
        _meta(E, 2 * de, H, dtype=dtype),
        _meta(E, H, de, dtype=dtype),
    )
    pre, hid = _meta(TK, 2 * de, dtype=dtype), _meta(TK, de, dtype=dtype)
    idx, tiles = _meta(TK, dtype=i32), _meta(64, dtype=i32)
    up = mt.config(cuda, m, de, H, kind="up")
    down = dict(mt.config(cuda, m, H, de, dtype=dtype), BM=up["BM"])
    up_args = (x, w1, idx, tiles, tiles, tiles, pre, hid, 64, H, de)
    down_args = (hid, w2, x) + (tiles,) * 4 + (64, H, de)
    dh_args = (x, w2, pre, _meta(TK, dtype=f32), idx, idx, tiles, tiles, tiles, pre, hid)
    return [
        (
            "up_proj",
            mt._up_kernel,
            up_args + (x.stride(0), w1.stride(0), w1.stride(1)),
            dict(up, **prec),
        ),
        (
            "down_proj",
            mt._rows_kernel,
            down_args + (hid.stride(0), w2.stride(0), w2.stride(2), w2.stride(1), x.stride(0), -1),
            dict(down, GATHER=False, **prec),
        ),
        (
            "dgrad_swiglu",
            mt._dh_kernel,
            dh_args + (_meta(8, TK, dtype=f32), 64, TK, H, de, x.stride(0), w2.stride(0)),
            dict(mt.config(cuda, m, de, H, kind="dgrad"), **prec),
        ),
    ]


def _job(kernel: str, fn, args, kwargs, config: str, hot: bool = False) -> dict:
    return dict(kernel=f"moe.{kernel}", fn=fn, args=args, kwargs=kwargs, hot=hot, config=config)


def _tiles(kwargs: dict) -> str:
    """The tile sizes of a launch's keyword arguments, as the config column shows them."""
    return " ".join(f"{k}{v}" for k, v in kwargs.items() if k[:2] in ("BM", "BN", "BK", "BI", "BC"))


def _dgrad_x(H: int, de: int, E: int, T: int, top_k: int, up_bm: int, prec: dict):
    """(kernel, fn, args, kwargs) of dX = dPre @ W1 through the rows kernel, bf16."""
    import torch  # lazy: see the module docstring

    from smelt_kernels.moe_gemm import triton as mt  # lazy: see the module docstring

    bf16, i32 = torch.bfloat16, torch.int32
    TK = T * top_k
    pre, w1 = _meta(TK, 2 * de, dtype=bf16), _meta(E, 2 * de, H, dtype=bf16)
    out, tiles = _meta(TK, H, dtype=bf16), _meta(64, dtype=i32)
    kw = dict(dict(mt.config(torch.device("cuda"), TK / E, H, 2 * de), BM=up_bm), GATHER=False)
    strides = (pre.stride(0), w1.stride(0), w1.stride(1), w1.stride(2), out.stride(0), -1)
    args = (pre, w1, out) + (tiles,) * 4 + (64, H, 2 * de) + strides
    return "dgrad_x", mt._rows_kernel, args, dict(kw, **prec)


def _wgrads(H: int, de: int, E: int, T: int, top_k: int, prec: dict) -> list:
    """(kernel, fn, args, kwargs) of the two weight gradients, dW1 and dW2, bf16."""
    import torch  # lazy: see the module docstring

    from smelt_kernels.moe_gemm import triton as mt  # lazy: see the module docstring

    bf16, i32 = torch.bfloat16, torch.int32
    TK = T * top_k
    x, dy = _meta(T, H, dtype=bf16), _meta(T, H, dtype=bf16)
    pre, hid = _meta(TK, 2 * de, dtype=bf16), _meta(TK, de, dtype=bf16)
    w1, w2 = _meta(E, 2 * de, H, dtype=bf16), _meta(E, H, de, dtype=bf16)
    idx, offs = _meta(TK, dtype=i32), _meta(E + 1, dtype=i32)
    launches = []
    for kname, L, R, il, ir, NI, NC, out_w in (
        ("wgrad_w1", pre, x, None, idx, 2 * de, H, w1),
        ("wgrad_w2", dy, hid, idx, None, H, de, w2),
    ):
        kw = dict(
            mt._wgrad_config(torch.device("cuda"), NI, NC),
            GATHER_L=il is not None,
            GATHER_R=ir is not None,
            **prec,
        )
        gathers = (il if il is not None else offs, ir if ir is not None else offs, offs)
        strides = (L.stride(0), R.stride(0), out_w.stride(0), out_w.stride(1))
        launches.append((kname, mt._wgrad_kernel, (L, R, out_w) + gathers + (NI, NC) + strides, kw))
    return launches


def _grouped_gemm(H: int, de: int, E: int, T: int, top_k: int, prec: dict):
    """(kernel, fn, args, kwargs) of the grouped GEMM (gathered rows of x times W1), bf16."""
    import torch  # lazy: see the module docstring

    from smelt_kernels.moe_gemm import triton as mt  # lazy: see the module docstring

    bf16, i32 = torch.bfloat16, torch.int32
    TK = T * top_k
    x, w1, hid = _meta(T, H, dtype=bf16), _meta(E, 2 * de, H, dtype=bf16), _meta(TK, de, dtype=bf16)
    idx, tiles = _meta(TK, dtype=i32), _meta(64, dtype=i32)
    kw = dict(mt.config(torch.device("cuda"), TK / E, de, H), GATHER=True, **prec)
    strides = (x.stride(0), w1.stride(0), w1.stride(2), w1.stride(1), hid.stride(0), E)
    args = (x, w1, hid, idx) + (tiles,) * 3 + (64, de, H) + strides
    return "grouped_gemm", mt._rows_kernel, args, kw


def _combine(H: int, T: int, top_k: int):
    """(kernel, fn, args, kwargs) of the weighted combine of the expert rows, bf16."""
    import torch  # lazy: see the module docstring

    from smelt_kernels.moe_gemm import triton as mt  # lazy: see the module docstring

    TK = T * top_k
    out, dy = _meta(TK, H, dtype=torch.bfloat16), _meta(T, H, dtype=torch.bfloat16)
    idx, weights = _meta(TK, dtype=torch.int32), _meta(TK, dtype=torch.float32)
    args = (out, idx, weights, dy, T, H, top_k)
    return "combine", mt._combine_kernel, args, dict(HAS_W=True, BT=32, BH=128)


def _bf16_launches(name: str, sh: dict, T: int, top_k: int) -> list[dict]:
    """Every bf16 MoE launch of T tokens at one shape, in the order a step runs them (the
    forward GEMMs marked hot)."""
    import torch  # lazy: see the module docstring

    H, de, E = sh["H"], sh["de"], sh["E"]
    prec = dict(PREC=None, UPCAST=False)
    label = f"{name} H{H} d_e{de} E{E} T{T} ({T * top_k / E:.0f} rows/expert)"
    gemms = {
        k: (k, fn, a, kw)
        for k, fn, a, kw in _gemm_launches(H, de, E, T, top_k, torch.bfloat16, prec)
    }
    up_bm = gemms["up_proj"][3]["BM"]
    ordered = [
        gemms["up_proj"],
        gemms["down_proj"],
        _combine(H, T, top_k),
        gemms["dgrad_swiglu"],
        _dgrad_x(H, de, E, T, top_k, up_bm, prec),
        *_wgrads(H, de, E, T, top_k, prec),
        _grouped_gemm(H, de, E, T, top_k, prec),
    ]
    return [
        _job(k, fn, args, kw, f"bf16 {label} {_tiles(kw)}", hot=k in ("up_proj", "down_proj"))
        for k, fn, args, kw in ordered
    ]


def _routing_launches(top_k: int) -> list[dict]:
    """The routing sort's count and scatter kernels, at 4096 tokens and 288 experts."""
    import torch  # lazy: see the module docstring

    from smelt_kernels.moe_gemm import routing  # lazy: see the module docstring

    count, scatter = routing._kernels()
    ids = _meta(4096 * top_k, dtype=torch.int32)
    return [
        _job(
            "route_count",
            count,
            (ids, ids, ids.numel(), 288),
            dict(BLOCK=64, EB=64),
            "bf16 routing ",
        ),
        _job(
            "route_scatter",
            scatter,
            (ids, ids, ids, ids, ids, ids.numel(), 288, top_k),
            dict(BLOCK=64),
            "bf16 routing ",
        ),
    ]


def moe_launches(shapes: dict, tokens, top_k: int) -> list[dict]:
    """The GPU launches of the MoE Triton kernels: every kernel of forward, backward and the
    grouped GEMM, bf16, at each shape ({name: dict(H, de, E)}) and token count; the up,
    down and dgrad GEMMs in fp32 (IEEE products) at the first shape and token count; the
    routing sort's kernels."""
    import torch  # lazy: see the module docstring

    jobs = [
        job
        for name, sh in shapes.items()
        for T in tokens
        for job in _bf16_launches(name, sh, T, top_k)
    ]
    name, sh = next(iter(shapes.items()))
    T = tokens[0]
    ieee = dict(PREC="ieee", UPCAST=False)
    for kernel, fn, args, kw in _gemm_launches(
        sh["H"], sh["de"], sh["E"], T, top_k, torch.float32, ieee
    ):
        jobs.append(_job(kernel, fn, args, kw, f"float32 {name} T{T} BM{kw['BM']} BN{kw['BN']}"))
    return jobs + _routing_launches(top_k)


def attention_launches(head_dims, heads, tokens: int = 4096) -> list[dict]:
    """The GPU launches the static audit compiles: forward, dK/dV and dQ in bf16 and in fp32
    at every head dim (segments, sink), from meta tensors shaped like one ``tokens``-long
    sequence (nothing is allocated)."""
    import torch  # lazy: see the module docstring

    from smelt_kernels.attention import triton as at  # lazy: see the module docstring

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
            (at.fwd_kernel, None)
            + at.fwd_launch(q, k, k, q, stat, stat, seg, 0.1, True, cfgs["fwd"])[1:]
        ]
        launches += at.bwd_launches(
            q, q, k, k, stat, stat, q, k, k, seg, seg, 0.1, cfgs["dkdv"], cfgs["dq"]
        )
        for kernel, _, args, kw in launches:
            if dtype == torch.float32:
                kw = dict(kw, PRECISION="ieee")
            name = {at.fwd_kernel: "forward", at.bwd_dkdv_kernel: "backward_dkdv"}.get(
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
            fn=at.bwd_delta,
            hot=False,
            config="bf16 D88 BLOCK64",
            args=(torch.empty(8, dtype=bf16, device=meta),) * 2
            + (torch.empty(8, dtype=torch.float32, device=meta), tokens * hq, tokens, hq),
            kwargs=dict(D=88, D_PAD=128, BLOCK=64),
        )
    )
    return jobs
