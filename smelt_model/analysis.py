"""Mechanism probes: what the second visit of a span layer does (the paper's Section 6).

From a captured forward (:func:`smelt_model.capture`) on held-out token ids, per span layer
and pair of consecutive visits (visit v-1 -> v; for r = 2 that is visit 1 -> visit 2):

* expert overlap: mean |top-k set on visit v-1 ∩ top-k set on visit v| per token, beside the
  random expectation k^2 / E (64 / E for top-8);
* residual update norms ||Δx|| (mean over tokens) for the attention write, the MoE write and
  the whole layer, the visit-v / visit-(v-1) ratios, and the cosine of Δx between visits;
* cross-visit cosine of X (block input), Q, K, V, PV (attention output before the output
  projection) and O (after it), per token, averaged;
* top-8 attended-token overlap per head between visits, and the paper's control: head h
  against head h + Hq/2 at the same layer and visit (queries with fewer than 8 attendable keys
  are left out);
* per-head attention-sink mass (the attention op's statistic).

For the baseline (no loop) the per-layer statistics (norms, sink) are reported by depth.

Command line, ``smelt-analysis`` (``python -m smelt_model.analysis``)::

    smelt-analysis runs/tiny                  # a trainer's run folder
    smelt-analysis runs/tiny/smelt/checkpoints/latest --baseline runs/tiny/baseline
    smelt-analysis SMELT_CKPT --baseline BASE_CKPT --tokens ids.npy --plot runs/sink.png

A model is a ``save_pretrained`` folder, a trainer's run folder (its newest checkpoint), a
``RUN/checkpoints/latest`` pointer or a ``RUN/checkpoints/step_N`` folder; the folder of an
``--arch both`` pair stands for its SMELT model with its baseline. Without ``--tokens`` the
held-out tokens are the run's own validation split (its data, split and tokenizer, packed
into ``--seq-len`` contexts with their document segments). ``--tokens`` reads ``.npy`` (no
pickled objects) or ``.safetensors``; a ``.pt`` file is a pickle and is refused unread.
Errors follow :mod:`smelt_tools.cli`, one line each: a bad option, a model or token file that
cannot be used (the line names the file) or held-out tokens that cannot be made exit with
status 2.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from smelt_kernels import backends
from smelt_kernels.reference import segment_mask
from smelt_model.data import corpus, tokenizer
from smelt_model.model import SmeltLM
from smelt_model.plotting import plot_path, pyplot, save
from smelt_model.probes import capture
from smelt_model.train import checkpoint
from smelt_model.train.runspec import read_run_file
from smelt_tools import cli

__all__ = [
    "expert_overlap",
    "random_overlap",
    "token_cosine",
    "mean_norm",
    "top_attended",
    "attended_overlap",
    "LayerStats",
    "VisitComparison",
    "ProbeReport",
    "analyze",
    "format_report",
    "sink_by_depth",
    "main",
]

PROG = "smelt-analysis"


# ----------------------------------------------------------------------------- primitives
def expert_overlap(ids_a: torch.Tensor, ids_b: torch.Tensor) -> torch.Tensor:
    """Per-token size of the intersection of two top-k expert sets: (..., k) -> (...)."""
    if ids_a.shape != ids_b.shape:
        raise ValueError(f"ids shapes differ: {tuple(ids_a.shape)} vs {tuple(ids_b.shape)}")
    return (ids_a[..., :, None] == ids_b[..., None, :]).any(-1).sum(-1)


def random_overlap(k: int, n_experts: int) -> float:
    """Expected overlap of two independent uniformly random k-subsets of E experts: k^2/E."""
    return k * k / n_experts


def _per_token(x: torch.Tensor) -> torch.Tensor:
    """(B, T, ...) -> (B*T, features) in float64."""
    return x.reshape(x.shape[0] * x.shape[1], -1).double()


def token_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over tokens of the cosine between the per-token vectors of a and b."""
    return torch.nn.functional.cosine_similarity(_per_token(a), _per_token(b), dim=-1).mean().item()


