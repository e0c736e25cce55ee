"""``CPBatch``: this rank's share of a batch under context parallelism (see :mod:`.apply`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _hf_attention

__all__ = ["CPBatch"]


@dataclass(frozen=True)
class CPBatch:
    """This rank's share of a batch, from :meth:`CPContext.shard_batch`.

    Attributes:
        input_ids: ``[B, S_local]`` local token ids.
        position_ids: ``[B or 1, S_local]`` global positions of the local tokens (restarting at 0
            in every document when packed).
        labels: ``[B, S_local]`` targets of the local tokens (the next token of the full
            sequence; ``-100`` where there is none), or None.
        num_tokens: global count of targets that are not ``-100`` (0 without labels).
        seq_len: global ``S``.
        cu_seqlens: global cumulative document lengths, or None.
        indices: ``[S_local]`` global index of each local token.
        call: what the attention needs of this batch; travels as ``inputs["shardkit_cp"]``.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor | None
    num_tokens: int
    seq_len: int
    cu_seqlens: tuple[int, ...] | None
    indices: torch.Tensor
    call: _hf_attention.CPCall

    @property
    def inputs(self) -> dict:
        """Keyword arguments for ``model(**batch.inputs)`` (ids, positions, no KV cache, the CP context).

        Labels are left out on purpose: the model's own loss would shift them a second time.
        """
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "use_cache": False,
            _hf_attention.KWARG: self.call,
        }
