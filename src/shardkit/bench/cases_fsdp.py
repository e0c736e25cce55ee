"""FSDP2 + tensor parallelism: a shardkit training step against the same step built from PyTorch alone.

Four ranks as ``dp_shard=2 x tp=2`` (tp the inner dim in both), the same ``LlamaForCausalLM``
checkpoint (float32, sdpa) and the same batch rows per data-parallel rank. One step =
``zero_grad``, forward with ``labels`` (HF's causal-LM loss), backward, ``AdamW.step``:

- ``shardkit``: :func:`shardkit.parallelize` on ``ParallelDims(dp_shard=2, tp=2).build_mesh()``:
  shardkit's tensor-parallel layers from the model's HF plan, then FSDP2 ``fully_shard`` per
  decoder layer and on the root (``apply_fsdp``), and ``GradientSync.reduce`` before the step;
- ``torch``: ``init_device_mesh("cpu", (2, 2), ("dp", "tp"))``, DTensor ``parallelize_module``
  on ``mesh["tp"]`` (torchtitan's plan, as in the ``tp_step`` case) and ``fully_shard`` per
  decoder layer and on the root on ``mesh["dp"]``, torchtitan's order.

Both reduce gradients as sums over dp (``set_gradient_divide_factor(1.0)``, sums for the
communication: gloo has no ``PREMUL_SUM``), so the two steps compute the same update.
Checked before timing, on a first step with SGD at lr 1 (the update is the gradient itself):
its loss averaged over the ranks (rtol 1e-4) and a few full parameters after it (rtol 1e-3;
sums run in different orders). The timed steps use AdamW.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from .. import ParallelDims
from ..parallelize import gather_full_parameters, parallelize
from ._method import Record, Settings, agree, close, time_interleaved
from .cases_tp import CHECKED, SHAPES, dtensor_tp, load_llama, save_llama

__all__ = ["fsdp_tp_step"]

DP, TP = 2, 2


def _shardkit(path: str, dev: torch.device):
    """(step module, backward hook before the optimizer, full parameters on rank 0, dp rank)."""

    mesh = ParallelDims(dp_shard=DP, tp=TP).build_mesh(dev.type)
    pm = parallelize(load_llama(path).to(dev), mesh, grad_reduce="sum")
    return pm.module, pm.grads.reduce, lambda: gather_full_parameters(pm), pm.mesh.local_rank("dp")


def _torch(path: str, dev: torch.device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(dev.type, (DP, TP), mesh_dim_names=("dp", "tp"))
    model = dtensor_tp(load_llama(path).to(dev), mesh["tp"], sp=False)
    for module in [*model.model.layers, model]:
        fully_shard(module, mesh=mesh["dp"])
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)

    def full():
        params = dict(model.named_parameters())
        return {n: params[n].full_tensor() for n in CHECKED}  # collective: every rank calls it

    return model, lambda: None, full, mesh["dp"].get_local_rank()


def fsdp_tp_step(pg, settings: Settings) -> list[Record]:
    import transformers as tf

    rank, n = dist.get_rank(pg), dist.get_world_size(pg)
    if n != DP * TP:
        raise ValueError(f"fsdp_tp_step runs on {DP * TP} ranks, got {n}")
    tf.logging.set_verbosity_error()
    tf.utils.logging.disable_progress_bar()
    shape = "tiny" if settings.quick else "small"
    cfg_kw, (batch, seq) = SHAPES[shape]
    batch *= DP  # the shape's batch per data-parallel rank
    ids = torch.randint(0, cfg_kw["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(1))
    ids = ids.to(settings.torch_device)
    steps, seen = {}, {}
    with save_llama(cfg_kw, pg) as path:
        for name, build in (("shardkit", _shardkit), ("torch", _torch)):
            model, reduce, full, dp_rank = build(path, ids.device)
            model.train()
            rows = ids.chunk(DP)[dp_rank]

            def step(opt, model=model, reduce=reduce, rows=rows):
                opt.zero_grad(set_to_none=True)
                loss = model(input_ids=rows, labels=rows).loss
                loss.backward()
                reduce()
                opt.step()
                return loss.detach()

            # The checked step is plain SGD at lr 1: the update is the gradient itself, so a wrong
            # gradient scale (that Adam would normalize away) shows in the parameters.
            loss = step(torch.optim.SGD(model.parameters(), lr=1.0)).reshape(1).to(torch.float64)
            dist.all_reduce(loss, group=pg)
            seen[name] = (loss.item() / n, full())
            steps[name] = functools.partial(step, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False))
    bad = []
    (ref_loss, ref), (loss_t, other) = seen["shardkit"], seen["torch"]
    if abs(ref_loss - loss_t) > 1e-4 * abs(ref_loss):
        bad.append(f"mean loss: shardkit {ref_loss} vs torch {loss_t}")
    if rank == 0:  # shardkit's full parameters exist on rank 0 only
        for p in CHECKED:
            a, b = ref[p], other[p]
            if not close(a, b, rtol=1e-3, atol=1e-5 * b.abs().max().item()):
                bad.append(f"updated {p}: shardkit vs torch")
    agree(bad, pg, "fsdp_tp_step variants disagree")
    times = time_interleaved(steps, pg, settings)
    rec = Record(
        "fsdp_tp_step",
        dict(label=f"dp_shard={DP} x tp={TP} {shape}", shape=shape, batch=batch, seq=seq, loss=ref_loss, **cfg_kw),
        n,
        times,
        checked="SGD lr 1 first step: mean loss (rtol 1e-4), full updated params (rtol 1e-3)",
    )
    return [rec.ratio("shardkit/torch", "shardkit", "torch", 1.0)]
