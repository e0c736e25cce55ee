"""``shardkit bench --cases startup`` (issue 32, item 5): the timing of a launch to the line that
says its first step is done, and the case's place in the registry. The case itself (two launches
of 4 ranks per round, minutes under load) runs in the slow tier."""

import os
import sys

import pytest

from shardkit.bench import CASES, Settings, run_bench
from shardkit.bench.cases_startup import ENV as STARTUP_ENV
from shardkit.bench.cases_startup import launches, time_to_line
from shardkit.bench.registry import QUICK, skip_reason
from shardkit.bench.startup_baseline import main as baseline_main
from shardkit.cli.main import build_parser
from shardkit.cli.train import config_from_args
from shardkit.train.config import TrainConfig, validate_config

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def _script(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_the_time_runs_to_the_marker_line_not_to_the_exit():
    """The clock's reading at the marker line, not at the lines after it or the exit: a counter
    for a clock (read once at the start, then once per line) gives the marker's line number."""
    code = "print('setting up'); print('first step done: loss 1'); print('tearing down'); print('done')"
    reads = iter(range(100))
    seconds = time_to_line(_script(code), "first step done", ENV, clock=lambda: float(next(reads)))
    assert seconds == 2.0  # the second line; the two after it and the exit are not counted
    assert next(reads) == 5  # every line was read (the process was waited for), none after


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


def test_both_launches_run_the_same_layout_model_and_threads():
    """What ``shardkit train`` resolves from the case's argv is what the baseline is given."""
    ref = validate_config(TrainConfig(steps=1, log_every=1, sequence_parallel=False))
    runs = launches(ref, "config.json")
    shardkit_argv, torchrun_argv = runs["shardkit"][0], runs["torchrun"][0]
    assert shardkit_argv[1:4] == ["-m", "shardkit", "train"]
    cfg = config_from_args(build_parser(["train"]).parse_args(shardkit_argv[3:]))
    nproc = torchrun_argv[torchrun_argv.index("--nproc-per-node") + 1]
    dp, tp, batch, seq = (int(a) for a in torchrun_argv[-4:])
    assert torchrun_argv[-5] == "config.json" and baseline_main.__code__.co_argcount == 5
    assert (cfg.nproc, cfg.dp_replicate, cfg.tp, cfg.batch_size, cfg.seq_len) == (int(nproc), dp, tp, batch, seq)
    assert (cfg.dp_shard, cfg.pp, cfg.cp_size, cfg.sequence_parallel, cfg.model) == (1, 1, 1, False, ref.model)
    assert STARTUP_ENV["OMP_NUM_THREADS"] == "1"


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
