"""Pure size arithmetic shared by every parallel axis (no process group, no tensors).

One split rule is used everywhere a size is divided over ranks unless the caller passes explicit
sizes: *balanced*, the first ``n % R`` ranks get one extra element. It is the rule of the
MindSpeed-MM communication ops (``cal_split_sizes``) and of Megatron-style uneven shards, so
shardkit layouts interoperate with checkpoints and activations produced by those systems.
"""

from __future__ import annotations

from collections.abc import Sequence

from .errors import ShardkitError, ShardkitTypeError

__all__ = ["balanced_split_sizes", "chunk_sizes", "split_offsets", "normalize_dim", "check_split_sizes"]


def balanced_split_sizes(n: int, world_size: int) -> list[int]:
    """Split ``n`` elements over ``world_size`` ranks; the first ``n % R`` ranks get one more.

    Args:
        n: number of elements (>= 0).
        world_size: number of ranks ``R`` (>= 1).

    Returns:
        ``R`` sizes summing to ``n``, e.g. ``balanced_split_sizes(10, 4) == [3, 3, 2, 2]`` and
        ``balanced_split_sizes(2, 4) == [1, 1, 0, 0]`` (zero-size parts are allowed).

    Raises:
        ShardkitError: ``n < 0`` or ``world_size < 1``.
    """
    if isinstance(n, bool) or not isinstance(n, int) or isinstance(world_size, bool) or not isinstance(world_size, int):
        raise ShardkitTypeError(f"balanced_split_sizes: n and world_size must be int, got {n!r}, {world_size!r}")
    if n < 0 or world_size < 1:
        raise ShardkitError(
            f"balanced_split_sizes: need n >= 0 and world_size >= 1, got n={n}, world_size={world_size}"
        )
    base, extra = divmod(n, world_size)
    return [base + 1 if r < extra else base for r in range(world_size)]


def chunk_sizes(n: int, world_size: int) -> list[int]:
    """Split ``n`` elements over ``world_size`` ranks with ``torch.chunk`` semantics.

    Every rank gets ``ceil(n / R)`` elements until they run out, so the last ranks may be short
    or empty: ``chunk_sizes(10, 3) == [4, 4, 2]``, ``chunk_sizes(16, 14) == [2] * 8 + [0] * 6``.
    It is the rule of PyTorch's ``Shard`` placement and of Hugging Face tensor parallelism, so
    parameters cut with it match DTensor and HF checkpoints sharded by those systems.

    Raises:
        ShardkitError: ``n < 0`` or ``world_size < 1``.
    """
    balanced_split_sizes(n, world_size)  # same argument checks
    step = -(-n // world_size)
    return [max(0, min(step, n - r * step)) for r in range(world_size)]


def split_offsets(sizes: Sequence[int]) -> list[int]:
    """Start offset of each part: the exclusive prefix sum of ``sizes``."""
    offsets, acc = [], 0
    for s in sizes:
        offsets.append(acc)
        acc += s
    return offsets


def normalize_dim(dim: int, ndim: int, op: str) -> int:
    """Map a possibly negative ``dim`` into ``[0, ndim)``.

    Raises:
        ShardkitError: ``dim`` is out of range for a tensor with ``ndim`` dims.
        ShardkitTypeError: ``dim`` is not an int.
    """
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise ShardkitTypeError(f"{op}: dim must be an int, got {dim!r}")
    if not -ndim <= dim < ndim:
        raise ShardkitError(f"{op}: dim {dim} is out of range for a {ndim}-d tensor (expected {-ndim} <= dim < {ndim})")
    return dim % ndim


def check_split_sizes(sizes: Sequence[int] | None, world_size: int, total: int | None, op: str) -> list[int]:
    """Validate explicit split sizes, or return the balanced split of ``total`` when ``sizes`` is None.

    Args:
        sizes: one non-negative int per rank, or None for the balanced rule.
        world_size: group size ``R``.
        total: the size the parts must sum to, or None when it is not known locally.
        op: operation name for messages.

    Raises:
        ShardkitTypeError: ``sizes`` is not a sequence of ints.
        ShardkitError: wrong length, a negative entry, or a sum different from ``total``.
    """
    if sizes is None:
        if total is None:
            raise ShardkitError(f"{op}: sizes are required when the total size is not known")
        return balanced_split_sizes(total, world_size)
    if (
        isinstance(sizes, (str, bytes))
        or not isinstance(sizes, Sequence)
        or not all(isinstance(s, int) and not isinstance(s, bool) for s in sizes)
    ):
        raise ShardkitTypeError(f"{op}: sizes must be a sequence of ints, got {sizes!r}")
    sizes = list(sizes)
    if len(sizes) != world_size:
        raise ShardkitError(f"{op}: sizes has {len(sizes)} entries but the group has {world_size} ranks: {sizes}")
    negative = [r for r, s in enumerate(sizes) if s < 0]
    if negative:
        raise ShardkitError(f"{op}: sizes must be >= 0, got {sizes} (negative at ranks {negative})")
    if total is not None and sum(sizes) != total:
        raise ShardkitError(f"{op}: sizes {sizes} sum to {sum(sizes)} but the dim has size {total}")
    return sizes
