"""How a model's layers are cut into a pipeline's chunks (virtual stages), and the deprecated
``ChunkedStage`` (one release: :class:`~.stage.PipelineStage` takes a list of chunks).

The model is cut into ``p * v`` chunks, numbered in the order data flows through them; rank
``r`` of the pipeline group holds ``v`` of them by the placement of :mod:`.steps` (``"looped"``:
chunks ``r, r + p, ...``; ``"v"``: chunks ``r`` and ``2p - 1 - r``). :func:`chunk_layers` says
which layers each chunk gets.

Source: Megatron-LM's virtual pipeline (``virtual_pipeline_model_parallel_size``: a list of model
chunks per rank, Narayanan et al., SC 2021); ZB-V / DualPipeV's V placement (Qi et al. 2024;
DeepSeek-V3 report).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from .._shapes import balanced_split_sizes
from ..errors import ShardkitError
from .stage import PipelineStage
from .steps import global_chunk

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import torch
    from torch import nn

    from .._types import Group

__all__ = ["ChunkedStage", "chunk_layers"]


def chunk_layers(num_layers: int, p: int, v: int, placement: str, rank: int) -> list[range]:
    """The layer indices of each of ``rank``'s chunks, in local chunk order (pure).

    The ``L`` layers are cut into ``p * v`` contiguous chunks in data-flow order; the first
    ``L % (p v)`` chunks get one layer more (``balanced_split_sizes``, the rule of
    :func:`~shardkit.parallelize.decoder_stage_layers` over ``p v`` stages), e.g. ``L = 10, p = 2, v = 2``:
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


class ChunkedStage(PipelineStage):
    """Deprecated (one release): :class:`~.stage.PipelineStage` (``PipelineStage(modules,
    pp_group, loss_fn=loss_fn, placement=placement)``), which takes a list of chunks and warns
    nothing. Same arguments as before; an instance is a ``PipelineStage``."""

    def __init__(
        self,
        modules: Sequence[nn.Module],
        pp_group: Group,
        *,
        placement: str = "looped",
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        warnings.warn(
            "shardkit.pipeline_parallel.ChunkedStage is deprecated: use PipelineStage(modules, pp_group, "
            "loss_fn=..., placement=...), which takes a list of chunk modules",
            DeprecationWarning,
            stacklevel=2,
        )
        super().__init__(modules, pp_group, loss_fn=loss_fn, placement=placement)
