"""``shardkit bench --cases host_overhead`` at tiny rounds: it runs on the fake process group at
world 4 and 8 (one spawned process) and returns one record per op and world with every variant
and every derived difference (no timing asserts)."""

import pytest

from shardkit.bench import CASES, Settings, run_bench
from shardkit.bench.cases_host import GOALS, OPS

P2P = {"send_forward", "recv_backward"}  # not autograd ops: no fwd+bwd variants
VARIANTS = {"bare", "shardkit", "recorder", "ledger"}
GRAD_VARIANTS = {"bare fwd+bwd", "floor fwd+bwd", "fwd+bwd"}
DERIVED = {"shardkit-bare us", "default-bare us", "recorder cost us", "ledger cost us", "shardkit/bare"}


@pytest.mark.slow  # the whole case (28 s at load 40); `shardkit bench --quick` runs it too
def test_host_overhead_runs_on_fake_worlds_and_records_every_op():
    assert CASES["host_overhead"].fake == (4, 8)
    records = run_bench(["host_overhead"], Settings(rounds=2, warmup=1, quick=True), progress=False)
    assert [(r["nproc"], r["params"]["op"]) for r in records] == [(w, op) for w in (4, 8) for op in OPS]
    for r in records:
        assert r["suite"] == r["case"] == "host_overhead"
        grad = r["params"]["op"] not in P2P
        assert set(r["times_s"]) == VARIANTS | (GRAD_VARIANTS | {"checks"} if grad else set())
        assert all(len(v) == 2 and min(v) > 0 for v in r["times_s"].values())
        grad_derived = {"fwd+bwd-bare us", "fwd+bwd-floor us", "checks cost us"}
        assert set(r["ratios"]) == DERIVED | (grad_derived if grad else set())
        assert (
            r["ratios"]["shardkit-bare us"]["goal"]
            == r["ratios"]["default-bare us"]["goal"]
            == GOALS.get(r["params"]["op"])
        )
        assert "spy" in r["checked"]
    assert {op for op in GOALS} <= set(OPS)
