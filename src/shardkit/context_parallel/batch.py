"""``CPBatch``: this rank's share of a batch under context parallelism (see :mod:`.apply`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..comm.host_sync import to_device
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

    def to(self, device: torch.device | str) -> CPBatch:
        """This batch with its tensors on ``device``, host (CPU) tensors copied without blocking
        (pinned, ``non_blocking``: :func:`shardkit.comm.host_sync.to_device`); ``self`` when they
        are there already. For a batch sharded on the host: its ``num_tokens`` then cost no read.
        """
        device = torch.device(device)

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None or (t.device.type == device.type and (device.index is None or t.device == device)):
                return t
            return to_device(t, device) if t.device.type == "cpu" else t.to(device)

        moved = {name: move(getattr(self, name)) for name in ("input_ids", "position_ids", "labels", "indices")}
        if all(moved[name] is getattr(self, name) for name in moved):
            return self
        return replace(self, **moved)  # type: ignore[arg-type]  # each field keeps its kind: a tensor, or None where it was

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
