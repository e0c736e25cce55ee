"""shardkit: autograd-aware communication for hybrid model parallelism.

Tensor / sequence, context, expert, pipeline and spatial parallelism built from exact,
differentiable collectives that run the same on CPU (gloo) and GPU (NCCL).

One entry point per axis, all exported here (the guides in ``docs/guides`` start from them):

* tensor / sequence parallelism: :func:`apply_tp`
* context parallelism: :func:`apply_cp` (models), :func:`ulysses_attention`,
  :func:`ring_attention`, :func:`usp_attention` (the attention functions themselves)
* expert parallelism: :func:`ep_plan` (a plan for :func:`apply_tp`), :func:`token_dispatch` /
  :func:`token_combine` (the all-to-all dispatcher)
* pipeline parallelism: :class:`PipelineStage` with :func:`run_schedule`
* spatial parallelism: :func:`apply_spatial`
* data parallelism: a ``dp`` axis of :class:`ParallelDims` (torch's DDP / FSDP over ``mesh["dp"]``)

The composed trainer's ``parallelize`` and the new ``ParallelDims`` land with the trainer
rewrite; they will be exported here and documented in ``docs/api/sharding.md``.

The sub-packages (``shardkit.comm``, ``shardkit.tensor_parallel``, ...) hold the lower-level
pieces (plan styles, layout helpers, P2P calls); their ``__all__`` lists are public too and are
documented page by page in ``docs/api``.
"""

import ast
import importlib
import importlib.util
import sys
import types
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._moved import MOVED_MODULES, install_moved_modules

# The exports are imported on first use (PEP 562), so that `import shardkit` (and the `shardkit`
# command's --help) does not pay for torch: the imports below are the one list of what comes from
# where, read by the type checker and, at run time, by _export_modules.
if TYPE_CHECKING:
    from ._shapes import balanced_split_sizes
    from ._types import Group
    from .checkpoint import (
        export_hf,
        latest_checkpoint,
        load_sharded,
        load_sharded_checkpoint,
        load_train_state,
        save_sharded_checkpoint,
        save_train_state,
    )
    from .comm import (
        CommLedger,
        CommRecord,
        all_gather,
        all_reduce_backward,
        all_reduce_forward,
        all_to_all,
        checks,
        checks_enabled,
        gather_forward_split_backward,
        reduce_scatter,
        split_forward_gather_backward,
    )
    from .context_parallel import (
        CPBatch,
        CPContext,
        apply_cp,
        ring_attention,
        ulysses_attention,
        usp_attention,
        zigzag_gather,
        zigzag_split,
    )
    from .data_parallel import GradientSync, apply_fsdp, global_mean_loss
    from .errors import GroupMembershipError, RankMismatchError, ShardkitError, ShardkitTypeError
    from .expert_parallel import DispatchPlan, dispatch_plan, ep_plan, token_combine, token_dispatch
    from .parallelize import ParallelModel, gather_full_parameters, parallelize, parallelize_stage
    from .pipeline_parallel import (
        PipelineStage,
        StageGroups,
        gpipe_schedule,
        new_stage_groups,
        one_f_one_b_schedule,
        run_schedule,
        split_microbatches,
    )
    from .plan import Cluster, ModelShape, StepEstimate, StepOptions, estimate_step, plan_layouts
    from .sharding import ParallelDims, ParallelMesh, Replicate, Shard
    from .spatial import (
        RingConv2d,
        SpatialAvgPool2d,
        SpatialBatchNorm2d,
        SpatialConv1d,
        SpatialConv2d,
        SpatialConv3d,
        SpatialConvTranspose1d,
        SpatialConvTranspose2d,
        SpatialConvTranspose3d,
        SpatialGroupNorm,
        SpatialMaxPool2d,
        SpatialUpsample,
        apply_spatial,
        halo_exchange,
        ring_conv2d,
        spatial_avg_pool,
        spatial_conv1d,
        spatial_conv2d,
        spatial_conv3d,
        spatial_conv_transpose1d,
        spatial_conv_transpose2d,
        spatial_conv_transpose3d,
        spatial_group_norm,
        spatial_interpolate,
        spatial_max_pool,
        spatial_output_sizes,
    )
    from .tensor_parallel import apply_tp, gather_full_state_dict, verify_tp_plan, vocab_parallel_cross_entropy

