"""Tensor layouts over a group of ranks: :class:`Replicate` and :class:`Shard`.

One definition for the whole package: tensor-parallel styles declare the layouts of a module's
input and output with them (``ColwiseParallel(input_layouts=Shard(1))`` is sequence
parallelism), and pipeline stages declare the layout of the tensors that cross a stage
boundary (:class:`~shardkit.pipeline_parallel.StageGroups`).

* :class:`Replicate`: every rank holds the full tensor.
* :class:`Shard` ``(dim)``: rank ``r`` holds block ``r`` of the tensor along ``dim``; unless a
  caller says otherwise the blocks are the balanced split
  (:func:`shardkit.balanced_split_sizes`: the first ``n % R`` ranks get one more element), so
  any size works, zero-size blocks included.
* :class:`Partial`: every rank holds a full-shape partial sum; the tensor is their sum (a
  row-parallel matmul's output before its reduction).

Gradient conventions are part of each user's contract (a style's or a stage boundary's), not of
the layout; see those docstrings. Source: the placement types of PyTorch DTensor
(``Replicate``, ``Shard``, ``Partial``), re-implemented without a tensor subclass.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ShardkitError, ShardkitTypeError

__all__ = ["Replicate", "Shard", "Partial", "check_layout"]


@dataclass(frozen=True)
class Replicate:
    """Every rank of the group holds the full tensor."""

    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class Shard:
    """Rank ``r`` of the group holds block ``r`` along ``dim`` (negative dims count from the end)."""

    dim: int

    def __post_init__(self):
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise ShardkitError(f"Shard: dim must be an int, got {self.dim!r}")

    def __repr__(self) -> str:
        return f"Shard({self.dim})"


@dataclass(frozen=True)
class Partial:
    """Every rank holds a partial sum of the full tensor (sum over the group = the tensor)."""

    def __repr__(self) -> str:
        return "Partial()"


def check_layout(layout, what: str, *, non_negative: bool = False, partial: bool = False):
    """Return ``layout`` if it is ``Replicate()`` or ``Shard(dim)`` (or ``Partial()`` if ``partial``).

    Raises:
        ShardkitTypeError: anything else.
        ShardkitError: ``non_negative`` and a ``Shard`` with ``dim < 0``.
    """
    kinds = (Replicate, Shard, Partial) if partial else (Replicate, Shard)
    if not isinstance(layout, kinds):
        names = "Replicate(), Shard(dim) or Partial()" if partial else "Replicate() or Shard(dim)"
        raise ShardkitTypeError(f"{what} must be {names}, got {layout!r}")
    if non_negative and isinstance(layout, Shard) and layout.dim < 0:
        raise ShardkitError(f"{what}: Shard(dim) needs dim >= 0 here (a dim of the full tensor), got {layout!r}")
    return layout
