"""Data parallelism of a composed layout: FSDP2 / HSDP wrapping and the one gradient-reduction path.

* :func:`apply_fsdp`: FSDP2 ``fully_shard`` over ``dp_shard x cp`` (HSDP with ``dp_replicate``).
* :class:`GradientSync`: after the last backward of a step, sums what FSDP2 does not reduce over
  ``dp_cp`` (dense) and ``edp`` (experts), divides by the data ranks for ``grad_reduce="mean"``
  (DDP's average), and clips by the global norm.
* :class:`ZeroSync` and :class:`ZeroAdamW`: ZeRO-1 / ZeRO-2, the optimizer state (and the reduced
  gradients) in ``1 / R`` slices of flat buckets over the data ranks, parameters replicated.
* :func:`set_microbatch`: "this is microbatch k of M": FSDP2 gathers a block once per step and
  reduces its gradient once, after the last microbatch's backward.
* :func:`global_mean_loss`: the loss to back-propagate for the global token mean when data ranks
  count different numbers of tokens.
"""

from .fsdp import apply_fsdp
from .grads import GradientSync, GradReduce, ParamLayout
from .loss import global_mean_loss
from .microbatches import set_microbatch
from .zero import ZeroSync
from .zero_optim import ZeroAdamW

__all__ = [
    "apply_fsdp",
    "GradientSync",
    "GradReduce",
    "ParamLayout",
    "global_mean_loss",
    "set_microbatch",
    "ZeroAdamW",
    "ZeroSync",
]
