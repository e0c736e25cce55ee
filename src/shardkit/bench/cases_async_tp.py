"""Async TP against synchronous sequence parallelism: a Llama training step with
``apply_tp(..., sequence_parallel=True, async_tp=True)`` (collective-matmul rings) against the
same with the synchronous all-gathers and reduce-scatters, interleaved in one process.

One step = ``zero_grad``, forward with ``labels``, backward, ``AdamW.step`` on the
``shardkit.bench.cases_tp`` checkpoints (float32, sdpa), ``sp_activation="shard"`` on both
sides. Checked before timing: the first step's losses agree (rtol 1e-6), gathered gradients and
updated parameters of a few weights agree (rtol 1e-3, as ``tp_step``: the rings sum in another
order, and Adam's first update is about ``lr sign(g)``). No
speed goal: on CPU gloo the ring's transfers and the matmuls compete for the same cores, so the
ratio shows the rings' cost (``t - 1`` messages per collective) more than their overlap.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import apply_tp
from ._method import Record, Settings, agree, close, time_interleaved
from .cases_tp import CHECKED, SHAPES, lm_step, load_llama, save_llama

__all__ = ["async_tp_step"]


def _step_fn(path: str, pg, ids: torch.Tensor, async_tp: bool):
    model = apply_tp(
        load_llama(path).to(ids.device),
        pg,
        sequence_parallel=True,
        check="off",
        sp_activation="shard",
        async_tp=async_tp,
    )
    return lm_step("shardkit", model, ids)


def async_tp_step(pg, settings: Settings) -> list[Record]:
    n = dist.get_world_size(pg)
    records = []
    for shape in ("tiny",) if settings.quick else ("small", "large"):
        cfg_kw, (batch, seq) = SHAPES[shape]
        with save_llama(cfg_kw, pg) as path:
            ids = torch.randint(0, cfg_kw["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(1))
            ids = ids.to(settings.torch_device)
            ring, seen_ring = _step_fn(path, pg, ids, True)
            sync, seen_sync = _step_fn(path, pg, ids, False)
            bad = [] if abs(seen_ring[0] - seen_sync[0]) <= 1e-6 * abs(seen_sync[0]) else ["loss"]
            for kind, k in (("grad", 1), ("param", 2)):
                for name in CHECKED:
                    got, want = seen_ring[k][name], seen_sync[k][name]
                    if not close(got, want, rtol=1e-3, atol=1e-5 * want.abs().max().item()):
                        bad.append(f"{kind} {name}")
            agree(bad, pg, "async_tp_step: async and sync SP disagree")
            times = time_interleaved({"async": ring, "sync": sync}, pg, settings)
            rec = Record(
                "async_tp",
                dict(label=f"tp+sp {shape}", shape=shape, batch=batch, seq=seq, loss=seen_sync[0], **cfg_kw),
                n,
                times,
                checked="first-step loss (rtol 1e-6), gathered grads and updated params (rtol 1e-3)",
            )
            records.append(rec.ratio("async/sync", "async", "sync"))
    return records
