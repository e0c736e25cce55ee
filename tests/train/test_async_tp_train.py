"""``shardkit train --async-tp``: the collective-matmul rings in the trainer, against one process
(``--verify``, float64, 1e-9), alone and with activation checkpointing (the recompute runs the
gather ring again and keeps its gathered input), with pp 2 and with FSDP2 (dp_shard 2); the
ledger of a run holds ring steps and no whole sequence all-gather or reduce-scatter; the
refusals without sequence parallelism or with tp 1."""

import time

import pytest
import torch

from harness.helpers import rank, world_size
from shardkit.errors import ShardkitError
from shardkit.train.config import TrainConfig, validate_config
from shardkit.train.run import train

SMALL = dict(steps=2, seq_len=15, batch_size=4, dtype="float64", verify=True, layers=2, lr=1e-3, async_tp=True)


def _run(**overrides) -> dict | None:
    cfg = validate_config(TrainConfig(**{**SMALL, **overrides}), world_size=world_size())
    return train(cfg, "gloo", torch.device("cpu"), time.perf_counter(), progress=False)


def _check(result: dict | None) -> None:
    if rank() != 0:
        assert result is None
        return
    parity = result["parity"]
    assert parity["passed"], parity
    assert parity["max_param_rel_diff"] <= 1e-9
    apis = {(row["op"], row["api"]) for row in result["ledger"] if row["axis"] == "tp"}
    assert ("send", "all_gather_matmul") in apis and ("send", "matmul_reduce_scatter") in apis, apis
    assert not {a for a in apis if a[1] in ("all_gather", "reduce_scatter")}, apis


@pytest.mark.world(2)
@pytest.mark.combinations
@pytest.mark.parametrize("ac", ["none", "full", "selective"])
def test_async_tp_verify_tp2(ac):
    _check(_run(tp=2, ac=ac))


@pytest.mark.world(4)
@pytest.mark.combinations
@pytest.mark.parametrize(
    "layout",
    [
        dict(pp=2, tp=2, microbatches=2),
        dict(tp=2, dp_shard=2),
        # zero bubble: I leaves the weight gradients (and the regather ring) to W
        dict(pp=2, tp=2, microbatches=4, batch_size=8, schedule="zbv", virtual_stages=2, layers=4),
    ],
    ids=["pp2", "fsdp2", "zbv"],
)
def test_async_tp_verify_tp2_composed(layout):
    _check(_run(**layout))


@pytest.mark.parametrize(
    "overrides,match",
    [(dict(tp=1, dp_replicate=2), "--tp 1"), (dict(tp=2, sequence_parallel=False), "sequence parallelism off")],
)
def test_async_tp_refused_without_sp(overrides, match):
    with pytest.raises(ShardkitError, match=match):
        validate_config(TrainConfig(**{**SMALL, **overrides}), world_size=2)


def test_parallelize_refuses_async_tp_without_a_tp_group():
    """``parallelize(..., async_tp=True)`` on one process (no tp group, no SP): one clear error."""
    from harness.tiny_lm import tiny_decoder
    from shardkit import parallelize

    with pytest.raises(ShardkitError, match="async_tp=True needs sequence parallelism over tp > 1"):
        parallelize(tiny_decoder(), None, async_tp=True)
