"""Runs of ``shardkit train`` inside a test world, for the resume tests (tests/train/test_resume.py,
tests/data_parallel/test_zero_resume.py)."""

from __future__ import annotations

import time

import torch

from shardkit.train.checkpoint_dir import check_checkpoint_dir
from shardkit.train.config import TrainConfig, validate_config
from shardkit.train.run import train

from .helpers import world_size

# the tiny float64 run every resume case starts from (its options override these)
BASE = dict(seq_len=16, batch_size=4, dtype="float64", layers=2, lr=1e-3)


def run_train(**kw):
    """``shardkit train`` in this world: the checks before launch (layout, then the directory), then the run."""
    cfg = validate_config(TrainConfig(**{**BASE, **kw}), world_size=world_size())
    check_checkpoint_dir(cfg)
    return train(cfg, "gloo", torch.device("cpu"), time.perf_counter(), progress=False)


def run_losses(result):
    """Rank 0's ``(losses, first step)`` of a run's result, on every rank."""
    box = [None if result is None else (result["losses"], result.get("first_step"))]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]
