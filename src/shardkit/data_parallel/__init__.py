"""Data parallelism of a composed layout: FSDP2 / HSDP wrapping and the one gradient-reduction path.

* :func:`apply_fsdp`: FSDP2 ``fully_shard`` over ``dp_shard x cp`` (HSDP with ``dp_replicate``).
* :class:`GradientSync`: after the last backward of a step, sums what FSDP2 does not reduce over
  ``dp_cp`` (dense) and ``edp`` (experts), and clips by the global norm.
"""

from .fsdp import apply_fsdp
from .grads import GradientSync, ParamLayout

__all__ = ["apply_fsdp", "GradientSync", "ParamLayout"]
