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

from torch import nn

from .._shapes import chunk_sizes
from ..comm import all_reduce_forward
from ..errors import ShardkitTypeError
from ..sharding import ShardSpec
from .embedding_shards import shard_embedding_columns, shard_embedding_rows
from .style_base import ParallelStyle, StyleContext

__all__ = ["EmbeddingParallel"]


class EmbeddingParallel(ParallelStyle):
    """Shard an ``nn.Embedding`` by vocabulary rows (``dim=0``) or by hidden columns (``dim=1``).

    Input: integer ids ``[...]`` (replicated); output ``[..., H]`` replicated on every rank.
    (:class:`~.styles.RowwiseParallel` / :class:`~.styles.ColwiseParallel` on an embedding cut
    the same dims, with DTensor's output layouts.)

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
        group = ctx.group
        if self.dim == 0:
            shard_embedding_rows(module, spec, ctx.info.rank, ctx.memo, lambda y: all_reduce_forward(y, group))
        else:
            shard_embedding_columns(module, spec, ctx.info.rank, ctx.memo, group, f"EmbeddingParallel at {ctx.name}")
