"""The two ways to cut an ``nn.Embedding`` table ``[V, H]`` over tensor-parallel ranks.

Shared by :class:`~.embedding.EmbeddingParallel` (the ``embedding_rowwise`` / ``embedding_colwise``
plan strings) and by :class:`~.styles.ColwiseParallel` / :class:`~.styles.RowwiseParallel`
applied to an embedding, which follow PyTorch DTensor's convention for ``nn.Embedding``:

* by **rows** (``RowwiseParallel``, vocab-parallel, Megatron's ``VocabParallelEmbedding``):
  weight ``[V_r, H]``; each rank looks up the replicated ids inside its row range and writes
  zeros for the others; the partial outputs ``[..., H]`` are then reduced (all-reduce,
  reduce-scatter or left partial).
* by **columns** (``ColwiseParallel``): weight ``[V, H_r]``; every rank looks up every id and
  holds its block of the embedding features ``[..., H_r]`` (no communication, forward or
  backward), optionally all-gathered to ``[..., H]``.

Note the difference from a linear layer: ``ColwiseParallel`` on an ``nn.Linear`` cuts the weight's
dim 0 (output features), on an ``nn.Embedding`` its dim 1 (the embedding features, its output).

Source: Megatron-LM ``VocabParallelEmbedding`` (Shoeybi et al., 2019); PyTorch DTensor's
``ColwiseParallel`` / ``RowwiseParallel`` on ``nn.Embedding`` (weight ``Shard(1)`` / ``Shard(0)``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..comm import gather_forward_split_backward
from ..errors import ShardkitError
from ..sharding import ShardSpec, shard_parameter

if TYPE_CHECKING:
    from .._types import Group

__all__ = ["shard_embedding_columns", "shard_embedding_rows"]


def _vocab_parallel_forward(
    self: nn.Embedding, start: int, stop: int, reduce: Callable[[torch.Tensor], torch.Tensor], ids: torch.Tensor
) -> torch.Tensor:
    """The forward of a vocab-sharded embedding holding rows ``[start, stop)``."""
    outside = (ids < start) | (ids >= stop)
    local = (ids - start).masked_fill(outside, 0)
    out = F.embedding(
        local, self.weight, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse
    )
    # Multiply rather than assign in place so autograd sees the mask (its gradient rows for the
    # masked ids are zero, as they must be: another rank owns those rows).
    out = out * (~outside).unsqueeze(-1).to(out.dtype)
    scale = getattr(self, "embed_scale", None)
    if scale is not None:  # a scaled embedding (Gemma 2): its own forward's factor, exact on zero rows too
        out = out * scale.to(out.dtype)
    return reduce(out)


def shard_embedding_rows(
    module: nn.Embedding,
    spec: ShardSpec,
    rank: int,
    memo: dict,
    reduce: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """Keep this rank's vocabulary rows (``spec`` along dim 0); ``reduce`` combines the partial lookups.

    Input ids ``[...]`` replicated; output ``reduce([..., H] partial)``. The lookup replaces the
    module's forward: a subclass with its own forward must be transformers' scaled embedding
    (``forward = lookup * embed_scale``, Gemma 2's ``Gemma2TextScaledWordEmbedding``), whose
    factor the vocab-parallel lookup applies too.

    Raises:
        ShardkitError: an ``nn.Embedding`` subclass with its own forward and no ``embed_scale``
            buffer (the lookup would silently drop what its forward adds).
    """
    if type(module).forward is not nn.Embedding.forward and not isinstance(
        getattr(module, "embed_scale", None), torch.Tensor
    ):
        raise ShardkitError(
            f"{type(module).__name__}: an nn.Embedding subclass with its own forward cannot be cut by vocabulary "
            "rows (the vocab-parallel lookup replaces that forward); only scaled embeddings (an embed_scale "
            "buffer) are known; cut it by embedding features (ColwiseParallel) or leave it replicated"
        )
    full = module.weight.shape[0]
    shard_parameter(module, "weight", spec, rank, memo)
    ((start, stop),) = spec.ranges[rank]
    module.num_embeddings = stop - start
    if module.padding_idx is not None:
        # padding_idx is a global id; keep it (as a local id) only on its owner.
        p = module.padding_idx % full
        module.padding_idx = p - start if start <= p < stop else None
    # an instance attribute shadows the class's forward (setattr: a method assignment on purpose)
    setattr(module, "forward", functools.partial(_vocab_parallel_forward, module, start, stop, reduce))


def shard_embedding_columns(
    module: nn.Embedding, spec: ShardSpec, rank: int, memo: dict, gather: Group | None, where: str
) -> None:
    """Keep this rank's embedding features (``spec`` along dim 1).

    Input ids ``[...]`` replicated; output ``[..., H_r]``, or ``[..., H]`` all-gathered over
    ``gather`` (backward: this rank keeps its block of the replicated gradient) when it is given.

    Raises:
        ShardkitError: ``max_norm`` is set (the renormalisation needs the whole row).
    """
    if module.max_norm is not None:
        raise ShardkitError(
            f"{where}: an nn.Embedding with max_norm={module.max_norm} cannot be cut by embedding features "
            "(the norm of a row needs all its features); cut it by vocabulary rows (RowwiseParallel)"
        )
    shard_parameter(module, "weight", spec, rank, memo)
    module.embedding_dim = spec.sizes[rank]
    if gather is not None:
        sizes = list(spec.sizes)
        module.register_forward_hook(lambda m, args, out: gather_forward_split_backward(out, gather, -1, sizes))
