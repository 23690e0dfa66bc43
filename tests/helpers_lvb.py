"""Synthetic blocks for the main job's tests: machine loads, timings with one, and a stand-in for
``lvb.runners.measure_block`` whose times and contention a test scripts. Nothing is built or
timed."""

from smelt_tools.timing import PartsTiming, Timing
from smelt_tools.watch import Load

COMPONENTS = ("attention", "moe_gemm", "routing", "norms", "embed_head")


def load(others=0.0, steal=0.0, threads=2, cores=2, throttled=0.0, slack=0.0) -> Load:
    """One second watched: other processes held ``others`` cores, the hypervisor ``steal``,
    a CPU quota ``throttled`` seconds; ``slack`` cores of tick-counting error."""
    return Load(
        wall_s=1.0,
        cpu_s=max(0.0, min(threads, cores) - others - steal),
        threads=threads,
        cores=cores,
        others_cores=others,
        steal_cores=steal,
        throttled_s=throttled,
        load_average=others,
        slack_cores=slack,
    )


def timing(ms: float, spread: float = 0.0, others: float = 0.0) -> Timing:
    """A timing whose fastest call takes ``ms`` (its median ``ms * (1 + spread / 2)``),
    watched while others held ``others`` cores."""
    t = Timing.of([ms, ms * (1 + spread)])
    t.load = load(others)
    return t


def fake_blocks(step_ms, others=None, fraction=None):
    """A ``measure_block`` stand-in. ``step_ms(arch, round, row)`` is the fastest call of
    that row's block (``round`` counts from 0 per architecture, rows are ``train``,
    ``prefill``, ``decode (batch1)``, ...); ``others(arch, round, row)`` the cores other
    processes held meanwhile (default none); ``fraction[arch]`` the share of the step its
    components add up to (default 0.5); blocks without ``components`` time the step alone,
    as the real one does. ``.calls`` counts the blocks of each architecture."""
    calls = {"baseline": 0, "smelt": 0}

    def block(cfg, wl, args, device, dtype, modes, first, watch, components=True):
        arch = "smelt" if cfg.loop is not None else "baseline"
        r = calls[arch]
        calls[arch] += 1

        def t(row):
            busy = others(arch, r, row) if others is not None else 0.0
            return timing(step_ms(arch, r, row), others=busy)

        out = {"params_total": 1, "params_active": 1, "peak_rss_bytes": 2**30}
        frac = (fraction or {}).get(arch, 0.5)
        for mode in ("train", "prefill"):
            if mode not in modes:
                continue
            step = t(mode)
            if not components:
                out[mode] = {"tokens": wl.tokens, "step": step}
                continue
            parts = {n: timing(step.median_ms * frac / len(COMPONENTS)) for n in COMPONENTS}
            tries = 1 if frac <= 1 + args.tolerance else args.max_tries
            pt = PartsTiming(step, parts, dict.fromkeys(COMPONENTS, 1), frac, args.tolerance, tries)
            out[mode] = {"tokens": wl.tokens, "parts": pt}
        if "train" in modes:
            out["train"]["activation_bytes"] = 1
        if "decode" in modes:
            out["decode"] = {
                f"batch{b}": {
                    "batch": b,
                    "context": 10,
                    "cache_bytes": 100,
                    "timing": t(f"decode (batch{b})"),
                    "compiled": False,
                    "eager_reason": "compile=False",
                }
                for b in wl.decode_batches
            }
        return out

    block.calls = calls
    return block
