"""shardkit: autograd-aware communication for hybrid model parallelism.

Tensor / sequence, context, expert, pipeline and spatial parallelism built from exact,
differentiable collectives that run the same on CPU (gloo) and GPU (NCCL).
"""

from ._shapes import balanced_split_sizes
from .comm import (
    CommLedger,
    all_gather,
    all_reduce_backward,
    all_reduce_forward,
    all_to_all,
    gather_forward_split_backward,
    reduce_scatter,
    split_forward_gather_backward,
)
from .context_parallel import apply_cp
from .layouts import Replicate, Shard
from .errors import GroupMembershipError, RankMismatchError, ShardkitError, ShardkitTypeError
from .mesh import ParallelDims
from .spatial import (
    RingConv2d,
    SpatialConv1d,
    SpatialConv2d,
    SpatialConv3d,
    apply_spatial,
    halo_exchange,
    ring_conv2d,
    spatial_conv1d,
    spatial_conv2d,
    spatial_conv3d,
    spatial_output_sizes,
)
from .tensor_parallel import (
    apply_tp,
    gather_full_state_dict,
    load_sharded,
    vocab_parallel_cross_entropy,
    load_sharded_checkpoint,
    save_sharded_checkpoint,
    verify_tp_plan,
)

__version__ = "0.1.0"

__all__ = [
    "ParallelDims",
    "balanced_split_sizes",
    "all_reduce_forward",
    "all_reduce_backward",
    "all_gather",
    "reduce_scatter",
    "split_forward_gather_backward",
    "gather_forward_split_backward",
    "all_to_all",
    "CommLedger",
    "apply_tp",
    "Replicate",
    "Shard",
    "apply_cp",
    "verify_tp_plan",
    "gather_full_state_dict",
    "load_sharded",
    "vocab_parallel_cross_entropy",
    "save_sharded_checkpoint",
    "load_sharded_checkpoint",
    "halo_exchange",
    "spatial_conv1d",
    "spatial_conv2d",
    "spatial_conv3d",
    "spatial_output_sizes",
    "SpatialConv1d",
    "SpatialConv2d",
    "SpatialConv3d",
    "RingConv2d",
    "ring_conv2d",
    "apply_spatial",
    "ShardkitError",
    "ShardkitTypeError",
    "GroupMembershipError",
    "RankMismatchError",
]
