"""The causal-LM task of the trainer: batches of text windows, their layout, the loss.

Every rank draws the same global batch ``[B, S]`` (seeded sampler). A rank keeps the rows of its
data-parallel coordinate, splits them into microbatches and, with context parallelism, keeps its
tokens (:meth:`~shardkit.context_parallel.CPContext.shard_batch`: labels shifted on the full
sequence first, global position ids). Packed documents (``--packed``: each window is the corpus
files it spans, packed along ``S``) restart their positions at every document and never predict
across a border; without cp a block-causal ``attention_mask`` keeps them apart
(:func:`.attention.packed_attention_mask`, the model's sliding window included, built from the
sampler's document borders), with cp the ring / Ulysses attention does (``cu_seqlens``).

Loss: the *sum* of next-token cross entropies over this rank's targets; the trainer divides by
the global target count ``N``, so every layout back-propagates its share of the global mean.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..comm.host_sync import host_side, to_device
from ..tensor_parallel.loss import vocab_parallel_cross_entropy
from .attention import packed_attention_mask
from .data import BatchSampler

__all__ = ["IGNORE_INDEX", "LMTask", "PackedSampler", "shifted_labels", "causal_lm_loss"]

IGNORE_INDEX = -100


class PackedSampler(BatchSampler):
    """:class:`.data.BatchSampler`'s windows (same generator draws), each with its documents.

    A document is one corpus file: ``next_batch`` gives ``([B, S] ids, cu)`` where ``cu[b]`` is
    the cumulative document lengths of row ``b`` (the file boundaries inside its window).

    Args:
        tokens: as :class:`.data.BatchSampler`.
        seq_len: as :class:`.data.BatchSampler`.
        batch_size: as :class:`.data.BatchSampler`.
        seed: as :class:`.data.BatchSampler`.
        file_sizes: token count of every corpus file, in stream order (summing to ``N``).
    """

    def __init__(self, tokens, seq_len: int, batch_size: int, seed: int, file_sizes: list[int]) -> None:
        super().__init__(tokens, seq_len, batch_size, seed)
        self.starts = torch.tensor(file_sizes, dtype=torch.int64).cumsum(0)[:-1]  # where files 1.. begin

    def next_batch(self):
        starts = torch.randint(0, self.tokens.numel() - self.seq_len + 1, (self.batch_size,), generator=self.gen)
        ids = self.tokens[starts[:, None] + self._offsets].long()
        cu = []
        for a in starts.tolist():
            inside = self.starts[(self.starts > a) & (self.starts < a + self.seq_len)] - a
            cu.append((0, *inside.tolist(), self.seq_len))
        return ids, cu


def shifted_labels(ids: torch.Tensor, cus=None) -> torch.Tensor:
    """Next-token targets ``[B, S]``: ``ids[:, t + 1]`` at ``t``; ``-100`` at the end of every row
    and, for packed rows (``cus[b]`` cumulative document lengths), of every document."""
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, :-1] = ids[:, 1:]
    for b, cu in enumerate(cus or ()):
        labels[b, [e - 1 for e in cu[1:] if e > 0]] = IGNORE_INDEX
    return labels


def causal_lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of full logits ``[B, S, V]`` and ids ``[B, S]`` (a plain
    reference for tests). Not the model's own ``labels=`` loss: transformers' causal-LM loss
    casts logits to float32, which would cap a float64 run at float32 precision. Half precision
    is upcast to float32; float64 stays float64."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _positions(cu, seq_len: int) -> torch.Tensor:
    """``[S]`` positions restarting at 0 in every document of one packed row."""
    pos = torch.arange(seq_len)
    for a, b in zip(cu[:-1], cu[1:]):
        pos[a:b] -= a
    return pos


@dataclass
class Microbatch:
    ids: torch.Tensor  # [b, S]
    cus: list | None  # per row cumulative document lengths (packed), else None


class LMTask:
    """Next-token prediction on a token stream.

    Args:
        sampler: :class:`.data.BatchSampler` (``[B, S]`` batches) or :class:`PackedSampler`.
        device: where microbatches go.
        held_out: the validation batches (:class:`.data.HeldOutBatches`), or None.
    """

    def __init__(self, sampler, device, held_out=None) -> None:
        self.sampler, self.device, self.held_out = sampler, device, held_out
        self.packed = isinstance(sampler, PackedSampler)

    def next_batch(self):
        """The global batch: ``(ids [B, S], cus or None)``, identical on every rank."""
        out = self.sampler.next_batch()
        return out if self.packed else (out, None)

    def count(self, batch) -> int:
        """Global number of next-token targets in the batch (the loss normalizer ``N``)."""
        ids, cus = batch
        return int((shifted_labels(ids, cus) != IGNORE_INDEX).sum())

    def microbatches(self, batch, dp_rank: int, dp: int, m: int) -> list[Microbatch]:
        """This data-parallel rank's rows ``[B / dp, S]``, cut into ``m`` microbatches."""
        ids, cus = batch
        n = ids.shape[0] // dp
        rows = range(dp_rank * n, (dp_rank + 1) * n)
        k = n // m
        return [
            Microbatch(ids[rows[i * k] : rows[i * k] + k], None if cus is None else cus[rows[i * k] : rows[i * k] + k])
            for i in range(m)
        ]

    def prepare(self, mb: Microbatch, pm) -> tuple[dict, torch.Tensor]:
        """Model inputs and targets of one microbatch on this rank (its cp tokens with cp)."""
        with host_side():  # labels and positions from the host copy; one non-blocking copy each
            labels = shifted_labels(mb.ids, mb.cus) if pm.cp is None else None
            positions = None
            if pm.cp is None and mb.cus is not None:
                positions = torch.stack([_positions(cu, mb.ids.shape[1]) for cu in mb.cus])
        if pm.cp is not None:
            cu = None if mb.cus is None else mb.cus[0]  # one row per microbatch when packed (checked up front)
            with host_side():  # sharded on the host (no read of the target count), then copied
                host = pm.cp.shard_batch(mb.ids, mb.ids, cu_seqlens=cu)
            batch = host.to(self.device)
            return dict(batch.inputs), batch.labels
        ids = to_device(mb.ids, self.device)
        inputs = {"input_ids": ids, "use_cache": False}
        if positions is not None and mb.cus is not None:
            inputs["position_ids"] = to_device(positions, self.device)
            # the documents' mask from the host: transformers would read the device to find them
            # with the model's sliding window: a ready mask reaches every layer kind unchanged
            config = getattr(getattr(pm, "module", None), "config", None)
            inputs["attention_mask"] = packed_attention_mask(mb.cus, mb.ids.shape[1], self.device, config)
        assert labels is not None  # made above without cp
        return inputs, to_device(labels, self.device)

    @staticmethod
    def forward(module, inputs: dict) -> torch.Tensor:
        """Logits ``[b, S_local, V]`` (``V / tp`` with the vocab-parallel loss)."""
        return module(**inputs).logits

    @staticmethod
    def loss_sum(logits: torch.Tensor, labels: torch.Tensor, pm) -> torch.Tensor:
        """Sum of the cross entropies of the targets (``-100`` ignored); half precision upcast."""
        if pm.loss_parallel:
            return vocab_parallel_cross_entropy(
                logits, labels, pm.mesh["tp"], ignore_index=IGNORE_INDEX, reduction="sum"
            )
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
