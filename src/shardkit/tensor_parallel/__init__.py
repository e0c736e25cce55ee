"""Tensor parallelism (with Megatron sequence parallelism) applied to existing models.

:func:`apply_tp` shards any model from a plan of Hugging Face style strings or
:class:`ParallelStyle` objects (styles declare input/output layouts, ``Replicate()`` /
``Shard(dim)``); ``sequence_parallel=True`` turns a decoder model's plan into its
sequence-parallel plan; :func:`gather_full_state_dict` brings the full weights back. The layouts
and :class:`ShardSpec` are :mod:`shardkit.sharding`'s (re-exported here); checkpoint IO
(``load_sharded``, ``save_sharded_checkpoint``, ...) is :mod:`shardkit.checkpoint`'s.
"""

from .._moved import moved_names
from ..sharding import Replicate, Shard, ShardSpec, shard_parameter, shard_spec
from .apply import apply_tp
from .check import check_tp
from .embedding import EmbeddingParallel
from .gather import gather_full_grads, gather_full_state_dict, unwrap
from .loss import vocab_parallel_cross_entropy
from .moe import MoeIdentityExpert, MoeTensorParallelExperts
from .plan import PlanReport, default_styles, model_tp_plan, verify_tp_plan
from .prepare import PrepareModuleInput, PrepareModuleOutput
from .replicated import MlaKvAProjParallel, ReplicatedWithGradAllReduce, SequenceParallel
from .sequence import SequenceSharding
from .sp_plan import sequence_parallel_plan
from .styles import (
    ColwiseParallel,
    PackedColwiseParallel,
    PackedRowwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    StyleContext,
    sum_grad_over,
)

__all__ = [
    "apply_tp",
    "check_tp",
    "sequence_parallel_plan",
    "Replicate",
    "Shard",
    "PrepareModuleInput",
    "PrepareModuleOutput",
    "vocab_parallel_cross_entropy",
    "verify_tp_plan",
    "PlanReport",
    "default_styles",
    "model_tp_plan",
    "ParallelStyle",
    "StyleContext",
    "ColwiseParallel",
    "RowwiseParallel",
    "PackedColwiseParallel",
    "PackedRowwiseParallel",
    "EmbeddingParallel",
    "SequenceParallel",
    "ReplicatedWithGradAllReduce",
    "MlaKvAProjParallel",
    "MoeTensorParallelExperts",
    "MoeIdentityExpert",
    "ShardSpec",
    "shard_spec",
    "shard_parameter",
    "sum_grad_over",
    "SequenceSharding",
    "gather_full_state_dict",
    "gather_full_grads",
    "unwrap",
]

# Checkpoint IO moved to shardkit.checkpoint (deprecated here for one release).
__getattr__ = moved_names(
    __name__,
    dict.fromkeys(
        (
            "load_sharded",
            "SafetensorsCheckpoint",
            "materialize_meta",
            "save_sharded_checkpoint",
            "load_sharded_checkpoint",
        ),
        "shardkit.checkpoint",
    ),
)
