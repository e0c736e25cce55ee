"""A rank's chunks (virtual stages) of a pipeline, and how a model's layers are cut into them.

The model is cut into ``p * v`` chunks, numbered in the order data flows through them; rank
``r`` of the pipeline group holds ``v`` of them by the placement of :mod:`.steps` (``"looped"``:
chunks ``r, r + p, ...``; ``"v"``: chunks ``r`` and ``2p - 1 - r``). :func:`chunk_layers` says
which layers each chunk gets; :func:`~.runner.run_schedule` runs a :class:`ChunkedStage` under a
:class:`~.steps.Step` table (:mod:`._chunk_exec`).

Source: Megatron-LM's virtual pipeline (``virtual_pipeline_model_parallel_size``: a list of model
chunks per rank, Narayanan et al., SC 2021); torch.distributed.pipelining's multi-stage
schedules (several ``PipelineStage`` s per rank); ZB-V / DualPipeV's V placement (Qi et al.
2024; DeepSeek-V3 report).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist
from torch import nn

from .._shapes import balanced_split_sizes
from ..comm._group import GroupInfo, resolve_group
from ..comm.agree import agree
from ..errors import ShardkitError, ShardkitTypeError
from ._agreed import REJECTED
from ._mailbox import links
from ._transfer import ShapeTrust
from .steps import PLACEMENTS, chunk_owner, global_chunk

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import torch

    from .._types import Group
    from ..sharding import StageGroups

__all__ = ["ChunkedStage", "chunk_layers"]


def chunk_layers(num_layers: int, p: int, v: int, placement: str, rank: int) -> list[range]:
    """The layer indices of each of ``rank``'s chunks, in local chunk order (pure).

    The ``L`` layers are cut into ``p * v`` contiguous chunks in data-flow order; the first
    ``L % (p v)`` chunks get one layer more (``balanced_split_sizes``, the rule of
    :func:`~.hf_decoder.decoder_stage_layers` over ``p v`` stages), e.g. ``L = 10, p = 2, v = 2``:
    chunks of 3, 3, 2, 2 layers; looped rank 0 holds chunks 0 and 2 (layers 0-2 and 6-7).

    Args:
        num_layers: ``L``, the model's (decoder) layers.
        p: pipeline ranks.
        v: chunks per rank.
        placement: ``"looped"`` or ``"v"`` (:mod:`.steps`).
        rank: the pipeline rank whose chunks are returned.

    Returns:
        ``v`` ranges, local chunk ``c`` first (global chunk ``global_chunk(placement, rank, c, p)``).

    Raises:
        ShardkitError: ``L < p v`` (a chunk without layers), sizes not ints >= 1, ``rank``
            outside ``0..p-1``, or a placement that cannot hold ``v`` chunks.
    """
    for name, x in (("num_layers", num_layers), ("p", p), ("v", v), ("rank", rank)):
        if not isinstance(x, int) or isinstance(x, bool):
            raise ShardkitError(f"chunk_layers: {name} must be an int, got {x!r}")
    if p < 1 or v < 1 or not 0 <= rank < p:
        raise ShardkitError(f"chunk_layers: need p >= 1, v >= 1 and 0 <= rank < p, got p={p}, v={v}, rank={rank}")
    if num_layers < p * v:
        raise ShardkitError(
            f"chunk_layers: {num_layers} layers cannot fill p * v = {p} * {v} = {p * v} chunks (need layers >= p * v)"
        )
    starts = [0]
    for size in balanced_split_sizes(num_layers, p * v):
        starts.append(starts[-1] + size)
    chunks = [global_chunk(placement, rank, c, p) for c in range(v)]
    return [range(starts[g], starts[g + 1]) for g in chunks]


def link_groups(g: GroupInfo, separate: bool, p: int | None = None) -> dict[tuple[str, int], GroupInfo]:
    """The process group of each link (:func:`~._mailbox.links`) of the pipeline group ``g``
    (of ``p`` pipeline positions, default ``g.size``; tp-group stages: their number, the links
    then join stages and every group holds all of ``g``'s ranks).

    ``separate`` (NCCL, any backend but gloo): ``g`` for the first link and, for each other one,
    a new group of ``g``'s ranks (``dist.new_group(ranks, use_local_synchronization=True)``:
    collective over ``g``; 2 to 6 groups in all, by ``p``). NCCL runs a group's P2P between two
    ranks in order on one stream (on one stream per rank when the communicator is initialized
    eagerly), so a send could wait in front of a receive it depends on; no two links of a group
    share a rank, so each stream carries one rank pair's messages one way (the proof:
    :mod:`.stream_model`). Else ``g`` for every link: gloo pairs each direction of a rank pair
    on its own and never blocks a post. A group of one rank has no link."""
    p = g.size if p is None else p
    if p < 2:
        return {}
    names = links(p)
    if not separate:
        return dict.fromkeys(names, g)
    ranks = dist.get_process_group_ranks(g.pg)
    backend = dist.get_backend(g.pg)
    made = [g] + [
        resolve_group(dist.new_group(ranks, backend=backend, use_local_synchronization=True), "ChunkedStage")
        for _ in names[1:]
    ]
    return dict(zip(names, made, strict=True))


def links_error(backend: str, eager: bool) -> str | None:
    """Why :func:`link_groups` cannot build a pipeline's link groups, or None (pure).

    On NCCL with an eagerly initialized default group (``init_process_group(device_id=...)``)
    ``new_group`` splits the default communicator (``ncclCommSplit``), which every rank of the
    default group must join, so a group built by the pipeline's ranks alone would wait for the
    others; lazily initialized groups (the default, and ``shardkit train``'s) have no split."""
    if backend.lower() != "gloo" and eager:
        return (
            "chunked schedules on NCCL build one process group per pipeline link from the pipeline's ranks "
            "alone, which an eagerly initialized default group (init_process_group(device_id=...)) cannot do "
            "(ncclCommSplit needs every rank); initialize it without device_id"
        )
    return None


class ChunkedStage:
    """The chunks one rank holds: ``modules[c]`` is local chunk ``c`` (each maps one tensor to
    one tensor, e.g. ``[B / M, S, H] -> [B / M, S, H]``).

    Args:
        modules: this rank's ``v`` chunk modules, local chunk order (:func:`chunk_layers`).
        pp_group: the pipeline group (``ProcessGroup`` or 1-D ``DeviceMesh``); rank = group rank.
        placement: ``"looped"`` or ``"v"`` (``v = 2``); the schedule's placement.
        loss_fn: ``loss_fn(output, target) -> scalar``; required on the rank holding the last
            chunk (``p - 1`` looped, 0 for ``"v"``).

    Attributes:
        links: the process group of each link (:func:`link_groups`).

    Raises:
        ShardkitTypeError: a module is not an ``nn.Module``; ``loss_fn`` not callable.
        ShardkitError: on every rank (one :func:`~shardkit.comm.agree.agree`) when any rank has
            no modules, an unknown placement, ``v != 2`` with ``"v"``, the last chunk without a
            ``loss_fn``, ranks disagree on ``v`` or the placement, or an NCCL pipeline whose
            default group was initialized eagerly (:func:`links_error`).
    """

    def __init__(
        self,
        modules: Sequence[nn.Module],
        pp_group: Group,
        *,
        placement: str = "looped",
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        op = type(self).__name__
        if not isinstance(modules, (list, tuple)) or not all(isinstance(m, nn.Module) for m in modules):
            raise ShardkitTypeError(f"{op}: modules must be a list of torch.nn.Module (one per chunk)")
        if loss_fn is not None and not callable(loss_fn):
            raise ShardkitTypeError(f"{op}: loss_fn must be callable, got {type(loss_fn).__name__}")
        g = resolve_group(pp_group, op)
        self.modules, self.group, self.placement, self.loss_fn = list(modules), pp_group, placement, loss_fn
        self.info: GroupInfo = g
        self.rank, self.p, self.v = g.rank, g.size, len(self.modules)
        eager = getattr(dist.group.WORLD, "bound_device_id", None) is not None
        error = self._error() or links_error(g.pg.name(), eager)

        def judge(seen: list) -> list[str]:
            differ = [r for r, x in enumerate(seen) if x != seen[0]]
            return [f"rank {r} has (v, placement) {seen[r]}, rank 0 {seen[0]}" for r in differ[:1]]

        agree(g, op, error, [self.v, placement], judge=judge, headline=REJECTED)
        self.links = link_groups(g, separate=g.pg.name().lower() != "gloo")  # every rank gets here
        # run_schedule's negotiated shapes per (receiving chunk, direction), kept between calls
        self._caches: dict | None = None
        self.shape_trust = ShapeTrust()  # trusted negotiated shapes (run_schedule's shape_key)

    # the tp groups of stages with their own tp sizes (a PipelineStage built on StageGroups)
    stages: StageGroups | None = None

    def _error(self) -> str | None:
        if self.v < 1:
            return "needs at least one chunk module"
        if self.placement not in PLACEMENTS:
            return f"unknown placement {self.placement!r}; expected one of {PLACEMENTS}"
        if self.placement == "v" and self.v != 2:
            return f"placement 'v' holds 2 chunks per rank, got {self.v} modules"
        if self.holds(self.num_chunks - 1) and self.loss_fn is None:
            return f"rank {self.rank} holds the last chunk ({self.num_chunks - 1}) and needs loss_fn(output, target)"
        return None

    @property
    def num_chunks(self) -> int:
        """``p * v``, the chunks of the whole pipeline."""
        return self.p * self.v

    def global_chunk(self, local: int) -> int:
        """The global index of local chunk ``local``."""
        return global_chunk(self.placement, self.rank, local, self.p)

    def owner(self, chunk: int) -> int:
        """The pipeline rank holding global ``chunk``."""
        return chunk_owner(self.placement, chunk, self.p)[0]

    def holds(self, chunk: int) -> bool:
        """Whether this rank holds global ``chunk``."""
        return self.owner(chunk) == self.rank

    @property
    def is_first(self) -> bool:
        """Whether this rank holds the first chunk (it takes the inputs)."""
        return self.holds(0)

    @property
    def is_last(self) -> bool:
        """Whether this rank holds the last chunk (it computes the loss)."""
        return self.holds(self.num_chunks - 1)

    def take_caches(self, keep: bool) -> dict:
        """The shape caches a call runs with: the kept ones if ``keep`` (agreed by every rank),
        else new ones; none is held until :meth:`keep_caches` (a failed call leaves none)."""
        caches = (self._caches if keep else None) or {}
        self._caches = None
        return caches

    def keep_caches(self, caches: dict) -> None:
        """Keep ``caches`` for the next call (this rank's call completed)."""
        self._caches = caches

    @property
    def has_caches(self) -> bool:
        return self._caches is not None
