"""How a sharded parameter was cut: :class:`ShardSpec`, and cutting / gathering by it.

The vocabulary of every wing that cuts parameters by index ranges: tensor parallelism (its
styles), expert parallelism (experts blocks), data parallelism (gradient norms) and checkpoints
(chunks of the full tensor).

A spec lists, for every rank, the ranges of the full tensor's sharded dim that the rank holds,
in local order. One description covers every layout tensor parallelism needs:

* a contiguous block per rank (``colwise``/``rowwise``, uneven and empty blocks included);
* packed weights: a fused ``gate_up_proj`` ``[2 I, H]`` or a GQA ``qkv_proj`` with unequal
  q/k/v parts gives each rank its block of *every* part (``[G_r | U_r]``), so the local matmul
  output splits into matching gate and up halves;
* replicated key/value heads: with fewer KV heads than ranks, several ranks hold the same head
  (ranges overlap). Each holder's gradient of that head is partial (only its own query heads
  use it), so the gradient is summed over the holders (:func:`shard_parameter` adds the hook).

Gathering takes, for each full index, the copy of the first rank that holds it.

The spec is stored on the parameter itself (attribute ``_shardkit_shard``), so it survives
wrapping (DDP renames parameters to ``module.*``) and optimizers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch
from torch import nn

from .._shapes import split_offsets
from ..comm import _c10d, all_gather
from ..comm._group import resolve_group
from ..errors import ShardkitError

if TYPE_CHECKING:
    from .._types import Group

__all__ = ["ShardSpec", "shard_spec", "set_shard_spec", "cut", "gather_full", "shard_parameter"]

_SPEC_ATTR = "_shardkit_shard"

Ranges = tuple[tuple[int, int], ...]


@dataclass(frozen=True, eq=False)
class ShardSpec:
    """Rank ``r`` holds ``ranges[r]`` (``(start, stop)`` pairs, in local order) of dim ``dim``.

    Attributes:
        dim: the sharded dim of the full tensor (non-negative).
        full_size: the full tensor's size along ``dim``.
        ranges: one tuple of ``(start, stop)`` ranges per rank of the group.
        group: the ``ProcessGroup`` or 1-D ``DeviceMesh`` the shards live on.
    """

    dim: int
    full_size: int
    ranges: tuple[Ranges, ...]
    group: Group

    @classmethod
    def blocks(cls, dim: int, sizes: Sequence[int], group: Group) -> ShardSpec:
        """Contiguous blocks: rank ``r`` holds ``sizes[r]`` elements after those of ranks ``< r``."""
        offs = split_offsets(sizes)
        return cls(dim, sum(sizes), tuple(((o, o + s),) for o, s in zip(offs, sizes)), group)

    @classmethod
    def packed(cls, dim: int, part_sizes: Sequence[Sequence[int]], group: Group) -> ShardSpec:
        """Packed parts laid end to end, each cut into per-rank blocks ``part_sizes[p][r]``.

        Rank ``r`` holds block ``r`` of every part, parts in order (``[G_r | U_r]``).
        """
        ranks = len(part_sizes[0])
        ranges: list[list[tuple[int, int]]] = [[] for _ in range(ranks)]
        base = 0
        for sizes in part_sizes:
            for r, (o, s) in enumerate(zip(split_offsets(sizes), sizes)):
                ranges[r].append((base + o, base + o + s))
            base += sum(sizes)
        return cls(dim, base, tuple(tuple(rs) for rs in ranges), group)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Local size along ``dim`` on each rank."""
        return tuple(sum(b - a for a, b in rs) for rs in self.ranges)

    @cached_property
    def overlapping(self) -> bool:
        """True when some full index is held by more than one rank (replicated heads)."""
        return sum(self.sizes) != self.full_size

    def indices(self, rank: int) -> list[int]:
        """Full indices held by ``rank``, in local order."""
        return [i for a, b in self.ranges[rank] for i in range(a, b)]

    @cached_property
    def _pick(self) -> list[int] | None:
        """For each full index, its position in the rank-order concatenation of all locals
        (first holder); None when that concatenation already is the full tensor."""
        first: dict[int, int] = {}
        pos = 0
        for r in range(len(self.ranges)):
            for i in self.indices(r):
                first.setdefault(i, pos)
                pos += 1
        pick = [first[i] for i in range(self.full_size)]
        return None if pick == list(range(pos)) else pick


