"""The one trainer of ``shardkit train``: one ``train_step`` for every layout, and ``--verify``.

A step, whatever the layout (``dp x pp x cp x tp x ep``, FSDP2 or not, spatial for conv models):

1. every rank draws the same global batch; ``N`` = its global target count (no collective);
2. this rank keeps its data-parallel rows, cut into ``M`` microbatches (gradient accumulation);
3. without a pipeline, each microbatch runs forward and ``backward(loss_sum / N)``; with one, the
   schedule (any of ``--schedule``, on ``--virtual-stages`` chunks per rank) runs the
   microbatches through the stages (one branch). Either way FSDP2 is told which microbatch runs
   (:func:`~shardkit.data_parallel.set_microbatch`; on virtual stages the chunked runner tells
   each FSDP2 group which backward step is its last): it gathers each block once per step and
   reduces its gradients once, after the last backward (or ``W``) through it;
4. :class:`~shardkit.data_parallel.GradientSync` sums what FSDP2 does not reduce over the ranks
   holding different data, then clips by the global norm (every parameter counted once);
5. the global loss is summed over the world;
6. the host reads the global loss sum and the gradient norm once, in one tensor (the step's only
   device-to-host read outside the model: :mod:`shardkit.comm.host_sync` counts them); the
   optimizer steps only if both are finite (both are all-reduced, so every rank takes the same
   decision without another collective); the learning-rate schedule steps either way (it is a
   function of the step count).

``--verify`` is this same code with every degree 1: :func:`~shardkit.parallelize.parallelize`
with no mesh changes nothing, and the reductions over size-1 groups are the identity.

Source: Megatron-LM's ``train_step`` (microbatches, ``finalize_model_grads``, global-norm
clipping, loss normalized by the global token count); torchtitan's trainer (one loop for FSDP2 +
TP + PP + CP).
"""

from __future__ import annotations

import functools
import math
import sys
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..comm import _c10d
from ..comm._group import resolve_group
from ..comm.host_sync import host_side
from ..data_parallel import GradientSync, ZeroAdamW, ZeroSync, set_microbatch
from ..errors import NonFiniteError, ShardkitError
from ..pipeline_parallel import run_schedule

__all__ = ["ADAM_EPS", "StepStats", "make_optimizer", "train_step", "LossScale", "nonfinite_step"]

# AdamW's eps, above the float32 rounding floor of the gradients. With the default 1e-8 an
# element whose exact gradient is ~0 gets a rounding-noise gradient (~1e-9 against typical
# 1e-3..1e-2 here) of the same order as eps, and Adam's first step g / (|g| + eps) turns that
# noise into an O(0.1 * lr) update: --verify measured per-tensor differences of 8e-5 in float32
# (tp=1 x dp=4, one element of 4096 in an o_proj) from that alone, next to the 1e-4 tolerance.
# 1e-6 damps such elements and is still far below real gradients, so training is unchanged.
ADAM_EPS = 1e-6


def make_optimizer(module: torch.nn.Module, lr: float, grads: GradientSync | None = None) -> torch.optim.Optimizer:
    """AdamW over every parameter, ``eps`` = :data:`ADAM_EPS`.

    AdamW is elementwise, so a shard's update (tp, ep, FSDP2) is exactly the matching block of
    the full tensor's update: the optimizer needs no parallelism of its own. With ``grads`` a
    :class:`~shardkit.data_parallel.ZeroSync` (``--zero``), AdamW over its slices instead
    (:class:`~shardkit.data_parallel.ZeroAdamW`: it all-gathers the parameters after each step).
    """
    if isinstance(grads, ZeroSync):
        return ZeroAdamW(grads, lr=lr, eps=ADAM_EPS)
    return torch.optim.AdamW(module.parameters(), lr=lr, eps=ADAM_EPS)


@dataclass
class StepStats:
    """One step: global mean loss, global gradient norm (before clipping), targets, seconds.

    ``skipped``: the loss or the norm was not finite, so the optimizer did not step (the same on
    every rank: both values are global). ``moe``: the MoE balancing metrics of the step
    (:meth:`.moe_balance.MoEBalance.after_step`), None without the ``--moe-*`` flags.
    """

    loss: float
    grad_norm: float
    targets: int
    seconds: float
    skipped: bool = False
    moe: dict | None = None


