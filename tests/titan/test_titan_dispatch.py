"""The token dispatchers on two gloo processes against a one-process reference: the stock
rows and the de-duplicated ones, blocking and in two chunks whose exchanges are left in
flight (forward and backward), with the rows each exchange sent
(tests/titan/dispatch_worker.py); and the phased driver in one process."""

import json
import math

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is not installed (extra 'titan')")

# its module-scoped runs take long: scheduled first
pytestmark = pytest.mark.slow

import titan_helpers as th  # noqa: E402

E, K, WORLD = 16, 4, 2
TOL = 2e-6  # fp32, a few reductions in another order


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dispatch")
    out = tmp / "out.json"
    proc = th.launch([str(th.HERE / "dispatch_worker.py"), str(out)], cwd=tmp, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("run", ["stock1", "stock2", "dedup1", "dedup2"])
def test_output_and_every_gradient_equal_the_reference(results, run):
    for rank in results:
        diffs = rank[run]
        assert all(math.isfinite(v) for v in diffs.values() if not isinstance(v, list))
        for what in ("out", "x", "scores", "w"):
            assert diffs[what] < TOL, (run, what, diffs[what])


def _rows(events, kind, phase):
    return [sum(ev[2][j] for ev in events if ev[0] == kind and ev[1] == phase) for j in (0, 1)]


def test_dedup_sends_one_row_per_token_and_rank(results):
    """The de-duplicated dispatch sends each rank's token_ranks, the combine returns what
    arrived, and the backward mirrors both; the stock dispatcher sends the (token, slot)
    rows, and the two differ by the factor the ledger uses."""
    received = [r["token_ranks"] for r in results]
    for i, rank in enumerate(results):
        for chunks in (1, 2):
            dedup = rank[f"dedup{chunks}"]["events"]
            assert _rows(dedup, "dispatch", "forward") == received[i]
            assert _rows(dedup, "combine", "backward") == received[i]
            back = [received[j][i] for j in (0, 1)]
            assert _rows(dedup, "combine", "forward") == back
            assert _rows(dedup, "dispatch", "backward") == back
            stock = rank[f"stock{chunks}"]["events"]
            assert sum(_rows(stock, "dispatch", "forward")) == 37 * K
            # the int32 ids and fp32 scores of a row travel beside it: 8 bytes per slot
            assert {ev[3] for ev in dedup if ev[0] == "slots" and ev[1] == "forward"} == {8 * K}
    # the ledger's uniform-routing factor R (1 - C(E - E/R, k) / C(E, k)) / k, roughly
    factor = WORLD * (1 - math.comb(E - E // WORLD, K) / math.comb(E, K)) / K
    sent = sum(sum(r) for r in received)
    assert abs(sent / (WORLD * 37 * K) - factor) < 0.1