# Modules that moved: deprecated aliases for one release (the old name imports the new module, with a warning)
install_moved_modules(MOVED_MODULES)

__version__ = "0.1.0"


@cache
def _export_modules() -> dict[str, str]:
    """Exported name -> the submodule it comes from, read from the ``TYPE_CHECKING`` imports above."""
    tree = ast.parse(Path(__file__).read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    return {
        alias.asname or alias.name: f"{__name__}.{node.module}"
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }


def __getattr__(name: str) -> Any:
    """Import an export (or a sub-package) of shardkit on first use.

    Raises:
        AttributeError: ``name`` is neither.
    """
    module = _export_modules().get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    elif importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """The ``shardkit`` module's class: the export ``parallelize`` (a function) shares its name
    with the sub-package ``shardkit.parallelize``, and importing a sub-package sets it as an
    attribute of its parent, which would hide the function from the lazy ``__getattr__``. The
    attribute stays the export, as the eager imports had it; the sub-package is in
    ``sys.modules`` (``from shardkit.parallelize import ...`` reads it there)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and name in _export_modules():
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


__all__ = [
    # planning: predicted step time and memory of a layout on a cluster
    "plan_layouts",
    "estimate_step",
    "ModelShape",
    "Cluster",
    "StepOptions",
    "StepEstimate",
    # layout and sizes
    "ParallelDims",
    "ParallelMesh",
    # composition: tp -> cp -> ep -> dp, pipeline stages, gradients, checkpoints
    "parallelize",
    "parallelize_stage",
    "ParallelModel",
    "gather_full_parameters",
    "GradientSync",
    "global_mean_loss",
    "apply_fsdp",
    "save_train_state",
    "load_train_state",
    "latest_checkpoint",
    "export_hf",
    "Group",
    "balanced_split_sizes",
    # differentiable collectives
    "all_reduce_forward",
    "all_reduce_backward",
    "all_gather",
    "reduce_scatter",
    "split_forward_gather_backward",
    "gather_forward_split_backward",
    "all_to_all",
    "CommLedger",
    "CommRecord",
    "checks",
    "checks_enabled",
    # tensor / sequence parallelism
    "apply_tp",
    "Replicate",
    "Shard",
    "verify_tp_plan",
    "vocab_parallel_cross_entropy",
    "gather_full_state_dict",
    "load_sharded",
    "save_sharded_checkpoint",
    "load_sharded_checkpoint",
    # context parallelism
    "apply_cp",
    "CPContext",
    "CPBatch",
    "ulysses_attention",
    "ring_attention",
    "usp_attention",
    "zigzag_split",
    "zigzag_gather",
    # expert parallelism
    "ep_plan",
    "dispatch_plan",
    "DispatchPlan",
    "token_dispatch",
    "token_combine",
    # pipeline parallelism
    "PipelineStage",
    "run_schedule",
    "split_microbatches",
    "gpipe_schedule",
    "one_f_one_b_schedule",
    "StageGroups",
    "new_stage_groups",
    # spatial parallelism
    "apply_spatial",
    "halo_exchange",
    "spatial_output_sizes",
    "spatial_conv1d",
    "spatial_conv2d",
    "spatial_conv3d",
    "SpatialConv1d",
    "SpatialConv2d",
    "SpatialConv3d",
    "RingConv2d",
    "ring_conv2d",
    "spatial_conv_transpose1d",
    "spatial_conv_transpose2d",
    "spatial_conv_transpose3d",
    "SpatialConvTranspose1d",
    "SpatialConvTranspose2d",
    "SpatialConvTranspose3d",
    "spatial_group_norm",
    "SpatialGroupNorm",
    "SpatialBatchNorm2d",
    "spatial_max_pool",
    "spatial_avg_pool",
    "SpatialMaxPool2d",
    "SpatialAvgPool2d",
    "spatial_interpolate",
    "SpatialUpsample",
    # errors
    "ShardkitError",
    "ShardkitTypeError",
    "GroupMembershipError",
    "RankMismatchError",
]