class LossScale:
    """The pipeline's last-stage loss function: ``loss_sum / N`` with the step's ``N``.

    The schedule runner divides every microbatch loss by ``M`` (its mean convention); the loss
    here is already a share of the global sum, so it is multiplied by ``M`` first.

    The stage is built with this loss, and the loss needs the built model (its mesh and stage):
    :meth:`bind` hands it over once built, before the first step.
    """

    def __init__(self, task, pm_ref: list | None = None) -> None:
        self.task, self.pm = task, None
        self.scale = 1.0
        self._ref = pm_ref
        if pm_ref is not None:
            warnings.warn(
                "LossScale(task, pm_ref) is deprecated: use LossScale(task) and loss.bind(pm) once the "
                "model is built (removed in the next release)",
                DeprecationWarning,
                stacklevel=2,
            )

    def bind(self, pm) -> None:
        """The parallel model whose last stage computes this loss."""
        self.pm = pm

    def __call__(self, logits, labels):
        if self.pm is None and self._ref is not None:  # the deprecated holder list
            self.pm = self._ref[0]
        if self.pm is None:
            raise ShardkitError("LossScale: no model bound (call bind(pm) once the pipeline stage is built)")
        return self.task.loss_sum(logits, labels, self.pm) * self.scale


def _counts_loss(pm) -> bool:
    """Whether this rank's loss sum is part of the global one: its data is not a copy (tp ranks
    hold the same tokens) and it computes the loss (the last pipeline stage)."""
    if pm.mesh is None:
        return True
    last = pm.stage is None or pm.stage.is_last
    return last and pm.mesh.local_rank("tp") == 0


def _global_sum_tensor(value: torch.Tensor, pm) -> torch.Tensor:
    """Sum of every counted rank's ``value`` (0-d, or a pipeline's pair), left on its device (one
    world all-reduce; none in one process)."""
    if pm.mesh is None or dist.get_world_size() == 1:
        return value
    world = resolve_group(dist.group.WORLD, "train_step")
    return _c10d.all_reduce(value.reshape(-1), world, "train_loss", "forward").reshape(value.shape)


def _global_sum(value: torch.Tensor, pm) -> float:
    """:func:`_global_sum_tensor` read as a float."""
    return _global_sum_tensor(value, pm).item()


def _pipeline_backward(
    pm, task, microbatches: list, schedule: str, loss_scale: LossScale, train: bool = True
) -> torch.Tensor:
    """Run the schedule over this rank's microbatches (``train=False``: its forwards only, the
    validation loss); return the last stage's loss sum (else 0).

    The scaling convention: the stage's loss is ``loss_sum * scale`` (:class:`LossScale`) with
    ``scale`` multiplied by ``M`` here, and the runner back-propagates ``loss / M`` (its default
    ``scale_grads=True``): the ``M`` cancel, so the gradients are those of the sum of the
    microbatches' loss sums times the step's ``1 / N`` (``N`` the global target count), as
    gradient accumulation's. The returned sum divides the ``M`` back out."""
    stage = pm.stage
    M = len(microbatches)
    prepared = [task.prepare(mb, pm) for mb in microbatches]
    inputs = [p[0]["input_ids"] for p in prepared]
    kwargs = [{k: v for k, v in p[0].items() if k not in ("input_ids", "use_cache")} for p in prepared]
    targets = [p[1] for p in prepared]
    if any(getattr(m, "required_kwargs", ()) for m in stage.modules):  # sequence-parallel boundaries
        kwargs = [{"seq_len": x.shape[1], **kw} for x, kw in zip(inputs, kwargs)]
    loss_scale.scale *= M
    kw = kwargs if any(kwargs) else None
    # The stages' activations are [b, S, H] for inputs [b, S]: the same microbatch shapes as the
    # previous step's mean the same messages, so the runner trusts the shapes it negotiated and
    # reads no received header on the host (train_step reads the flag of a broken promise).
    key = tuple(
        (tuple(x.shape), tuple((k, tuple(v.shape)) for k, v in sorted(kw_.items()) if isinstance(v, torch.Tensor)))
        for x, kw_ in zip(inputs, kwargs)
    )
    losses = run_schedule(
        stage, schedule, inputs, targets, stage_kwargs=kw, num_microbatches=M, shape_key=key, train=train
    )
    dtype = torch.float64
    if losses is None:  # only the last stage has losses
        return torch.zeros((), dtype=dtype, device=inputs[0].device)
    return torch.stack([loss.to(dtype) for loss in losses]).sum() / loss_scale.scale


