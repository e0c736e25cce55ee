"""Embedding tables sharded over tensor-parallel ranks: ``embedding_rowwise`` / ``embedding_colwise``.

* ``embedding_rowwise`` (vocab-parallel, Megatron's ``VocabParallelEmbedding``): the table
  ``[V, H]`` is cut by vocabulary rows. Each rank looks up the ids in its row range, writes zeros
  for the others and the partial outputs are all-reduced, so the output ``[..., H]`` is
  replicated. Uneven vocabularies use the real per-rank offsets (``torch.chunk`` semantics), not
  ``rank * local_rows``, which is wrong for the short last shard.
* ``embedding_colwise``: the table is cut by hidden columns ``[V, H_r]``; the output is
  all-gathered along the hidden dim (backward: this rank keeps its block of the replicated
  gradient).

Source: Megatron-LM ``VocabParallelEmbedding`` (Shoeybi et al., 2019); Hugging Face
transformers' ``embedding_rowwise`` / ``embedding_colwise`` plan strings.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .._shapes import chunk_sizes
from ..comm import all_reduce_forward, gather_forward_split_backward
from ..errors import ShardkitTypeError
from ..sharding import ShardSpec, shard_parameter
from .styles import ParallelStyle, StyleContext

if TYPE_CHECKING:
    from .._types import Group

__all__ = ["EmbeddingParallel"]


def _vocab_parallel_forward(self: nn.Embedding, start: int, stop: int, group: Group, ids: torch.Tensor) -> torch.Tensor:
    """The forward of a vocab-sharded embedding holding rows ``[start, stop)``."""
    outside = (ids < start) | (ids >= stop)
    local = (ids - start).masked_fill(outside, 0)
    out = F.embedding(
        local, self.weight, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse
    )
    # Multiply rather than assign in place so autograd sees the mask (its gradient rows for the
    # masked ids are zero, as they must be: another rank owns those rows).
    out = out * (~outside).unsqueeze(-1).to(out.dtype)
    return all_reduce_forward(out, group)


class EmbeddingParallel(ParallelStyle):
    """Shard an ``nn.Embedding`` by vocabulary rows (``dim=0``) or by hidden columns (``dim=1``).

    Input: integer ids ``[...]`` (replicated); output ``[..., H]`` replicated on every rank.

    Args:
        dim: 0 for ``embedding_rowwise`` (vocab-parallel), 1 for ``embedding_colwise``.
    """

    def __init__(self, dim: int = 0) -> None:
        self.dim = dim

    def apply_module(self, module: nn.Module, ctx: StyleContext) -> None:
        if not isinstance(module, nn.Embedding):
            raise ShardkitTypeError(
                f"EmbeddingParallel: expected an nn.Embedding at {ctx.name}, got {type(module).__name__}"
            )
        full = module.weight.shape[self.dim]
        spec = ShardSpec.blocks(self.dim, chunk_sizes(full, ctx.info.size), ctx.group)
        shard_parameter(module, "weight", spec, ctx.info.rank, ctx.memo)
        ((start, stop),) = spec.ranges[ctx.info.rank]
        group = ctx.group
        if self.dim == 0:
            module.num_embeddings = stop - start
            if module.padding_idx is not None:
                # padding_idx is a global id; keep it (as a local id) only on its owner.
                p = module.padding_idx % full
                module.padding_idx = p - start if start <= p < stop else None
            # an instance attribute shadows the class's forward (setattr: a method assignment on purpose)
            setattr(module, "forward", functools.partial(_vocab_parallel_forward, module, start, stop, group))
        else:
            module.embedding_dim = stop - start
            sizes = list(spec.sizes)
            module.register_forward_hook(lambda m, args, out: gather_forward_split_backward(out, group, -1, sizes))