def shard_spec(param: torch.Tensor) -> ShardSpec | None:
    """The :class:`ShardSpec` of a sharded parameter, or None for a replicated one."""
    return getattr(param, _SPEC_ATTR, None)


def set_shard_spec(t: torch.Tensor, spec: ShardSpec | None) -> torch.Tensor:
    """Record ``spec`` on ``t`` (read back by :func:`shard_spec`) and return ``t``; None records nothing."""
    if spec is not None:
        setattr(t, _SPEC_ATTR, spec)
    return t


def cut(full: torch.Tensor, spec: ShardSpec, rank: int) -> torch.Tensor:
    """Rank ``rank``'s local tensor of ``full`` (a copy that owns its memory)."""
    if full.shape[spec.dim] != spec.full_size:
        raise ShardkitError(
            f"ShardSpec: the tensor has size {full.shape[spec.dim]} along dim {spec.dim}, the spec {spec.full_size}"
        )
    parts = [full.narrow(spec.dim, a, b - a) for a, b in spec.ranges[rank]]
    if len(parts) == 1:
        return parts[0].clone()
    if not parts:
        return full.narrow(spec.dim, 0, 0).clone()
    return torch.cat(parts, dim=spec.dim)


def gather_full(local: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """Collective over ``spec.group``: the full tensor from every rank's local one (no autograd).

    One uneven all-gather along ``spec.dim``, then (packed or overlapping specs only) one index
    select that puts the full indices in order.
    """
    with torch.no_grad():
        out = all_gather(local.detach(), spec.group, spec.dim, list(spec.sizes))
    pick = spec._pick
    if pick is None:
        return out
    return out.index_select(spec.dim, torch.tensor(pick, device=out.device))


def _sum_over_holders(spec: ShardSpec, rank: int):
    """A gradient hook summing each overlapping index's gradient over the ranks holding it.

    Scatter the local gradient into a zero full-size buffer, all-reduce it, read the local
    indices back. Used only for replicated KV heads, whose weights are small, so the full-size
    buffer costs little and needs no sub-groups of holders.
    """
    g = resolve_group(spec.group, "shard_parameter")
    local_index = torch.tensor(spec.indices(rank), dtype=torch.long)
    on_device: dict[torch.device, torch.Tensor] = {}  # copied once per device, not once per step

    def hook(grad: torch.Tensor) -> torch.Tensor:
        idx = on_device.get(grad.device)
        if idx is None:
            idx = on_device[grad.device] = local_index.to(grad.device)
        shape = list(grad.shape)
        shape[spec.dim] = spec.full_size
        full = grad.new_zeros(shape).index_add_(spec.dim, idx, grad)
        full = _c10d.all_reduce(full, g, "tp_replicated_heads", "backward")
        return full.index_select(spec.dim, idx)

    return hook


def shard_parameter(module: nn.Module, name: str, spec: ShardSpec, rank: int, memo: dict | None = None) -> nn.Parameter:
    """Replace ``module.<name>`` by this rank's shard of it and record ``spec`` on the new parameter.

    Args:
        module: the module owning the parameter.
        name: the parameter's attribute name (``"weight"``, ``"gate_up_proj"``, ...).
        spec: how to cut it; ``spec.dim`` indexes the full parameter.
        rank: this rank in ``spec.group``.
        memo: maps ``id(full parameter)`` to its shard, so a parameter shared by two modules
            (tied embeddings) is cut once and stays shared; both uses must agree on the spec.

    Returns:
        The new parameter.

    Raises:
        ShardkitError: the parameter is already sharded, its size does not match the spec, or a
            shared parameter is cut two different ways.
    """
    old = getattr(module, name)
    if memo is not None and id(old) in memo:
        new = memo[id(old)]
        cut_as = shard_spec(new)
        if cut_as is None or (cut_as.dim, cut_as.ranges) != (spec.dim, spec.ranges):
            raise ShardkitError(f"shard_parameter: {name} is shared (tied) but its two uses shard it differently")
        setattr(module, name, new)
        return new
    if shard_spec(old) is not None:
        raise ShardkitError(f"shard_parameter: {type(module).__name__}.{name} is already sharded")
    new = nn.Parameter(cut(old.detach(), spec, rank), requires_grad=old.requires_grad)
    set_shard_spec(new, spec)
    if spec.overlapping and new.requires_grad:
        new.register_hook(_sum_over_holders(spec, rank))
        setattr(new, "_shardkit_grad_hook", True)  # see sum_grad_over
    setattr(module, name, new)
    if memo is not None:
        memo[id(old)] = new
    return new