def train_step(
    pm,
    optimizer,
    task,
    *,
    microbatches: int = 1,
    max_norm: float | None = None,
    schedule: str = "1f1b",
    loss_scale: LossScale | None = None,
    scheduler=None,
    after_step=None,
) -> StepStats:
    """One optimizer step of ``pm`` on the task's next global batch.

    Args:
        pm: a :class:`~shardkit.parallelize.ParallelModel` (``pm.mesh`` None: one process).
        optimizer: over ``pm.module``'s parameters.
        task: ``next_batch``, ``count``, ``microbatches``, ``prepare``, ``forward`` and
            ``loss_sum`` (:class:`.lm_task.LMTask`, :class:`.conv_ae.ConvAETask`).
        microbatches: ``M`` per step and data-parallel rank (gradient accumulation, or the
            pipeline's microbatches).
        max_norm: clip the global gradient norm to this (None: measure only).
        schedule: pipeline schedule name.
        loss_scale: the pipeline stage's loss function (with ``pp > 1``).
        scheduler: a learning-rate scheduler stepped after the optimizer, or None.
        after_step: ``fn(skipped) -> dict`` run after the optimizer (collective over the world:
            :meth:`.moe_balance.MoEBalance.after_step`), its result in ``StepStats.moe``; or None.

    Returns:
        :class:`StepStats` (the same on every rank). A step whose global loss or gradient norm
        is NaN or infinite is not applied: its gradients are dropped, the optimizer does not
        step (``skipped=True``); the scheduler still steps. The caller decides whether to stop.

    Collective over the world.
    """
    t0 = time.perf_counter()
    mesh = pm.mesh
    dp, dp_rank = (1, 0) if mesh is None else (mesh.size("dp"), mesh.local_rank("dp"))
    with host_side():  # the sampled batch stays on the host until prepare copies it
        batch = task.next_batch()
        n = task.count(batch)
        mbs = task.microbatches(batch, dp_rank, dp, microbatches)
    if pm.stage is None:
        sums = []
        for k, mb in enumerate(mbs):
            set_microbatch(pm.module, k, len(mbs))  # FSDP2 gathers once and reduces after the last
            inputs, targets = task.prepare(mb, pm)
            loss_sum = task.loss_sum(task.forward(pm.module, inputs), targets, pm)
            (loss_sum / n).backward()
            sums.append(loss_sum.detach())
        local = functools.reduce(torch.add, sums).to(torch.float64)  # summed in the loss dtype
    else:
        if loss_scale is None:
            raise ValueError("train_step: a pipeline stage (pm.stage) needs its loss_scale")
        loss_scale.scale = 1.0 / n
        local = _pipeline_backward(pm, task, mbs, schedule, loss_scale)
    pm.grads.reduce()
    norm_t = pm.grads.clip_norm_(max_norm)
    # The loss is reduced before the optimizer steps, so a non-finite step is never applied.
    contribution = local if _counts_loss(pm) else torch.zeros_like(local)
    if pm.stage is None:
        loss_sum_t = _global_sum_tensor(contribution, pm)  # on the device already
        # the step's one device-to-host read: the loss sum and the norm together (both float64)
        loss_sum, norm = torch.stack([loss_sum_t.to(norm_t.dtype), norm_t]).tolist()
    else:
        # A pipeline adds the flag of its trusted shapes (ShapeTrust) to the same all-reduce and
        # the same read, so that a broken shape promise raises on every rank, at no extra sync.
        flag = pm.stage.shape_trust.take()
        flag = torch.zeros_like(contribution) if flag is None else flag.to(contribution.dtype)
        pair = _global_sum_tensor(torch.stack([contribution, flag]), pm)
        loss_sum, mismatch, norm = torch.cat([pair.to(norm_t.dtype), norm_t.reshape(1)]).tolist()
        if mismatch:
            raise ShardkitError(
                "train_step: a pipeline message did not have the shape negotiated in the previous step, "
                "although this step's microbatches have the same shapes (the stages' activation shapes "
                "must follow from the input shapes); rerun with --checks to find it"
            )
    loss = loss_sum / n
    skipped = not (math.isfinite(loss) and math.isfinite(norm))
    if not skipped:
        optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    moe = after_step(skipped) if after_step is not None else None
    return StepStats(loss, norm, n, time.perf_counter() - t0, skipped, moe)


def nonfinite_step(step: int, stats, lr: float, seen: int, allowed: int) -> None:
    """A step whose global loss or gradient norm was not finite (it was not applied): raise
    :class:`~shardkit.errors.NonFiniteError` once more than ``allowed`` (``--skip-nonfinite``)
    were seen in this run, else say on rank 0 that it was skipped. Both values are global, so
    every rank takes the same branch."""
    bad = [
        f"{name} ({value})"
        for name, value in (("loss", stats.loss), ("gradient norm", stats.grad_norm))
        if not math.isfinite(value)
    ]
    where = (
        f"step {step + 1}: the global {' and '.join(bad)} {'is' if len(bad) == 1 else 'are'} not finite; "
        "the step was not applied"
    )
    if seen > allowed:
        raise NonFiniteError(
            f"{where}. Stopping: {seen} non-finite step(s) in this run, --skip-nonfinite allows "
            f"{allowed}. Nothing later was saved; lower --lr (this step's: {lr:g}) or look for a "
            "NaN in the data or the checkpoint"
        )
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"shardkit train: {where} (skipped {seen} of --skip-nonfinite {allowed})", file=sys.stderr, flush=True)
