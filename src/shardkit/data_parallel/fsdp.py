"""FSDP2 (``fully_shard``) over ``dp_shard x cp``, HSDP with ``dp_replicate``, after tp/cp/ep.

Parameters, gradients and optimizer state of every transformer block are sharded over the
``dp_shard_cp`` ranks (ZeRO-3): context-parallel ranks hold the same parameters and different
tokens, so they shard like data-parallel ranks (torchtitan's ``dp_shard_cp`` mesh). With
``dp_replicate > 1`` the mesh is 2-D and FSDP2 runs HSDP: reduce-scatter inside a replica
group, all-reduce across them. Gradient reductions are sums (the loss is already normalized by
the global token count, see :mod:`.grads`).

Left out of FSDP2, kept replicated and reduced by :class:`~.grads.GradientSync` instead:

* parameters with a gradient hook on the tensor itself (tensor-parallel weights used on local
  data, :func:`~shardkit.tensor_parallel.sum_grad_over`, and key/value heads replicated over tp):
  ``fully_shard`` replaces every parameter by a new ``DTensor`` parameter, which would drop
  the hook. They are small (norm weights, a few heads).
* expert weights: they differ across the ``ep`` ranks that ``dp_shard`` lends to expert
  parallelism, so sharding them over ``dp_shard_cp`` would mix different experts. (torchtitan
  shards them over the expert data-parallel ranks instead: a memory saving left for later.)

Source: PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``, Zhao et al., 2023, per-parameter
sharding); torchtitan's ``apply_fsdp`` (per-block wrapping, HSDP mesh, ``dp_shard_cp``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from ..expert_parallel.hf import expert_shard

if TYPE_CHECKING:
    from ..mesh import ParallelMesh

__all__ = ["apply_fsdp", "keeps_own_reduction"]


def keeps_own_reduction(p: nn.Parameter) -> bool:
    """True for parameters FSDP2 must leave alone (see the module docstring)."""
    return bool(getattr(p, "_shardkit_grad_hook", False)) or expert_shard(p) is not None


def apply_fsdp(model: nn.Module, mesh: ParallelMesh, blocks: list[nn.Module]) -> set[str]:
    """Apply FSDP2 to every block of ``blocks`` and then to ``model`` (the root), in place.

    Args:
        model: the (stage) model, already tensor-, context- and expert-parallel.
        mesh: the job's :class:`~shardkit.mesh.ParallelMesh` (``dp_shard > 1``).
        blocks: the modules to shard one by one (decoder layers): each is all-gathered just
            before its forward and freed after, so only one block is ever unsharded.

    Returns:
        The names of the parameters FSDP2 now owns (their gradients are reduced by FSDP2).
    """
    from torch.distributed.fsdp import fully_shard

    dp_mesh = mesh["hsdp"] if mesh.dims.dp_replicate > 1 else mesh["dp_shard_cp"]
    ignored = {p for p in model.parameters() if keeps_own_reduction(p)}
    names = {name for name, p in model.named_parameters() if p not in ignored}
    sharded = [fully_shard(block, mesh=dp_mesh, ignored_params=ignored & set(block.parameters())) for block in blocks]
    sharded.append(fully_shard(model, mesh=dp_mesh, ignored_params=ignored))
    # Sums, not FSDP2's default mean: gloo has no PREMUL_SUM, so ask for plain sums.
    for module in sharded:
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
    return names
