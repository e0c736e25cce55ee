"""``--ac full`` / ``--ac selective`` in the trainer: every layout still matches one process without AC.

Each case runs :func:`shardkit.train.run.train` under ``--verify`` in float64: the parallel run
checkpoints its decoder blocks, the one-process reference keeps every activation (the LM spec
parallelizes the reference with ``ac="none"``), so a recompute that changed a value, a gradient
or the RNG would fail the 1e-9 parity. The ledger of each run shows what recomputation costs:
``full`` issues the blocks' forward tp / sp / cp collectives again (phase ``recompute``),
``selective`` replays the kept results of every collective and issues none, except the ring
attention's point-to-point exchanges (not replayed: they run again) and, under sequence
parallelism's shard layout, the blocks' input all-gathers (whose outputs it does not keep).
"""

import json
import time

import pytest
import torch

from harness.helpers import SMALL_CORPUS, rank, remove_shared_dir, shared_tmpdir, world_size
from harness.tiers import tiered
from shardkit.cli.main import build_parser
from shardkit.cli.train import config_from_args
from shardkit.errors import ShardkitError
from shardkit.train.config import TrainConfig, validate_config
from shardkit.train.run import train

CORPUS = SMALL_CORPUS
SMALL = dict(steps=2, seq_len=16, batch_size=4, dtype="float64", verify=True, layers=2, lr=1e-3, data=CORPUS)

LAYOUTS = {
    "dp_replicate=2 x tp=2 (SP)": dict(),
    "tp=2 (no SP) x dp=2, 2 accumulated microbatches": dict(sequence_parallel=False, microbatches=2, batch_size=8),
    "cp_ulysses=2 x dp_shard=2 (FSDP2)": dict(tp=1, cp_ulysses=2, dp_shard=2),
    "pp=2 x tp=2 (SP), 1f1b": dict(pp=2, tp=2, microbatches=2),
    "moe: dp_shard=4, ep=2 (experts FSDP2 over edp)": dict(model="moe", tp=1, dp_shard=4, ep=2),
}
SLOW = {
    "qwen2: cp_ring=2 x tp=2": dict(model="qwen2", cp_ring=2, tp=2),
    "moe: ep=2 borrowed from tp=2 x dp=2": dict(model="moe", ep=2),
}


def _run(ac: str, overrides: dict) -> dict | None:
    cfg = validate_config(TrainConfig(**{**SMALL, **overrides, "ac": ac}), world_size=world_size())
    return train(cfg, "gloo", torch.device("cpu"), time.perf_counter(), progress=False)


def _recompute_rows(result: dict) -> list[dict]:
    return [row for row in result["ledger"] if row["phase"] == "recompute"]


def _check(ac: str, result: dict | None, ring: bool) -> None:
    if rank() != 0:
        assert result is None
        return
    parity = result["parity"]
    assert parity["passed"], parity
    assert parity["max_param_rel_diff"] <= 1e-9
    for a, b in zip(result["grad_norms"], result["reference_grad_norms"]):
        assert abs(a - b) <= 1e-12 * b
    again = _recompute_rows(result)
    if ac == "full":
        assert again, "full recompute re-issues the blocks' forward collectives"
    else:
        # SP's shard layout (the default) issues its input all-gathers again, and the head (not
        # checkpointed) regathers: the replay keeps no T x H gather (tests/parallelize/test_sp_activation.py)
        again = [row for row in again if row["api"] not in ("all_gather", "sp_regather")]
        assert all(row["op"] in ("send", "recv") for row in again) and (bool(again) == ring), again


# Quick tier, both modes of each: tp + SP (the recomputed / replayed tp collectives), a pipeline
# stage (AC inside parallelize_stage) and moe with FSDP2 over edp (the expert dispatch replayed).
# The no-SP accumulation and Ulysses x FSDP2 cases recompute the same kinds of collective.
QUICK = ("dp_replicate=2 x tp=2 (SP)", "pp=2 x tp=2 (SP), 1f1b", "moe: dp_shard=4, ep=2 (experts FSDP2 over edp)")


@pytest.mark.world(4, timeout=180)
@pytest.mark.parametrize("ac", ["full", "selective"])
@pytest.mark.parametrize("overrides", tiered(LAYOUTS, QUICK))
def test_ac_layout_matches_one_process(ac, overrides):
    _check(ac, _run(ac, overrides), ring=False)


@pytest.mark.world(4, timeout=120)
def test_full_ac_in_check_mode():
    # the recompute runs outside the tp forward's agreement: it checks op by op, and still matches
    _check("full", _run("full", dict(checks=True, steps=1)), ring=False)


@pytest.mark.slow
@pytest.mark.world(4, timeout=240)
@pytest.mark.parametrize("ac", ["full", "selective"])
@pytest.mark.parametrize("overrides", list(SLOW.values()), ids=list(SLOW))
def test_ac_layout_matches_one_process_slow(ac, overrides):
    _check(ac, _run(ac, overrides), ring="cp_ring" in overrides)


def test_ac_flag_reaches_the_config():
    assert config_from_args(build_parser().parse_args(["train", "--ac", "selective"]), world_size=4).ac == "selective"
    assert config_from_args(build_parser().parse_args(["train"]), world_size=4).ac == "none"
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        build_parser().parse_args(["train", "--ac", "offload"])


def test_ac_rejects_unknown_mode_and_conv_ae():
    with pytest.raises(ShardkitError, match="--ac"):
        validate_config(TrainConfig(ac="some"), world_size=4)
    with pytest.raises(ShardkitError, match="--ac selective with --checks"):
        validate_config(TrainConfig(ac="selective", checks=True), world_size=4)
    with pytest.raises(ShardkitError, match="--ac full with --model conv-ae"):
        validate_config(TrainConfig(model="conv-ae", ac="full", tp=1, spatial=2, batch_size=4, seq_len=2), world_size=4)


@pytest.mark.world(4, timeout=180)
def test_saved_activation_bytes_reach_the_report_and_metrics():
    folder = shared_tmpdir("ac-report")
    try:
        runs = {
            ac: train(
                validate_config(
                    TrainConfig(**{**SMALL, "verify": False, "steps": 1, "ac": ac, "report": f"{folder}/{ac}"}),
                    world_size=world_size(),
                ),
                "gloo",
                torch.device("cpu"),
                time.perf_counter(),
                progress=False,
            )
            for ac in ("none", "full", "selective")
        }
        if rank() == 0:
            kept = {ac: r["saved_activation_bytes"] for ac, r in runs.items()}
            assert all(len(v) == world_size() and all(b > 0 for b in v) for v in kept.values()), kept
            assert all(f < s < n for f, s, n in zip(kept["full"], kept["selective"], kept["none"])), kept
            for ac, r in runs.items():
                line = json.loads(open(f"{folder}/{ac}/metrics.jsonl").read().splitlines()[0])
                assert line["saved_activation_bytes"] == kept[ac][0] == sum(r["saved_bytes_per_block"])
    finally:
        remove_shared_dir(folder)
