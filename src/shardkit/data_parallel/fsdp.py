"""FSDP2 (``fully_shard``) over ``dp_shard x cp``, HSDP with ``dp_replicate``, after tp/cp/ep.

Parameters, gradients and optimizer state of every transformer block are sharded over the
``dp_shard_cp`` ranks (ZeRO-3): context-parallel ranks hold the same parameters and different
tokens, so they shard like data-parallel ranks (torchtitan's ``dp_shard_cp`` mesh). With
``dp_replicate > 1`` the mesh is 2-D and FSDP2 runs HSDP: reduce-scatter inside a replica
group, all-reduce across them. Gradient reductions follow ``grad_reduce`` (see :mod:`.grads`):
``"mean"`` divides the summed gradient by the ``D`` data ranks with FSDP2's own
``set_gradient_divide_factor(D)``, ``"sum"`` sets the factor to 1 (the loss is already
normalized by the global token count). Either way the collectives are plain sums (gloo has no
``AVG`` or ``PREMUL_SUM``); FSDP2 divides once, after the reduce-scatter (and HSDP's all-reduce).

Left out of FSDP2, kept replicated and reduced by :class:`~.grads.GradientSync` instead:

* parameters with a gradient hook on the tensor itself (tensor-parallel weights used on local
  data, :func:`~shardkit.tensor_parallel.sum_grad_over`, and key/value heads replicated over tp):
  ``fully_shard`` replaces every parameter by a new ``DTensor`` parameter, which would drop
  the hook. They are small (norm weights, a few heads).
* expert weights when no rank holds the same experts as another (``edp`` of size 1: ``ep``
  borrows every data rank): they are only ``ep``-sharded.

Expert weights differ across the ``ep`` ranks that ``dp_shard`` lends to expert parallelism, so
they cannot be sharded over ``dp_shard_cp`` (that would mix different experts). With an ``edp``
group (the ranks holding the same experts) of size > 1, each experts module is ``fully_shard``-ed
over ``mesh["edp"]`` on its own, before its block (nested, torchtitan's layout): its weights,
gradients and optimizer state are split over ``edp`` and FSDP2 reduce-scatters the expert
gradients over ``edp`` (divided by the same ``D`` as the dense ones), so
:class:`~.grads.GradientSync` leaves them alone. Parameters of an experts module that are not
per-expert (no ``ep`` block) stay out of FSDP2 and are reduced over ``dp_cp``.

FSDP2's collectives are shardkit's too: each sharded module gets a custom all-gather and
reduce-scatter (FSDP2's ``set_custom_all_gather`` / ``set_custom_reduce_scatter``, same c10d
calls as its defaults) that record themselves in the :class:`~shardkit.CommLedger` and the
flight recorder under the api ``"fully_shard"``, so a layout's ledger by axis shows what
``dp_shard`` adds and a desync inside FSDP2 is diagnosed like any other. HSDP's all-reduce over
``dp_replicate`` is FSDP2's own call; it is recorded from the all-reduce hook FSDP2 runs right
after it (so it is the one entry logged after, not before, its call).

Source: PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``, Zhao et al., 2023, per-parameter
sharding); torchtitan's ``apply_fsdp`` (per-block wrapping, HSDP mesh, ``dp_shard_cp``).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.utils._python_dispatch import _disable_current_modes

from ..comm import ledger
from ..comm._compat import all_gather_single, reduce_scatter_single
from ..expert_parallel.hf import expert_shard
from .grads import GradReduce, check_grad_reduce

if TYPE_CHECKING:
    from ..sharding import ParallelMesh

__all__ = ["LedgerAllGather", "LedgerReduceScatter", "apply_fsdp", "keeps_own_reduction"]


def keeps_own_reduction(p: nn.Parameter) -> bool:
    """True for parameters the per-block FSDP2 over ``dp_shard_cp`` must leave alone (see the module
    docstring): the tensor-hooked ones and the expert weights (these go to :func:`_shard_experts`)."""
    return bool(getattr(p, "_shardkit_grad_hook", False)) or expert_shard(p) is not None


def _expert_owned(module: nn.Module) -> set[nn.Parameter]:
    """The ``ep``-sharded expert weights of one experts module, without a tensor hook."""
    return {
        p for p in module.parameters() if expert_shard(p) is not None and not getattr(p, "_shardkit_grad_hook", False)
    }


def _shard_experts(model: nn.Module, mesh: ParallelMesh, mp: MixedPrecisionPolicy) -> tuple[list, set[str]]:
    """``fully_shard`` each experts module over ``mesh["edp"]`` (its non-expert parameters ignored).

    Returns:
        The sharded modules and the names of the parameters they own (none when ``edp`` is 1).
    """
    from torch.distributed.fsdp import fully_shard

    if mesh.size("edp") == 1:
        return [], set()
    modules = [m for m in model.modules() if expert_shard(m) is not None]
    owned: set[nn.Parameter] = set()
    sharded = []
    for m in modules:
        mine = _expert_owned(m)
        owned |= mine
        ignored = set(m.parameters()) - mine
        sharded.append(fully_shard(m, mesh=mesh["edp"], ignored_params=ignored, mp_policy=mp))
    return sharded, {name for name, p in model.named_parameters() if p in owned}


def apply_fsdp(
    model: nn.Module,
    mesh: ParallelMesh,
    blocks: list[nn.Module],
    *,
    grad_reduce: GradReduce = "mean",
    mp_policy: MixedPrecisionPolicy | None = None,
) -> set[str]:
    """Apply FSDP2 to every experts module (over ``edp``, when it has more than one rank), to every
    block of ``blocks`` and then to ``model`` (the root), in place.

    Args:
        model: the (stage) model, already tensor-, context- and expert-parallel.
        mesh: the job's :class:`~shardkit.sharding.ParallelMesh` (``dp_shard > 1``).
        blocks: the modules to shard one by one (decoder layers): each is all-gathered just
            before its forward and freed after, so only one block is ever unsharded.
        grad_reduce: ``"mean"`` (FSDP2's and DDP's average over the ``D`` data ranks) or
            ``"sum"``; the :class:`~.grads.GradientSync` of the same model must use the same.
        mp_policy: FSDP2's ``MixedPrecisionPolicy`` for every sharded module (None: its default,
            everything in the parameters' dtype); mixed precision passes
            ``param_dtype=bfloat16, reduce_dtype=float32``
            (:func:`shardkit.parallelize.mixed_precision.fsdp_policy`).

    Returns:
        The names of the parameters FSDP2 now owns (their gradients are reduced by FSDP2), the
        edp-sharded expert weights included.

    Raises:
        ShardkitError: ``grad_reduce`` not ``"mean"`` or ``"sum"``.
    """
    from torch.distributed.fsdp import fully_shard

    mode = check_grad_reduce(grad_reduce, "apply_fsdp")
    dp_mesh = mesh["hsdp"] if mesh.dims.dp_replicate > 1 else mesh["dp_shard_cp"]
    mp = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    experts, names = _shard_experts(model, mesh, mp)  # first: the blocks then skip what they own
    ignored = {p for p in model.parameters() if keeps_own_reduction(p)}
    names |= {name for name, p in model.named_parameters() if p not in ignored and name not in names}
    sharded = [
        fully_shard(block, mesh=dp_mesh, ignored_params=ignored & set(block.parameters()), mp_policy=mp)
        for block in blocks
    ]
    sharded.append(fully_shard(model, mesh=dp_mesh, ignored_params=ignored, mp_policy=mp))
    replicate = dp_mesh.get_group(0) if mesh.dims.dp_replicate > 1 else None  # HSDP: FSDP2's all-reduce group
    # FSDP2 divides by the factor after plain-sum collectives (gloo has no AVG / PREMUL_SUM); the
    # experts' edp group is smaller than the D data ranks but their gradient is divided by D too
    factor = float(mesh.size("dp_cp")) if mode == "mean" else 1.0
    for module in [*experts, *sharded]:
        module.set_gradient_divide_factor(factor)
        module.set_force_sum_reduction_for_comms(True)
        module.set_custom_all_gather(LedgerAllGather())
        module.set_custom_reduce_scatter(LedgerReduceScatter())
        if replicate is not None and module not in experts:
            module.set_all_reduce_hook(functools.partial(_record_hsdp_all_reduce, replicate))
    return names


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _record(op: str, phase: str, sent: torch.Tensor, received: torch.Tensor, group: dist.ProcessGroup) -> None:
    """One FSDP2 collective in the ledger (api ``fully_shard``), before its call."""
    ledger.record(
        op,
        "fully_shard",
        phase,
        group.size(),
        _nbytes(sent),
        _nbytes(received),
        pg=group,
        shape=tuple(sent.shape),
        dtype=sent.dtype,
    )


def _phase() -> str:
    # FSDP2 all-gathers before forward and again before backward (a resharded block): inside
    # the autograd engine the current graph task is set.
    return "backward" if torch._C._current_graph_task_id() != -1 else "forward"


class LedgerAllGather(AllGather):
    """FSDP2's all-gather (``all_gather_into_tensor``), recorded in the ledger first."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> dist.Work | None:
        # A nested module (experts over edp) gathers inside its checkpointed block: the gather is
        # FSDP2's state, not the block's math, so no dispatch mode (the selective checkpoint's
        # record / replay) may keep or serve it; its recompute gathers again only if FSDP2 resharded.
        with _disable_current_modes():
            _record("all_gather_single", _phase(), input_tensor, output_tensor, group)
            return all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


class LedgerReduceScatter(ReduceScatter):
    """FSDP2's gradient reduce-scatter (``reduce_scatter_tensor``), recorded in the ledger first."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op,
        async_op: bool = False,
    ) -> dist.Work | None:
        _record("reduce_scatter_single", "backward", input_tensor, output_tensor, group)
        return reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def _record_hsdp_all_reduce(group: dist.ProcessGroup, reduced: torch.Tensor) -> None:
    ledger.record(
        "all_reduce",
        "fully_shard",
        "backward",
        group.size(),
        _nbytes(reduced),
        _nbytes(reduced),
        pg=group,
        shape=tuple(reduced.shape),
        dtype=reduced.dtype,
    )
