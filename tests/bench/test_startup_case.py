"""``shardkit bench --cases startup`` (issue 32, item 5): the timing of a launch to the line that
says its first step is done, and the case's place in the registry. The case itself (two launches
of 4 ranks per round, minutes under load) runs in the slow tier."""

import os
import sys

import pytest

from shardkit.bench import CASES, Settings, run_bench
from shardkit.bench.cases_startup import time_to_line
from shardkit.bench.registry import QUICK, skip_reason

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def _script(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_the_time_runs_to_the_marker_line_not_to_the_exit():
    code = "import time; print('setting up'); time.sleep(0.3); print('first step done: loss 1'); time.sleep(1.5)"
    seconds = time_to_line(_script(code), "first step done", ENV)
    assert 0.3 <= seconds < 1.5  # the teardown after the line is not counted


@pytest.mark.parametrize(
    "code, why",
    [
        ("print('no marker')", "'first step done' seen: False"),
        ("print('first step done'); raise SystemExit(3)", "exit 3"),
    ],
)
def test_a_launch_that_fails_or_never_says_its_step_is_an_error(code, why):
    with pytest.raises(AssertionError, match=why):
        time_to_line(_script(code), "first step done", ENV)


def test_startup_is_one_rank_and_left_out_of_quick():
    assert CASES["startup"].nproc == 1 and skip_reason("startup", 1) is None
    assert "startup" not in QUICK and set(QUICK) == set(CASES) - {"startup"}


@pytest.mark.slow
def test_the_startup_case_times_both_launches():
    records = run_bench(["startup"], Settings(rounds=1, warmup=0, quick=True), progress=False)
    (rec,) = records
    assert set(rec["times_s"]) == {"shardkit", "torchrun"} and all(len(v) == 1 for v in rec["times_s"].values())
    assert all(v[0] > 0 for v in rec["times_s"].values())
    assert rec["ratios"]["shardkit/torchrun"]["goal"] == 1.0
