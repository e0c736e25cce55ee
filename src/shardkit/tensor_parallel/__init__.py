"""Tensor parallelism (with Megatron sequence parallelism) applied to existing models.

Styles shard one ``nn.Linear`` (:class:`ColwiseParallel`, :class:`RowwiseParallel`); plans such
as :func:`apply_llama_tp` apply them, plus the activation hooks, to a whole model from outside
its code; :func:`gather_full_state_dict` brings the full weights back.
"""

from .gather import gather_full_grads, gather_full_state_dict, unwrap
from .llama import apply_llama_tp, check_llama_tp
from .sequence import SequenceSharding
from .styles import ColwiseParallel, RowwiseParallel, ShardSpec, shard_spec, sum_grad_over

__all__ = [
    "ColwiseParallel",
    "RowwiseParallel",
    "ShardSpec",
    "shard_spec",
    "sum_grad_over",
    "SequenceSharding",
    "apply_llama_tp",
    "check_llama_tp",
    "gather_full_state_dict",
    "gather_full_grads",
    "unwrap",
]
