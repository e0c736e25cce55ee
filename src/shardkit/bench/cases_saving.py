"""What a checkpoint save costs the step that saves (``shardkit train --async-checkpoint``,
issue 33 item 5).

One ``shardkit train`` model (tp over the world, a mid-size config so that a step is not all
fixed cost) and three variants per round, interleaved (docs/design.md (Benchmarks)):

* ``plain``: a training step;
* ``async``: a training step, then :func:`~shardkit.checkpoint.save_train_state` with
  ``background=``: it waits for the previous background save (if its write is still running),
  checks the state, stages it to CPU memory and returns; the write runs behind the next ops;
* ``sync``: a training step, then the foreground save (write, checksums, commit).

Ratios ``async/plain`` (goal 1.1: a saving step within 10 % of a plain one) and ``sync/plain``.
On the CPU the staging copy is a memory copy of the whole state and the background write
competes with the steps for the same cores: both show in the ratio.

Checked: after the timed rounds, the state saved by both paths from the same weights has the
same bytes (every item's SHA-256 in the two manifests equal).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch.distributed as dist

from ..checkpoint import MANIFEST, save_train_state
from ..checkpoint.background import BackgroundSaves
from ..checkpoint.versioned import broadcast_from_first
from ..train.config import TrainConfig, parallel_dims, validate_config
from ..train.run import build_parallel_model, build_task, build_train_model
from ..train.trainer import make_optimizer
from ..train.trainer import train_step as step
from ._method import Record, Settings, agree, time_interleaved

__all__ = ["async_checkpoint"]


def _items(path: str) -> dict:
    with open(os.path.join(path, MANIFEST)) as f:
        return json.load(f)["checksums"]["items"]


def async_checkpoint(pg, settings: Settings) -> list[Record]:
    """A training step against the same step followed by a background save and by a foreground save."""
    n = dist.get_world_size(pg)
    hidden, layers = (128, 2) if settings.quick else (256, 4)
    cfg = validate_config(
        TrainConfig(nproc=n, tp=n, seq_len=128, batch_size=8, hidden_size=hidden, layers=layers), world_size=n
    )
    dev = settings.torch_device
    task = build_task(cfg, dev)
    pm, _ = build_parallel_model(build_train_model(cfg), parallel_dims(cfg).build_mesh(dev.type), cfg, task, dev)
    optimizer = make_optimizer(pm.module, cfg.lr or 1e-3)
    top = broadcast_from_first(pg, tempfile.mkdtemp(prefix="shardkit-bench-ckpt-") if dist.get_rank(pg) == 0 else None)
    roots = {v: os.path.join(top, v) for v in ("async", "sync")}
    count = [0]

    def train() -> None:
        step(pm, optimizer, task, max_norm=cfg.max_norm)

    def save(variant: str, background=None) -> str:
        count[0] += 1  # a new save number each time (saves are never replaced)
        return save_train_state(roots[variant], pm, optimizer, count[0], {}, keep=1, background=background)

    try:
        with BackgroundSaves(roots["async"], pg, "bench async_checkpoint") as behind:

            def saving_async() -> None:
                train()
                save("async", behind)

            def saving_sync() -> None:
                train()
                save("sync")

            fns = {"plain": train, "async": saving_async, "sync": saving_sync}
            times = time_interleaved(fns, pg, settings)
            staged = behind.stager.staged_bytes
            a = save("async", behind)  # the same weights, both ways
            behind.wait()
            s = save("sync")
        same = dist.get_rank(pg) != 0 or _items(a) == _items(s)
        agree([] if same else ["the background save's bytes differ from the foreground save's"], pg, "async_checkpoint")
    finally:
        dist.barrier(group=pg)
        if dist.get_rank(pg) == 0:
            shutil.rmtree(top, ignore_errors=True)
    rec = Record(
        "async_checkpoint",
        dict(
            label=f"{cfg.model} tp={n} hidden {cfg.hidden_size} layers {cfg.layers} seq {cfg.seq_len} "
            f"batch {cfg.batch_size}: {staged / 2**20:.1f} MiB staged per rank"
        ),
        n,
        times,
        checked="a background and a foreground save of the same weights hold the same bytes (item checksums)",
    )
    return [rec.ratio("async/plain", "async", "plain", 1.1).ratio("sync/plain", "sync", "plain")]
