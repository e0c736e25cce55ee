"""What the check mode costs: each op, and a whole ``shardkit train`` step, with and without it.

Per op (``ops``): the op with its sizes given (no metadata collective of its own), timed with
``shardkit.comm.checks(False)`` (``plain``) and ``checks(True)`` (``checks``), interleaved
(docs/design.md (Benchmarks)). The check mode adds one metadata all-gather of ``R x 39`` int64
per forward op, so the ratio is large for latency-bound ops and shrinks with the message size.

Per step (``train_step``): the default ``shardkit train`` layout (dp_replicate=2 x tp=2 with
sequence parallelism, the default model and batch) as two identical models, each with its own
copy of the data sampler, one stepped outside and one inside the check mode, interleaved per
round. Both runs see the same batches from the same weights, so their losses must stay bitwise
equal: checked after the first step and after the last timed round. Goal: ``checks/plain``
within 1.1 (``shardkit train --checks`` within 10 % of a step).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import all_gather, all_to_all, reduce_scatter
from ..comm import all_reduce_forward, checks
from ..context_parallel import ulysses_attention
from ..spatial import halo_exchange
from ..train.config import TrainConfig, parallel_dims, validate_config
from ..train.run import build_parallel_model, build_task, build_train_model
from ..train.trainer import make_optimizer
from ..train.trainer import train_step as step
from ._method import Record, Settings, agree, same_bits, time_interleaved

__all__ = ["ops", "train_step"]

KIB, MIB = 1 << 10, 1 << 20


def _op_fns(nbytes: int, pg, rank: int, n: int, dev: torch.device) -> dict:
    """Each op as a no-argument callable with every size given (bitwise deterministic)."""

    d = 64
    rows = nbytes // 4 // d
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(rows, d, generator=gen).to(dev)
    big = torch.randn(rows * n, d, generator=gen).to(dev)
    a = torch.randn(max(1, rows // 8), 8, d, generator=gen).to(dev)  # [S/R, N, D], N = 8 heads
    q = torch.randn(1, max(1, rows // 64), 8, d, generator=gen).to(dev)  # attention: smaller S (S^2 compute)
    return {
        "all_reduce_forward": lambda: all_reduce_forward(x, pg),
        "all_gather": lambda: all_gather(x, pg, 0, sizes=[rows] * n),
        "reduce_scatter": lambda: reduce_scatter(big, pg, 0),
        "all_to_all": lambda: all_to_all(a, pg, 1, 0, gather_size=a.shape[0] * n),
        "halo_exchange": lambda: halo_exchange(x, pg, 0, 2, 2, sizes=[rows] * n),
        "ulysses_attention": lambda: ulysses_attention(q, q, q, pg, causal=True, seq_len=q.shape[1] * n),
    }


def _with_checks(fn, on: bool):
    def run():
        with checks(on):
            return fn()

    return run


def ops(pg, settings: Settings) -> list[Record]:
    """Each op ``plain`` (check mode off) against ``checks`` (on); float32, sizes given."""
    rank, n = dist.get_rank(pg), dist.get_world_size(pg)
    records = []
    for nbytes in (16 * KIB,) if settings.quick else (16 * KIB, 1 * MIB):
        for name, fn in _op_fns(nbytes, pg, rank, n, settings.torch_device).items():
            fns = {"plain": _with_checks(fn, False), "checks": _with_checks(fn, True)}
            failures = [] if same_bits(fns["plain"](), fns["checks"]()) else [f"{name}: check mode changed the result"]
            agree(failures, pg, f"checks {name} {nbytes} B")
            rec = Record(
                name,
                dict(bytes=nbytes, label=name),
                n,
                time_interleaved(fns, pg, settings),
                checked="bitwise: the result with the check mode on equals the result without",
            )
            records.append(rec.ratio("checks/plain", "checks", "plain"))
    return records


def _trainer(cfg, mesh, device: torch.device):

    task = build_task(cfg, device)
    pm, _ = build_parallel_model(build_train_model(cfg), mesh, cfg, task, device)
    return pm, make_optimizer(pm.module, cfg.lr), task


def train_step(pg, settings: Settings) -> list[Record]:
    """A default ``shardkit train`` step (dp_replicate=2 x tp=2, SP) without and with checks."""

    n = dist.get_world_size(pg)
    cfg = validate_config(TrainConfig(nproc=n), world_size=n)
    dev = settings.torch_device
    mesh = parallel_dims(cfg).build_mesh(dev.type)
    runs = {v: _trainer(cfg, mesh, dev) for v in ("plain", "checks")}
    losses: dict[str, float] = {}

    def stepper(variant: str):
        pm, opt, task = runs[variant]

        def run():
            with checks(variant == "checks"):
                losses[variant] = step(pm, opt, task, max_norm=cfg.max_norm).loss

        return run

    fns = {v: stepper(v) for v in runs}
    for fn in fns.values():
        fn()
    agree([] if losses["plain"] == losses["checks"] else [f"first step losses differ: {losses}"], pg, "train_step")
    times = time_interleaved(fns, pg, settings)
    agree([] if losses["plain"] == losses["checks"] else [f"last step losses differ: {losses}"], pg, "train_step")
    rec = Record(
        "train_step",
        dict(
            label=f"{cfg.model} {parallel_dims(cfg).describe()} seq {cfg.seq_len} "
            f"batch {cfg.batch_size} hidden {cfg.hidden_size}"
        ),
        n,
        times,
        checked="the two runs' losses are bitwise equal after the first and the last step",
    )
    return [rec.ratio("checks/plain", "checks", "plain", 1.1)]
