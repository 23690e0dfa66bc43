"""Benchmark smelt inside transformers: ``python -m smelt_tools.hf_bench``.

Builds a small Mixtral-shaped ``MixtralForCausalLM`` from a config (random O(1)-scale
weights; nothing downloads) and times, on one model whose implementations are switched
between calls, a training step (zero_grad, forward with labels, backward; no optimizer)
and greedy generation (prompt, then new tokens with transformers' DynamicCache) for:

    experts eager      + attention sdpa     (transformers' reference loop)
    experts grouped_mm + attention sdpa     (transformers' fast path)
    experts smelt      + attention sdpa
    experts smelt      + attention smelt

Calls are interleaved round-robin (A, B, C, D, A, B, ...) after a warm-up, so machine drift
hits all alike; the table gives medians, the 20-80% spread and each row's time over the
grouped_mm + sdpa row's (``vs_grouped_mm``, :func:`smelt_tools.timing.result_row`). Before
timing, the smelt rows' logits are checked against the eager row's. CPU by default (fp32);
``--device cuda`` (bf16, a larger model) when a GPU is there. ``--out DIR`` writes
``hf_bench_<device>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Callable

import torch

from smelt_kernels.attention import select_backend as attn_backend
from smelt_kernels.moe_gemm import select_backend as moe_backend

from .cli import Parser, UsageError, add_threads, command, threads
from .timing import environment, markdown_table, measure_interleaved, result_row

CONFIGS = (("eager", "sdpa"), ("grouped_mm", "sdpa"), ("smelt", "sdpa"), ("smelt", "smelt"))
BASELINE = ("grouped_mm", "sdpa")

#: model and workload per device: Mixtral geometry, scaled down
SHAPES = {
    "cpu": dict(
        model=dict(
            vocab_size=2048,
            hidden_size=256,
            intermediate_size=384,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=32,
            num_local_experts=8,
            num_experts_per_tok=2,
        ),
        batch=2,
        seq=128,
        prompt=32,
        new_tokens=8,
        dtype=torch.float32,
    ),
    "cuda": dict(
        model=dict(
            vocab_size=32000,
            hidden_size=1024,
            intermediate_size=1408,
            num_hidden_layers=8,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=64,
            num_local_experts=16,
            num_experts_per_tok=2,
        ),
        batch=8,
        seq=2048,
        prompt=256,
        new_tokens=64,
        dtype=torch.bfloat16,
    ),
}
MEMORY_LIMIT_BYTES = 8 * 2**30


PROG = "python -m smelt_tools.hf_bench"


def build_model(shape: dict, device: torch.device, seed: int = 0):
    # optional (the [hf] extra): the command says so in one line when it is missing
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        **shape["model"], max_position_embeddings=8192, tie_word_embeddings=False, pad_token_id=0
    )
    torch.manual_seed(seed)
    model = MixtralForCausalLM(cfg)
    with torch.no_grad():  # O(1)-scale weights: routing that is not near uniform
        for _name, p in model.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))
    return model.to(device=device, dtype=shape["dtype"])


def estimate_bytes(shape: dict) -> int:
    m = shape["model"]
    H, L, E, de, V = (
        m["hidden_size"],
        m["num_hidden_layers"],
        m["num_local_experts"],
        m["intermediate_size"],
        m["vocab_size"],
    )
    qkv = H * m["head_dim"] * (2 * m["num_attention_heads"] + 2 * m["num_key_value_heads"])
    params = L * (qkv + E * 3 * H * de + E * H) + 2 * V * H
    elem = torch.finfo(shape["dtype"]).bits // 8
    tokens = shape["batch"] * shape["seq"]
    acts = tokens * L * (16 * H + 2 * m["num_experts_per_tok"] * 3 * de) * 4 + tokens * V * 8
    return 2 * params * elem + acts


def interleaved(
    fns: dict[str, Callable[[], object]],
    device: torch.device,
    warmup: int,
    repeats: int,
    label: str,
) -> dict:
    """Each callable's :class:`~smelt_tools.timing.Timing`, timed round-robin
    (:func:`smelt_tools.timing.measure_interleaved`), with a progress line per round."""

    def progress(r: int) -> None:
        print(f"  {label}: round {r}/{repeats}", file=sys.stderr, flush=True)

    return measure_interleaved(
        fns, device=device, warmup=warmup, repeats=repeats, on_round=progress
    )


def shape_for(device: torch.device, quick: bool) -> dict:
    """The model and workload the benchmark runs on ``device`` (``quick``: a smoke run's);
    UsageError when it would need more memory than the command allows itself."""
    shape = dict(SHAPES[device.type])
    if quick:
        shape.update(batch=1, seq=64, prompt=16, new_tokens=4)
        shape["model"] = dict(shape["model"], num_hidden_layers=2)
    need = estimate_bytes(shape)
    if need > MEMORY_LIMIT_BYTES:
        raise UsageError(
            f"the benchmark model needs about {need / 2**30:.1f} GiB, over the "
            f"{MEMORY_LIMIT_BYTES / 2**30:.0f} GiB this command allows itself"
        )
    return shape


def run(device: torch.device, repeats: int, warmup: int, quick: bool) -> dict:
    # optional, as in build_model; smelt_kernels.hf needs it
    import transformers

    import smelt_kernels.hf  # noqa: F401  (registers "smelt")

    shape = shape_for(device, quick)
    print(f"building a Mixtral-shaped model on {device} ({shape['dtype']})", file=sys.stderr)
    model = build_model(shape, device)
    V = shape["model"]["vocab_size"]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (shape["batch"], shape["seq"]), generator=g).to(device)
    prompt = torch.randint(3, V, (1, shape["prompt"]), generator=g).to(device)

    def use(experts: str, attn: str):
        model.set_experts_implementation(experts)
        model.set_attn_implementation(attn)

    # the smelt rows must compute what the eager row computes
    with torch.no_grad():
        use("eager", "eager")
        ref = model(ids[:1, :64], use_cache=False).logits.float()
        checks = {}
        for experts, attn in CONFIGS:
            use(experts, attn)
            got = model(ids[:1, :64], use_cache=False).logits.float()
            checks[f"{experts}+{attn}"] = float((got - ref).abs().max() / ref.abs().max())

    def train_step(experts: str, attn: str):
        def fn():
            use(experts, attn)
            model.zero_grad(set_to_none=True)
            model(ids, labels=ids, use_cache=False).loss.backward()

        return fn

    def generate(experts: str, attn: str):
        def fn():
            use(experts, attn)
            with torch.no_grad():
                return model.generate(
                    prompt,
                    max_new_tokens=shape["new_tokens"],
                    min_new_tokens=shape["new_tokens"],
                    do_sample=False,
                    pad_token_id=0,
                )

        return fn

    # greedy tokens agree between the rows (reported, not asserted: bf16 may flip a near tie)
    outs = {f"{e}+{a}": generate(e, a)() for e, a in CONFIGS}
    base_tokens = outs["eager+sdpa"]
    same_tokens = {k: bool(torch.equal(v, base_tokens)) for k, v in outs.items()}

    rows = []
    tokens = shape["batch"] * shape["seq"]
    for task, maker, n_tok in (
        ("train step", train_step, tokens),
        ("greedy generate", generate, shape["new_tokens"]),
    ):
        fns = {f"{e}+{a}": maker(e, a) for e, a in CONFIGS}
        times = interleaved(fns, device, warmup, repeats, task)
        base = ("grouped_mm", times["+".join(BASELINE)])
        for experts, attn in CONFIGS:
            name = f"{experts}+{attn}"
            t = times[name]
            rows.append(
                dict(task=task, experts=experts, attention=attn)
                | result_row(t, versus=base)
                | dict(
                    repeats=t.repeats,
                    tokens_per_s=n_tok / (t.median_ms / 1e3),
                    max_rel_logit_diff_vs_eager=checks[name],
                    same_greedy_tokens=same_tokens[name],
                )
            )
    probe = torch.empty(1, shape["model"]["hidden_size"], device=device, dtype=shape["dtype"])
    q = torch.empty(1, 1, 1, shape["model"]["head_dim"], device=device, dtype=shape["dtype"])
    env = environment(device)
    env.update(
        transformers=transformers.__version__,
        dtype=str(shape["dtype"]),
        smelt_moe_backend=moe_backend(probe, None),
        smelt_attention_backend=attn_backend(q, None),
        shape={k: (str(v) if k == "dtype" else v) for k, v in shape.items()},
    )
    return dict(environment=env, rows=rows)


COLUMNS = (
    "task",
    "experts",
    "attention",
    "ms",
    "p20_ms",
    "p80_ms",
    "spread",
    "tokens_per_s",
    "vs_grouped_mm",
    "max_rel_logit_diff_vs_eager",
    "same_greedy_tokens",
)


def markdown(result: dict) -> str:
    env = result["environment"]
    s = env["shape"]
    m = s["model"]
    head = (
        f"# smelt inside transformers ({env['device']})\n\n"
        f"{env['date']} · {env['device_name']} · {env['torch_threads']} thread(s) (load "
        f"average {env.get('load_average')}) · torch "
        f"{env['torch']} · transformers {env['transformers']} · {env['dtype']} · smelt "
        f"backends: moe {env['smelt_moe_backend']}, attention "
        f"{env['smelt_attention_backend']}\n\n"
        f"MixtralForCausalLM from a config: H={m['hidden_size']}, L={m['num_hidden_layers']}, "
        f"heads {m['num_attention_heads']}/{m['num_key_value_heads']}x{m['head_dim']}, "
        f"{m['num_local_experts']} experts top-{m['num_experts_per_tok']}, "
        f"d_e={m['intermediate_size']}, vocab {m['vocab_size']}. Train step: batch "
        f"{s['batch']} x {s['seq']} tokens, forward + backward. Generate: prompt "
        f"{s['prompt']}, {s['new_tokens']} new tokens, greedy, DynamicCache. Interleaved "
        f"calls; medians in ms, spread = (p80 - p20) / median, vs_grouped_mm = the row's "
        f"median over the grouped_mm + sdpa row's (below 1: faster).\n\n"
    )
    return head + markdown_table(result["rows"], COLUMNS) + "\n"


def _parser() -> Parser:
    p = Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cpu)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    add_threads(p)
    p.add_argument("--quick", action="store_true", help="a tiny model, for a smoke run")
    p.add_argument("--out", default=None, help="folder for hf_bench_<device>.json/.md")
    return p


def _run(argv=None) -> int:
    args = _parser().parse_args(argv)
    dev = args.device or "cpu"
    if dev not in ("cpu", "cuda"):
        raise UsageError(f"--device must be cpu or cuda, got {dev!r}")
    if args.repeats < 1 or args.warmup < 0:
        raise UsageError("--repeats must be >= 1 and --warmup >= 0")
    if args.out is not None and Path(args.out).exists() and not Path(args.out).is_dir():
        raise UsageError(f"--out {args.out}: is a file, expected a folder to write into")
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise UsageError("transformers is not installed (pip install -e '.[hf]')") from None
    if dev == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda asked for, but no CUDA device is available")
    shape_for(torch.device(dev), args.quick)  # refuses a model that does not fit, before work
    if threads(args.threads) is not None:
        torch.set_num_threads(args.threads)
    result = run(torch.device(dev), args.repeats, args.warmup, args.quick)
    text = markdown(result)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"hf_bench_{dev}.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / f"hf_bench_{dev}.md").write_text(text)
        print(f"wrote {out / f'hf_bench_{dev}.json'} and .md", file=sys.stderr)
    return 0


main = command(PROG, _run)

if __name__ == "__main__":
    raise SystemExit(main())
