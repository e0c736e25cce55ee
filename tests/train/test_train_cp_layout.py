"""``shardkit train --cp-layout``: ring cp in the contiguous (Llama 3) and stripe placements passes ``--verify``.

Each run is the trainer every rank runs (:func:`shardkit.train.run.train`) in a persistent gloo
world, float64, compared on rank 0 with the same trainer at every degree 1 (relative 1e-9 on
every loss, gradient norm and final parameter); the refusals are pure config checks.
"""

import time

import pytest
import torch

from harness.helpers import SMALL_CORPUS, rank, world_size
from shardkit import ShardkitError
from shardkit.parallelize import decoder
from shardkit.train.config import TrainConfig, validate_config
from shardkit.train.run import train

CORPUS = SMALL_CORPUS
SMALL = dict(steps=2, seq_len=16, batch_size=4, dtype="float64", verify=True, layers=2, lr=1e-3, data=CORPUS)


@pytest.mark.world(4, timeout=240)
@pytest.mark.parametrize(
    "overrides",
    [
        dict(cp_ring=2, dp_shard=2, cp_layout="stripe"),
        dict(model="qwen2", cp_ring=2, tp=2, cp_layout="contiguous", packed=True, batch_size=1, seq_len=64),
    ],
    ids=["stripe x fsdp", "contiguous packed x tp"],
)
def test_cp_layout_matches_one_process(overrides):
    cfg = validate_config(TrainConfig(**{**SMALL, **overrides}), world_size=world_size())
    seen, original = [], decoder.apply_cp

    def recording(*args, **kwargs):  # the placement the trainer asked apply_cp for, on this rank
        seen.append(kwargs.get("ring_layout"))
        return original(*args, **kwargs)

    decoder.apply_cp = recording
    try:
        result = train(cfg, "gloo", torch.device("cpu"), time.perf_counter(), progress=False)
    finally:
        decoder.apply_cp = original
    assert seen == [overrides["cp_layout"]], seen
    if rank() == 0:
        parity = result["parity"]
        assert parity["passed"] and parity["tolerance"] == 1e-9, parity
        assert result["config"]["cp_layout"] == overrides["cp_layout"]


@pytest.mark.parametrize(
    "overrides",
    [
        dict(cp_layout="stripe", cp_ulysses=2, nproc=2),  # not ring alone
        dict(cp_layout="contiguous", nproc=2),  # no ring cp at all
        dict(cp_layout="stripe", cp_ring=2, packed=True, batch_size=1, nproc=2),  # stripe: one sequence
        dict(cp_layout="llama3", cp_ring=2, nproc=2),  # not a layout name
    ],
)
def test_cp_layout_refusals(overrides):
    with pytest.raises(ShardkitError, match="--cp-layout"):
        validate_config(TrainConfig(**{**SMALL, **overrides}), world_size=2)
