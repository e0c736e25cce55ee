"""The training step loop, shared by the parallel run and the one-process ``--verify`` reference."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..comm import ledger as _ledger

from .config import TrainConfig

__all__ = ["average_grads", "causal_lm_loss", "make_optimizer", "run_steps"]


def causal_lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: position ``t`` predicts ``ids[:, t + 1]``.

    Not the model's own ``labels=`` loss: transformers' causal-LM loss casts logits to float32,
    which would cap a float64 run at float32 precision (``--verify`` measured 2e-7 loss
    differences in float64 with it). Here half precision is upcast to float32 and float64 stays
    float64.

    Args:
        logits: ``[B, S, V]``.
        ids: ``[B, S]`` int64 token ids.

    Returns:
        0-d loss, float32 or float64.
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


# AdamW's eps, above the float32 rounding floor of the gradients. With the default 1e-8 an
# element whose exact gradient is ~0 gets a rounding-noise gradient (~1e-9 against typical
# 1e-3..1e-2 here) of the same order as eps, and Adam's first step g / (|g| + eps) turns that
# noise into an O(0.1 * lr) update: --verify measured per-tensor differences of 8e-5 in float32
# (tp=1 x dp=4, one element of 4096 in an o_proj) from that alone, next to the 1e-4 tolerance.
# 1e-6 damps such elements and is still far below real gradients, so training is unchanged.
ADAM_EPS = 1e-6


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over every parameter (shards included: AdamW is elementwise, so a shard's update is
    exactly the matching block of the full tensor's update), ``eps`` = :data:`ADAM_EPS`.

    No gradient clipping: it needs a global gradient norm, and the point of ``--verify`` is that
    both runs do the same elementwise math.
    """
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, eps=ADAM_EPS)


def run_steps(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    sampler,
    steps: int,
    device: torch.device,
    rows: Callable[[torch.Tensor], torch.Tensor] = lambda batch: batch,
    reduce_loss: Callable[[torch.Tensor], torch.Tensor] = lambda loss: loss,
    on_step: Callable[[int, float], None] | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = causal_lm_loss,
) -> list[float]:
    """Train ``steps`` steps; return each step's loss, the mean over the global batch.

    Args:
        model: called as ``model(input_ids=ids)``, returns ``.logits`` ``[B, S, V]``.
        optimizer: stepped once per batch, gradients reset to None after.
        sampler: ``next_batch()`` gives the global batch ``[B, S]`` (same on every rank).
        steps: number of steps.
        device: where the batch goes.
        rows: the global batch -> this rank's rows ``[B / dp, S]``.
        reduce_loss: this rank's mean loss (0-d) -> the global mean (0-d).
        on_step: called as ``on_step(step, loss)`` after each step.
        loss_fn: ``loss_fn(logits, ids)``; the vocab-parallel loss for vocab-sharded logits.
    """
    losses = []
    for step in range(steps):
        ids = rows(sampler.next_batch()).to(device)
        loss = loss_fn(model(input_ids=ids).logits, ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(reduce_loss(loss.detach()).item())
        if on_step is not None:
            on_step(step, losses[-1])
    return losses


def average_grads(params: list[torch.nn.Parameter], dp_mesh, api: str) -> None:
    """Average ``.grad`` over dp with one flat all-reduce (recorded in the ledger as ``api``).

    For the loops DDP does not fit (pipeline: it would reduce after every microbatch; context
    parallelism: gradients must first be summed over cp, which DDP cannot do). Every parameter
    must have a gradient.
    """
    dp = dp_mesh.size()
    if dp == 1:
        return
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    _ledger.record("all_reduce", api, "backward", dp, flat.nbytes, flat.nbytes)
    dist.all_reduce(flat, group=dp_mesh.get_group())
    flat /= dp
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))
