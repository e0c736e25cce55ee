"""FSDP2 + tensor parallelism: a shardkit training step against the same step built from PyTorch alone.

Four ranks as ``dp_shard=2 x tp=2`` (tp the inner dim in both), the same ``LlamaForCausalLM``
checkpoint (float32, sdpa) and the same batch rows per data-parallel rank. One step is a
training loop's, as torchtitan's: ``zero_grad``, forward with ``labels`` (HF's causal-LM loss),
backward, the gradient reduction, clipping by the global norm (``max_norm=1``), ``AdamW.step``,
and one host read of the loss summed over the ranks together with the norm:

- ``shardkit``: :func:`shardkit.parallelize` on ``ParallelDims(dp_shard=2, tp=2).build_mesh()``:
  shardkit's tensor-parallel layers from the model's HF plan, then FSDP2 ``fully_shard`` per
  decoder layer and on the root (``apply_fsdp``), ``GradientSync.reduce`` and ``clip_norm_``
  (the norm stays on the device) before the step;
- ``torch``: ``init_device_mesh("cpu", (2, 2), ("dp", "tp"))``, DTensor ``parallelize_module``
  on ``mesh["tp"]`` (torchtitan's plan, as in the ``tp_step`` case) and ``fully_shard`` per
  decoder layer and on the root on ``mesh["dp"]``, torchtitan's order, and the global norm
  from ``torch.nn.utils.get_total_norm`` per device mesh (torch's ``clip_grad_norm_`` takes one
  mesh; the tp-replicated parameters live on the dp mesh alone).

Both reduce gradients as sums over dp (``set_gradient_divide_factor(1.0)``, sums for the
communication: gloo has no ``PREMUL_SUM``), so the two steps compute the same update.
Checked before timing, on a first step with SGD at lr 1 (the update is the gradient itself):
its loss averaged over the ranks and the global gradient norm (rtol 1e-4), and a few full
parameters after it (rtol 1e-3; sums run in different orders). The timed steps use AdamW and
clip.
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


MAX_NORM = 1.0  # both loops clip by the global gradient norm, as torchtitan's does


def _shardkit(path: str, dev: torch.device):
    """(step module, gradient reduction + clipping returning the norm on the device, full
    parameters on rank 0, dp rank)."""

    mesh = ParallelDims(dp_shard=DP, tp=TP).build_mesh(dev.type)
    pm = parallelize(load_llama(path).to(dev), mesh, grad_reduce="sum")

    def reduce_and_clip(max_norm):
        pm.grads.reduce()
        return pm.grads.clip_norm_(max_norm)

    return pm.module, reduce_and_clip, lambda: gather_full_parameters(pm), pm.mesh.local_rank("dp")


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

    def clip(max_norm):
        # The global norm from DTensor gradients, per device mesh (the tp-replicated parameters
        # live on the dp mesh only, and torch's clip_grad_norm_ takes one mesh), then torch's
        # rule on every local shard: scale by min(1, max_norm / (norm + 1e-6)).
        groups: dict = {}
        for p in model.parameters():
            if p.grad is not None:
                groups.setdefault(p.grad.device_mesh, []).append(p.grad)
        squares = [torch.nn.utils.get_total_norm(g).full_tensor() ** 2 for g in groups.values()]
        norm = torch.stack(squares).sum().sqrt()
        if max_norm is not None:
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            for grads in groups.values():
                torch._foreach_mul_([g.to_local() for g in grads], coef)
        return norm

    return model, clip, full, mesh["dp"].get_local_rank()


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

            def step(opt, max_norm=MAX_NORM, model=model, reduce=reduce, rows=rows):
                # A training loop's step as torchtitan runs it: forward, backward, the gradient
                # reduction and global-norm clipping, the optimizer, and one host read of the
                # loss (summed over the ranks) with the norm.
                opt.zero_grad(set_to_none=True)
                loss = model(input_ids=rows, labels=rows).loss
                loss.backward()
                norm = reduce(max_norm)
                opt.step()
                read = torch.stack([loss.detach().to(torch.float64), norm.to(torch.float64)])
                dist.all_reduce(read[:1], group=pg)
                return read.tolist()

            # The checked step is plain SGD at lr 1 without clipping: the update is the gradient
            # itself, so a wrong gradient scale (that Adam would normalize away) shows in the
            # parameters.
            loss_sum, norm = step(torch.optim.SGD(model.parameters(), lr=1.0), max_norm=None)
            seen[name] = (loss_sum / n, full(), norm)
            steps[name] = functools.partial(step, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False))
    bad = []
    (ref_loss, ref, ref_norm), (loss_t, other, norm_t) = seen["shardkit"], seen["torch"]
    if abs(ref_loss - loss_t) > 1e-4 * abs(ref_loss):
        bad.append(f"mean loss: shardkit {ref_loss} vs torch {loss_t}")
    if abs(ref_norm - norm_t) > 1e-4 * abs(ref_norm):
        bad.append(f"global gradient norm: shardkit {ref_norm} vs torch {norm_t}")
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
        checked="SGD lr 1 first step: mean loss, global grad norm (rtol 1e-4), full updated params (rtol 1e-3)",
    )
    return [rec.ratio("shardkit/torch", "shardkit", "torch", 1.0)]