def mean_norm(x: torch.Tensor) -> float:
    """Mean over tokens of the per-token L2 norm."""
    return _per_token(x).norm(dim=-1).mean().item()


def top_attended(
    q: torch.Tensor,
    k: torch.Tensor,
    segment_ids: Optional[torch.Tensor],
    n: int = 8,
    scale: Optional[float] = None,
):
    """Indices of the ``n`` keys each query attends to most, per head.

    q: (B, T, Hq, D), k: (B, T, Hkv, D). Returns (idx (B, Hq, T, n), valid (B, T)) where
    ``valid`` marks queries with at least ``n`` attendable keys (same segment, causal).
    """
    B, T, Hq, D = q.shape
    group = Hq // k.shape[2]
    if segment_ids is None:
        segment_ids = torch.zeros(B, T, dtype=torch.long, device=q.device)
    scale = D**-0.5 if scale is None else scale
    kk = k.double().repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), kk) * scale
    mask = segment_mask(segment_ids)
    s = s.masked_fill(~mask[:, None], float("-inf"))
    n_eff = min(n, T)
    idx = s.topk(n_eff, dim=-1).indices
    valid = mask.sum(-1) >= n
    return idx, valid


def attended_overlap(idx_a: torch.Tensor, idx_b: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per-head mean fraction of shared top-n keys between two attention patterns.

    idx_*: (B, H, T, n); valid: (B, T). Returns (H,), NaN where no query is valid.
    """
    n = idx_a.shape[-1]
    shared = (idx_a[..., :, None] == idx_b[..., None, :]).any(-1).sum(-1).double() / n
    w = valid[:, None, :].double()
    return (shared * w).sum((0, 2)) / w.sum((0, 2))


# ----------------------------------------------------------------------------- report
@dataclass
class LayerStats:
    """Statistics of one executed layer."""

    layer: int
    visit: int
    exec_index: int
    attn_norm: float
    moe_norm: float
    layer_norm: float
    sink: list[float]  # per head

    @property
    def mean_sink(self) -> float:
        return sum(self.sink) / len(self.sink)


@dataclass
class VisitComparison:
    """One span layer, visit ``visit - 1`` against ``visit``."""

    layer: int
    visit: int
    expert_overlap: float
    expert_overlap_random: float
    norm_ratio: dict[str, float]  # attn / moe / layer: ||Δx|| visit v over visit v-1
    update_cosine: dict[str, float]  # attn / moe / layer
    cosine: dict[str, float]  # x, q, k, v, pv, o
    attended_overlap: list[float]  # per head
    attended_overlap_control: list[float]  # per head, head h vs h + Hq/2


@dataclass
class ProbeReport:
    arch: str
    n_experts: int
    top_k: int
    layers: list[LayerStats] = field(default_factory=list)
    visits: list[VisitComparison] = field(default_factory=list)


_PROBES = ["x", "x_out", "attn_write", "moe_write", "q", "k", "v", "pv", "o", "sink", "router_ids"]


@torch.no_grad()
def analyze(
    model, input_ids: torch.Tensor, segment_ids: Optional[torch.Tensor] = None, top_n: int = 8
) -> ProbeReport:
    """Run ``model`` once on ``input_ids`` under capture and compute every probe statistic."""
    was_training = model.training
    model.eval()
    try:
        with capture(model, what=_PROBES) as rec:
            model(input_ids, segment_ids)
    finally:
        model.train(was_training)
    cfg = model.cfg
    report = ProbeReport(
        arch="smelt" if cfg.is_looped else "baseline", n_experts=cfg.n_experts, top_k=cfg.top_k
    )
    for i, key in enumerate(rec.keys()):
        r = rec[key]
        report.layers.append(
            LayerStats(
                layer=key[0],
                visit=key[1],
                exec_index=i,
                attn_norm=mean_norm(r["attn_write"]),
                moe_norm=mean_norm(r["moe_write"]),
                layer_norm=mean_norm(r["x_out"] - r["x"]),
                sink=r["sink"].double().mean(0).tolist(),
            )
        )
    if not cfg.is_looped:
        return report

    Hq = cfg.n_heads
    half = Hq // 2
    plan = model.schedule
    for layer in range(plan.start, plan.end):
        tops = {}
        for visit in range(plan.count):
            r = rec[(layer, visit)]
            tops[visit] = top_attended(r["q"], r["k"], segment_ids, top_n)
        for visit in range(1, plan.count):
            a, b = rec[(layer, visit - 1)], rec[(layer, visit)]
            upd_a = {"attn": a["attn_write"], "moe": a["moe_write"], "layer": a["x_out"] - a["x"]}
            upd_b = {"attn": b["attn_write"], "moe": b["moe_write"], "layer": b["x_out"] - b["x"]}
            (ia, valid), (ib, _) = tops[visit - 1], tops[visit]
            if half > 0:
                control = attended_overlap(ib[:, :half], ib[:, half : 2 * half], valid).tolist()
            else:
                control = []
            report.visits.append(
                VisitComparison(
                    layer=layer,
                    visit=visit,
                    expert_overlap=expert_overlap(a["router_ids"], b["router_ids"])
                    .double()
                    .mean()
                    .item(),
                    expert_overlap_random=random_overlap(cfg.top_k, cfg.n_experts),
                    norm_ratio={n: mean_norm(upd_b[n]) / mean_norm(upd_a[n]) for n in upd_a},
                    update_cosine={n: token_cosine(upd_a[n], upd_b[n]) for n in upd_a},
                    cosine={n: token_cosine(a[n], b[n]) for n in ("x", "q", "k", "v", "pv", "o")},
                    attended_overlap=attended_overlap(ia, ib, valid).tolist(),
                    attended_overlap_control=control,
                )
            )
    return report


def sink_by_depth(report: ProbeReport) -> list[tuple[int, float]]:
    """(execution index, mean sink over heads) for every executed layer."""
    return [(s.exec_index, s.mean_sink) for s in report.layers]


def _mean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x == x]
    return sum(xs) / len(xs) if xs else float("nan")


def format_report(report: ProbeReport) -> str:
    out = [f"== {report.arch}: per executed layer =="]
    out.append(
        f"{'exec':>4} {'layer':>5} {'visit':>5} {'|attn Δx|':>10} {'|moe Δx|':>10} "
        f"{'|layer Δx|':>10} {'sink':>7}"
    )
    for s in report.layers:
        out.append(
            f"{s.exec_index:>4} {s.layer + 1:>5} {s.visit + 1:>5} {s.attn_norm:>10.4f} "
            f"{s.moe_norm:>10.4f} {s.layer_norm:>10.4f} {s.mean_sink:>7.4f}"
        )
    if report.visits:
        rnd = report.visits[0].expert_overlap_random
        out.append("")
        out.append(f"== span layers: visit v-1 -> v (expert overlap; random = {rnd:.3f}) ==")
        out.append(
            f"{'layer':>5} {'v':>2} {'overlap':>8} {'ratio attn':>10} {'ratio moe':>9} "
            f"{'ratio layer':>11} {'cos Δx':>7} {'cos X':>6} {'cos Q':>6} {'cos K':>6} "
            f"{'cos V':>6} {'cos PV':>6} {'cos O':>6} {'top8':>6} {'ctrl':>6}"
        )
        for c in report.visits:
            out.append(
                f"{c.layer + 1:>5} {c.visit + 1:>2} {c.expert_overlap:>8.3f} "
                f"{c.norm_ratio['attn']:>10.3f} {c.norm_ratio['moe']:>9.3f} "
                f"{c.norm_ratio['layer']:>11.3f} {c.update_cosine['layer']:>7.3f} "
                + " ".join(f"{c.cosine[n]:>6.3f}" for n in ("x", "q", "k", "v", "pv", "o"))
                + f" {_mean(c.attended_overlap):>6.3f} {_mean(c.attended_overlap_control):>6.3f}"
            )
    return "\n".join(out)


# ----------------------------------------------------------------------------- command line
def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _read_npy(p: Path) -> np.ndarray:
    """A ``.npy`` array, read without pickle; anything else is "not a valid .npy array"."""
    with p.open("rb") as fh:
        if fh.read(6) != b"\x93NUMPY":
            raise ValueError("not a valid .npy array (no .npy header)")
    try:
        return np.load(p, allow_pickle=False)
    except (ValueError, EOFError, OSError) as e:
        why = "it holds Python objects, a pickle" if "pickle" in str(e) else "truncated or corrupt"
        raise ValueError(f"not a valid .npy array ({why})") from None


def _read_ids(p: Path) -> torch.Tensor:
    """Token ids from ``.npy`` (no pickled objects) or ``.safetensors`` (one tensor, or one
    named ``input_ids``). Nothing else is read: a ``.pt`` file is a pickle, which can run
    code."""
    if p.suffix == ".npy":
        return torch.from_numpy(_read_npy(p))
    if p.suffix == ".safetensors":
        found = load_file(str(p))
        if "input_ids" in found:
            return found["input_ids"]
        if len(found) != 1:
            raise ValueError(f"expected one tensor or one named input_ids, got {len(found)}")
        return next(iter(found.values()))
    raise ValueError(
        f"{p.suffix or 'a file without a suffix'} is not read (a .pt file is a "
        "pickle, which can run code); save the ids with numpy.save or safetensors"
    )


def _load_tokens(path: str, seq_len: int, batch: int, vocab: int) -> torch.Tensor:
    p = Path(path)
    if not p.is_file():
        raise cli.UsageError(f"--tokens {path}: no such file")
    try:
        ids = _read_ids(p)
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise cli.UsageError(f"expected integer token ids, got {ids.dtype}")
        ids = ids.long()
    except Exception as e:  # whatever the reader says: the file is not an array of token ids
        raise cli.UsageError(f"--tokens {path}: {first_line(e)}") from None
    ids = ids.reshape(-1)
    need = seq_len * batch
    if ids.numel() < need:
        raise cli.UsageError(
            f"--tokens {path} has {ids.numel()} tokens; need {need} (--seq-len x --batch)"
        )
    ids = ids[:need].view(batch, seq_len)
    if ids.min() < 0 or ids.max() >= vocab:
        raise cli.UsageError(f"--tokens {path}: token ids fall outside the vocabulary [0, {vocab})")
    return ids


def _locate(path: str) -> tuple[Path, Optional[Path]]:
    """(the checkpoint folder ``path`` points at, the run folder it belongs to or None)."""
    p = Path(path)
    if not p.exists() and not p.is_symlink():
        raise cli.UsageError(f"{path}: not found")
    try:
        ckpt = checkpoint.resolve(p)
    except ValueError as e:
        raise cli.UsageError(str(e)) from None
    run = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else None
    if run is not None and not (run / "run.json").is_file():
        run = None
    return ckpt, run


def _pair(path: str) -> Optional[tuple[str, str]]:
    """(smelt run, baseline run) when ``path`` is the folder of an ``--arch both`` pair."""
    p = Path(path)
    if (p / "smelt" / "run.json").is_file() and (p / "baseline" / "run.json").is_file():
        return str(p / "smelt"), str(p / "baseline")
    return None


def _held_out(run: Optional[Path], where: str, seq_len: Optional[int], batch: int):
    """(ids, segment_ids) from the run's validation split: ``batch`` contexts."""
    if run is None:
        raise cli.UsageError(
            f"{where} is not a trainer's run (no run.json beside its checkpoints): "
            "pass held-out token ids with --tokens"
        )
    spec = read_run_file(run / "run.json")
    tok = tokenizer.load(run)
    try:
        val = corpus.held_out(spec.data, spec.val_fraction, tok, seq_len or spec.seq_len)
    except ValueError as e:
        raise cli.UsageError(
            f"{run / 'run.json'}: the run's data cannot be read here ({e}); pass --tokens"
        ) from None
    if val is None:
        raise cli.UsageError(
            f"{run}: the run has no validation split (--val-fraction "
            f"{spec.val_fraction}); pass --tokens"
        )
    n = min(batch, len(val))
    ids = torch.from_numpy(val.input_ids[:n]).long()
    seg = torch.from_numpy(val.segment_ids[:n]).long()
    print(f"held-out tokens: {n} x {ids.shape[1]} from the validation split of {spec.data} ({run})")
    return ids, seg


def _load_model(path: Path, backend: str):
    """The model of a ``save_pretrained`` folder; a file in it that cannot be read is named."""
    weights = path / "model.safetensors"
    if weights.is_file():
        try:
            with safe_open(str(weights), framework="pt"):
                pass
        except Exception as e:  # a truncated or corrupt file: safetensors checks the whole span
            raise cli.UsageError(
                f"{weights}: not a complete safetensors file ({first_line(e)})"
            ) from None
    try:
        return SmeltLM.from_pretrained(path, backend=backend)
    except Exception as e:  # config or weights that do not make a model
        raise cli.UsageError(f"{path}: {first_line(e)}") from None


def _options(argv: Optional[Sequence[str]]):
    ap = cli.Parser(prog=PROG, description="Mechanism probes for a SMELT (and baseline) model.")
    ap.add_argument(
        "checkpoint",
        help="a save_pretrained folder, a run folder, "
        "RUN/checkpoints/latest or RUN/checkpoints/step_N",
    )
    ap.add_argument("--baseline", help="a baseline model (same forms) to compare sink by depth")
    ap.add_argument(
        "--tokens",
        help="held-out token ids (.npy or .safetensors; default: the run's validation split)",
    )
    ap.add_argument(
        "--seq-len", type=int, help="tokens per context (default: the run's, or 512 with --tokens)"
    )
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--backend", default="auto", choices=backends.choices())
    ap.add_argument("--plot", help="write the sink-by-depth plot here (.png; needs matplotlib)")
    args = ap.parse_args(argv)
    if args.batch < 1 or (args.seq_len is not None and args.seq_len < 2):
        raise cli.UsageError("--batch must be >= 1 and --seq-len >= 2")
    args.plot = plot_path(args.plot)
    return args


def _run(argv: Optional[Sequence[str]] = None) -> int:
    """The probes of one model or a pair (see the module docstring)."""
    args = _options(argv)
    main_path, base_path = args.checkpoint, args.baseline
    pair = _pair(main_path) if base_path is None else None
    if pair is not None:
        main_path, base_path = pair
    models = [("smelt" if base_path else "model", main_path)]
    if base_path:
        models.append(("baseline", base_path))
    located = [(name, *_locate(path)) for name, path in models]  # every path, before work
    ids = seg = None
    if args.tokens is None:
        ids, seg = _held_out(located[0][2], models[0][1], args.seq_len, args.batch)
    reports = {}
    for name, ckpt, _ in located:
        model = _load_model(ckpt, args.backend)
        vocab = model.cfg.vocab_size
        if args.tokens is not None:
            x, s = _load_tokens(args.tokens, args.seq_len or 512, args.batch, vocab), None
        else:
            x, s = ids, seg
            if int(x.max()) >= vocab:
                raise cli.UsageError(
                    f"{ckpt}: the held-out tokens fall outside its vocabulary "
                    f"[0, {vocab}): pass --tokens"
                )
        reports[name] = analyze(model, x, s)
        print(format_report(reports[name]))
        print()
    if args.plot:
        fig, ax = pyplot().subplots(figsize=(6, 4))
        for _name, rep in reports.items():
            xs, ys = zip(*sink_by_depth(rep))
            ax.plot(
                [x + 1 for x in xs],
                ys,
                marker="o",
                label=f"{rep.arch} ({'execution' if rep.arch == 'smelt' else 'physical'} layers)",
            )
        ax.set_xlabel("layer (baseline: physical; SMELT: execution order)")
        ax.set_ylabel("attention-sink mass")
        ax.legend()
        fig.tight_layout()
        print(f"wrote {save(fig, args.plot)}")
    return 0


main = cli.command(PROG, _run)

if __name__ == "__main__":
    raise SystemExit(main())
