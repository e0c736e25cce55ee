"""Context parallelism: sequence layouts (zigzag, packed documents) and Ulysses attention.

* Layouts (:mod:`.layouts`): the load-balanced zigzag split of a sequence over ``R`` ranks and
  its per-document form for packed sequences, each with split / gather / all-gather
  conventions and exact backward; the pure size and position rules live in :mod:`._sizes`.
* Ring (:mod:`.ring`): KV blocks rotate around the ranks with overlapped point-to-point
  transfers, causal blocks skipped by chunk, dK/dV travelling home in backward; packed
  documents (``cu_seqlens``) with blocks masked or skipped by document.
* USP (:mod:`.usp`): Ulysses all-to-all inside a 2-D context-parallel mesh, ring across;
  packed documents too.
* Ulysses (:mod:`.ulysses`): sequence-sharded attention through two all-to-alls, with uneven
  sequence and head counts, grouped-query KV heads and packed documents.
* Models (:mod:`.apply`): :func:`apply_cp` registers shardkit attention in a Hugging Face model
  through transformers' ``AttentionInterface`` and shards input ids, global position ids and
  pre-shifted labels.
"""

from ._attention import attention_with_lse, document_mask, local_attention
from ._sizes import (
    HeadPlan,
    packed_indices,
    packed_local_cu_seqlens,
    packed_local_sizes,
    packed_positions,
    ulysses_head_plan,
    zigzag_chunk_sizes,
    zigzag_local_sizes,
    zigzag_positions,
)
from .apply import CPContext, apply_cp
from .batch import CPBatch
from .layouts import packed_all_gather, packed_gather, packed_split, zigzag_all_gather, zigzag_gather, zigzag_split
from .ring import ring_attention, ring_chunks
from .ulysses import ulysses_attention
from .usp import usp_attention, usp_indices, usp_local_sizes, usp_packed_local_sizes

__all__ = [
    "apply_cp",
    "CPContext",
    "CPBatch",
    "zigzag_chunk_sizes",
    "zigzag_local_sizes",
    "zigzag_positions",
    "zigzag_split",
    "zigzag_gather",
    "zigzag_all_gather",
    "packed_local_sizes",
    "packed_local_cu_seqlens",
    "packed_indices",
    "packed_positions",
    "packed_split",
    "packed_gather",
    "packed_all_gather",
    "HeadPlan",
    "ulysses_head_plan",
    "ulysses_attention",
    "ring_attention",
    "ring_chunks",
    "usp_attention",
    "usp_local_sizes",
    "usp_packed_local_sizes",
    "usp_indices",
    "local_attention",
    "attention_with_lse",
    "document_mask",
]
