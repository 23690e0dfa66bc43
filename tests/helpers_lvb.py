"""Synthetic blocks for the main job's tests: machine loads, timings with one, and a stand-in for
``lvb.runners.measure_block`` whose times and contention a test scripts. Nothing is built or
timed."""

from lvb.account import PARTS

from smelt_tools.timing import Timing
from smelt_tools.watch import Load

#: the GEMM ceiling every fake account reports (GFLOP/s)
CEILING = {"mkl": 200.0, "onednn": 400.0, "best": 400.0}


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


def fake_account(step_ms: float, parts=None, overhead: float = 0.0, tries: int = 1) -> dict:
    """An account as :func:`lvb.runners.account_of` returns it: ``parts`` (part -> ms; default
    the step split evenly over :data:`lvb.account.PARTS`), 1 ms untraced, a profiled step
    ``overhead`` slower than the plain one, each GEMM part's GEMMs at half its time."""
    parts = dict(parts) if parts is not None else dict.fromkeys(PARTS, (step_ms - 1.0) / len(PARTS))
    parts = {p: parts.get(p, 0.0) for p in PARTS}
    profiled = sum(parts.values()) + 1.0
    gemm = {p: parts[p] / 2 for p in ("projections", "head", "routing", "moe")}
    return {
        "parts_ms": parts,
        "untraced_ms": 1.0,
        "profiled_ms": profiled,
        "plain_ms": profiled / (1 + overhead),
        "overhead": overhead,
        "steps": 2,
        "tries": tries,
        "gemm_ms": gemm,
        "ceiling": dict(CEILING),
    }


def fake_blocks(step_ms, others=None, parts=None, overhead=None):
    """A ``measure_block`` stand-in. ``step_ms(arch, round, row)`` is the fastest call of
    that row's block (``round`` counts from 0 per architecture, rows are ``train``,
    ``prefill``, ``decode (batch1)``, ...); ``others(arch, round, row)`` the cores other
    processes held meanwhile (default none); ``parts[arch]`` the account's parts, or a
    function of the round giving them (default: the step split evenly,
    :func:`fake_account`), ``overhead[arch]`` its profiler's cost; blocks without
    ``account`` time the step alone, as the real one does. ``.calls`` counts the blocks of
    each architecture."""
    calls = {"baseline": 0, "smelt": 0}

    def block(cfg, wl, args, device, dtype, modes, first, watch, account=True):
        arch = "smelt" if cfg.loop is not None else "baseline"
        r = calls[arch]
        calls[arch] += 1

        def t(row):
            busy = others(arch, r, row) if others is not None else 0.0
            return timing(step_ms(arch, r, row), others=busy)

        out = {"params_total": 1, "params_active": 1, "peak_rss_bytes": 2**30}
        for mode in ("train", "prefill"):
            if mode not in modes:
                continue
            step = t(mode)
            out[mode] = {"tokens": wl.tokens, "step": step}
            if account:
                over = (overhead or {}).get(arch, 0.0)
                tries = 1 if over <= args.tolerance else args.max_tries
                mine = (parts or {}).get(arch)
                mine = mine(r) if callable(mine) else mine
                out[mode]["account"] = fake_account(step.min_ms, mine, over, tries)
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
