"""``apply_cp``: context parallelism for a Hugging Face causal LM, from the outside.

The model code is not touched: :func:`apply_cp` registers a shardkit attention function with
transformers' ``AttentionInterface`` and switches the model to it. :meth:`CPContext.shard_batch`
cuts a batch into this rank's tokens with their *global* position ids (RoPE stays right) and
their labels shifted on the full sequence first (no target is lost at a shard border);
:meth:`CPContext.loss` gives the full-sequence token-mean loss on every rank.

Layouts (rank ``(i, j)`` of ``R`` ring x ``U`` Ulysses ranks; ``ulysses``: ``R = 1``,
``ring``: ``U = 1``): ring part ``i`` is the zigzag part ``i`` of the sequence (of every
document when packed, :func:`packed_split`), and Ulysses rank ``j`` holds block ``j`` of the
balanced contiguous split of that part. Ulysses alone thus holds a contiguous block. Mode
``ring`` may instead place its tokens ``contiguous`` (Llama 3) or ``stripe`` (``ring_layout=``).

Source: the sequence-sharded training loops of Megatron-LM context parallelism and
MindSpeed-MM (labels shifted before the split, global position ids, loss summed over the
context-parallel group); Ulysses (Jacobs et al., 2023), ring (Liu et al., 2023), USP (Fang &
Zhao, 2024).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from .._shapes import balanced_split_sizes, split_offsets
from ..comm import _c10d
from ..comm._group import GroupInfo, resolve_group
from ..comm.collectives import all_gather, all_reduce_forward
from ..comm.host_sync import host_side, to_device
from ..errors import ShardkitError, ShardkitTypeError
from . import _hf_attention
from ._sizes import _order, check_cu_seqlens, document_positions
from .batch import CPBatch
from .ring import LAYOUTS, ring_attention
from .ulysses import ulysses_attention
from .usp import usp_attention

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torch import nn

    from .._types import Group

__all__ = ["apply_cp", "CPContext", "CPBatch"]

MODES = ("ulysses", "ring", "usp")
IGNORE_INDEX = -100


def _packed_supported(fn) -> bool:
    return "cu_seqlens" in inspect.signature(fn).parameters


class CPContext:
    """The context-parallel state of one model: mode and groups. Built by :func:`apply_cp`."""

    def __init__(self, mode: str, mesh: Group, ring_dim: str, ulysses_dim: str, ring_layout: str = "zigzag"):
        self.mode, self.mesh = mode, mesh
        self.ring_dim, self.ulysses_dim, self.ring_layout = ring_dim, ulysses_dim, ring_layout
        op = "apply_cp"
        self.ring: GroupInfo | None = None
        self.ulysses: GroupInfo | None = None
        if mode == "usp":
            names = getattr(mesh, "mesh_dim_names", None)
            if (
                not isinstance(mesh, DeviceMesh)
                or names is None
                or mesh.ndim != 2
                or set(names) != {ring_dim, ulysses_dim}
            ):
                raise ShardkitTypeError(
                    f"{op}: mode 'usp' needs a 2-D DeviceMesh with dims ({ring_dim!r}, {ulysses_dim!r}), got "
                    f"{type(mesh).__name__} with dims {names}"
                )
            self.ring, self.ulysses = resolve_group(mesh[ring_dim], op), resolve_group(mesh[ulysses_dim], op)
        else:
            g = resolve_group(mesh, op)  # a ProcessGroup or a 1-D DeviceMesh
            if mode == "ring":
                self.ring = g
            else:
                self.ulysses = g
        self.ring_size = self.ring.size if self.ring else 1
        self.ulysses_size = self.ulysses.size if self.ulysses else 1
        # reductions over the whole cp group: ring dim then Ulysses dim (sum of sums)
        self._groups = [g for g in (self.ring, self.ulysses) if g is not None and g.size > 1]

    @property
    def size(self) -> int:
        """Ranks in the context-parallel group, ``R x U``."""
        return self.ring_size * self.ulysses_size

    def _part(self, cu: tuple[int, ...]):
        """(global indices of this rank's tokens on the host, the zigzag order over the ring;
        ``order.sizes`` = ring part sizes)."""
        order = _order(cu, self.ring_size, torch.device("cpu"), self.ring_layout)
        part = order.local(self.ring.rank if self.ring else 0)
        j = self.ulysses.rank if self.ulysses else 0
        sizes = balanced_split_sizes(part.numel(), self.ulysses_size)
        start = split_offsets(sizes)[j]
        return part[start : start + sizes[j]], order

    def shard_batch(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: Sequence[int] | torch.Tensor | None = None,
    ) -> CPBatch:
        """Keep this rank's tokens of a full batch, identical on every rank of the cp group.

        Args:
            input_ids: ``[B, S]`` token ids of the full sequence.
            labels: ``[B, S]`` targets in the Hugging Face convention (usually ``input_ids``;
                ``-100`` = ignore), *not* shifted: token ``t`` is trained to predict
                ``labels[t + 1]``. The shift happens here, on the full sequence, before the
                split; with ``cu_seqlens`` the last token of each document gets ``-100``.
            position_ids: ``[B, S]`` or ``[1, S]`` global position ids; None for ``0..S-1``, or
                ``0..L_d-1`` within every document when packed.
            cu_seqlens: ``[num_docs + 1]`` cumulative lengths of documents packed along ``S``
                (ints or a 1-D integer tensor, shared by the batch rows); tokens attend only
                within their document.

        Returns:
            :class:`CPBatch` on the inputs' device; call the model as ``model(**batch.inputs)``.
            The layout (token indices, default positions) is built on the host and copied
            without blocking. ``num_tokens`` reads the labels: with labels on an accelerator that
            is one device-to-host read; shard host (CPU) tensors and move the result with
            :meth:`CPBatch.to` for none (what the trainer does).

        Raises:
            ShardkitError: bad shapes or ``cu_seqlens``; a rank left without tokens (``S < R x U``,
                or fewer than ``U`` tokens in a ring part); packed documents in a mode whose
                attention does not support them.
            ShardkitTypeError: non-integer ids, labels or positions.
        """
        op = "shard_batch"
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
            raise ShardkitTypeError(
                f"{op}: input_ids must be an integer [B, S] tensor, got {getattr(input_ids, 'shape', input_ids)!r}"
            )
        b, s = input_ids.shape
        for name, t, shapes in (("labels", labels, [(b, s)]), ("position_ids", position_ids, [(b, s), (1, s)])):
            if t is not None and (
                not isinstance(t, torch.Tensor) or t.is_floating_point() or tuple(t.shape) not in shapes
            ):
                want = " or ".join(map(str, shapes))
                raise ShardkitError(
                    f"{op}: {name} must be an integer tensor of shape {want}, got {getattr(t, 'shape', t)!r}"
                )
        cu = None
        if cu_seqlens is not None:
            cu = check_cu_seqlens(cu_seqlens, op, total=s)
            fn = {"ulysses": ulysses_attention, "ring": ring_attention, "usp": usp_attention}[self.mode]
            if not _packed_supported(fn):
                raise ShardkitError(
                    f"{op}: packed documents (cu_seqlens) are not supported by {fn.__name__} yet (mode {self.mode!r})"
                )
        dev = input_ids.device
        with host_side():  # the layout: host data built from ints (the same on every device)
            idx_host, order = self._part(cu or (0, s))
            if min(order.sizes) < self.ulysses_size:  # HF layers cannot run on zero tokens; same verdict on every rank
                raise ShardkitError(
                    f"{op}: every one of the {self.size} cp ranks needs at least one token, "
                    f"but S = {s} in mode {self.mode!r} "
                    f"gives ring parts of {list(order.sizes)} tokens over {self.ulysses_size} Ulysses rank(s)"
                )
            local_positions = None
            if position_ids is None:  # 0..S-1, restarting at every document when packed
                local_positions = document_positions(s, cu).index_select(0, idx_host)[None]
            ends = None
            if labels is not None and cu is not None:  # no target across a document border
                ends = torch.tensor([cu[d + 1] - 1 for d in range(len(cu) - 1) if cu[d + 1] > cu[d]], dtype=torch.int64)
        idx = to_device(idx_host, dev)
        if local_positions is not None:
            position_ids = to_device(local_positions, dev)
        else:
            assert position_ids is not None
            position_ids = position_ids.index_select(1, idx)
        local_labels, num_tokens = None, 0
        if labels is not None:
            shifted = torch.full_like(labels, IGNORE_INDEX)
            shifted[:, :-1] = labels[:, 1:]
            if ends is not None:
                shifted.index_fill_(1, to_device(ends, dev), IGNORE_INDEX)
            # a device read unless the labels are host data (the trainer shards on the host, then CPBatch.to)
            num_tokens = int((shifted != IGNORE_INDEX).sum())
            local_labels = shifted.index_select(1, idx)
        call = _hf_attention.CPCall(self, s, cu)
        return CPBatch(
            input_ids.index_select(1, idx),
            position_ids,
            local_labels,
            num_tokens,
            s,
            cu,
            idx,
            call,
        )

    def shard(self, x: torch.Tensor, batch: CPBatch, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of a full ``[..., S, ...]`` tensor (e.g. ``inputs_embeds``), in the batch's layout.

        Plain indexing: its backward scatters this rank's gradient into a zero full tensor.
        """
        return x.index_select(dim, batch.indices.to(x.device))

    def gather(self, x_local: torch.Tensor, batch: CPBatch, dim: int = 1) -> torch.Tensor:
        """All-gather the local tokens back to the full sequence in global order.

        Reduce-scatter in backward (its adjoint).

        Args:
            x_local: ``[..., S_local, ...]`` with the local tokens at ``dim`` (e.g. logits).
            batch: the batch ``x_local`` was computed from.
            dim: the sequence dim.

        Returns:
            ``[..., S, ...]`` in global token order, identical on every rank.
        """
        cu = batch.cu_seqlens or (0, batch.seq_len)
        order = _order(cu, self.ring_size, torch.device("cpu"), self.ring_layout)
        x = x_local
        if self.ulysses is not None and self.ulysses.size > 1:
            part = order.sizes[self.ring.rank if self.ring else 0]
            x = all_gather(x, self.ulysses.pg, dim, balanced_split_sizes(part, self.ulysses.size))
        if self.ring is not None and self.ring.size > 1:
            x = all_gather(x, self.ring.pg, dim, list(order.sizes))
        return x.index_select(dim, order.inverse.to(x.device))

    def loss(
        self, logits_local: torch.Tensor, labels_local: torch.Tensor, num_tokens: int | None = None
    ) -> torch.Tensor:
        """Token-mean cross entropy of the *full* sequence, on every rank.

        Each rank's gradient is its own tokens' share.

        ``sum(CE(local tokens)) / num_tokens`` summed over the cp group by an all-reduce whose
        backward is the identity (Megatron's ``g``): every rank back-propagates the gradient of
        the full loss with respect to its own logits. Parameter gradients are then partial per
        rank: sum them over the cp group (:meth:`all_reduce_grads`). Half-precision logits are
        upcast to float32; float64 stays float64.

        Args:
            logits_local: ``[B, S_local, V]``.
            labels_local: ``[B, S_local]`` (``batch.labels``).
            num_tokens: global count of non-ignored targets (``batch.num_tokens``); None counts
                them with one all-reduce.

        Returns:
            0-d loss, equal on every rank (NaN when no target is left, as the unsharded mean).

        Raises:
            ShardkitError: logits and labels disagree on ``[B, S_local]``.
        """
        if logits_local.dim() != 3 or labels_local.shape != logits_local.shape[:2]:
            raise ShardkitError(
                f"loss: logits [B, S_local, V] and labels [B, S_local] disagree: "
                f"{tuple(logits_local.shape)} vs {tuple(labels_local.shape)}"
            )
        if logits_local.dtype in (torch.float16, torch.bfloat16):
            logits_local = logits_local.float()
        denominator: float
        if num_tokens is None:
            count = (labels_local != IGNORE_INDEX).sum().to(torch.float64).reshape(1)
            for g in self._groups:
                count = _c10d.all_reduce(count, g, "apply_cp", "forward")
            denominator = count.item()
        else:
            denominator = num_tokens
        total = F.cross_entropy(
            logits_local.flatten(0, 1), labels_local.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        loss = total / denominator
        for g in self._groups:
            loss = all_reduce_forward(loss, g.pg)
        return loss

    def all_reduce_grads(self, model: torch.nn.Module) -> None:
        """Sum every parameter's ``.grad`` over the cp group, in place (one all-reduce per cp dim and dtype).

        Parameters are replicated over the cp group but each rank's gradient covers its own
        tokens only. Call after ``backward`` (before a data-parallel reduction over other ranks).
        """
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        for dtype in sorted({g.dtype for g in grads}, key=str):
            same = [g for g in grads if g.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in same])
            for grp in self._groups:
                flat = _c10d.all_reduce(flat, grp, "apply_cp", "backward")
            for g, part in zip(same, flat.split([g.numel() for g in same])):
                g.copy_(part.view_as(g))

    def _attend(self, q, k, v, *, causal: bool, scale, seq_len: int, cu_seqlens, **variant):
        """``[B, S_local, N, D]`` attention of the mode.

        ``N`` and ``N_kv`` are read from the tensors, so TP-sharded heads work; ``variant``: the
        layer's ``sliding_window`` / ``softcap`` (None: off)."""
        packed = dict(variant) if cu_seqlens is None else {"cu_seqlens": cu_seqlens, **variant}
        if self.mode == "ulysses":
            assert self.ulysses is not None  # __init__ gave the mode its group
            return ulysses_attention(q, k, v, self.ulysses.pg, causal=causal, scale=scale, seq_len=seq_len, **packed)
        if self.mode == "ring":
            assert self.ring is not None  # __init__ gave the mode its group
            return ring_attention(
                q, k, v, self.ring.pg, causal=causal, scale=scale, layout=self.ring_layout, seq_len=seq_len, **packed
            )
        assert isinstance(self.mesh, DeviceMesh)  # usp: a 2-D DeviceMesh, checked in __init__
        return usp_attention(
            q,
            k,
            v,
            self.mesh,
            causal=causal,
            scale=scale,
            seq_len=seq_len,
            ring_dim=self.ring_dim,
            ulysses_dim=self.ulysses_dim,
            **packed,
        )


def apply_cp(
    model: nn.Module,
    cp_mesh: Group,
    mode: str = "ulysses",
    *,
    ring_dim: str = "cp_ring",
    ulysses_dim: str = "cp_ulysses",
    ring_layout: str = "zigzag",
) -> CPContext:
    """Switch a Hugging Face model's attention to shardkit context-parallel attention, without editing the model.

    Registers ``"shardkit_cp_<mode>"`` in transformers' ``AttentionInterface`` and sets it with
    ``model.set_attn_implementation``. The model must then be called with the inputs of
    :meth:`CPContext.shard_batch` (``model(**batch.inputs)``), the same full batch given on every
    rank of ``cp_mesh``. Parameters stay replicated; their gradients are partial per rank
    (:meth:`CPContext.all_reduce_grads`).

    Args:
        model: a transformers ``PreTrainedModel`` whose attention goes through
            ``ALL_ATTENTION_FUNCTIONS`` (Llama, Qwen2, Mistral, ...), or a pipeline stage of one
            (:class:`~shardkit.parallelize.DecoderStageModule`, sharing its config).
        cp_mesh: ``ulysses``/``ring``: a ``ProcessGroup`` or 1-D ``DeviceMesh`` of ``R`` ranks;
            ``usp``: a 2-D ``DeviceMesh`` with dims ``ring_dim`` and ``ulysses_dim``.
        mode: ``"ulysses"`` (all-to-all over heads; contiguous blocks), ``"ring"`` (zigzag ring
            attention), or ``"usp"`` (Ulysses inside, ring across).
        ring_dim: the mesh dim name of the ring for ``usp``.
        ulysses_dim: the mesh dim name of Ulysses for ``usp``.
        ring_layout: the token placement of mode ``ring``: ``"zigzag"``, ``"contiguous"`` (Llama 3's
            slice of the packed sequence per rank) or ``"stripe"`` (every ``R``-th token; one
            document, no sliding window); ``usp`` and ``ulysses`` keep their own.

    Returns:
        :class:`CPContext`: ``shard_batch``, ``loss``, ``gather``, ``shard``, ``all_reduce_grads``.

    Raises:
        ShardkitError: unknown ``mode``; the model cannot switch its attention implementation.
        ShardkitTypeError: bad ``cp_mesh`` (missing dims, wrong rank count) or not a transformers model.

    At run time the attention raises ``ShardkitError`` (on every rank: the checks read the
    config and the batch) for a padding ``attention_mask``, dropout > 0 in training, or a call
    without the ``shard_batch`` inputs. Sliding windows and Gemma 2's logit softcap are applied.
    """
    if mode not in MODES:
        raise ShardkitError(f"apply_cp: mode must be one of {MODES}, got {mode!r}")
    if ring_layout not in LAYOUTS or (ring_layout != "zigzag" and mode != "ring"):
        raise ShardkitError(f"apply_cp: ring_layout must be one of {LAYOUTS} (mode 'ring'), got {ring_layout!r}")
    if not hasattr(model, "config"):
        raise ShardkitTypeError(
            f"apply_cp: expected a transformers PreTrainedModel (or a pipeline stage of one), "
            f"got {type(model).__name__}"
        )
    ctx = CPContext(mode, cp_mesh, ring_dim, ulysses_dim, ring_layout)
    name = _hf_attention.register(mode)
    hf: Any = model  # a transformers model or stage of one (it has a config: checked above)
    if hasattr(hf, "set_attn_implementation"):
        hf.set_attn_implementation(name)
    else:
        # A pipeline stage module (shardkit.parallelize.DecoderStageModule) shares the
        # model's config, which its attention layers read at every call.
        hf.config._attn_implementation = name
    if hf.config._attn_implementation != name:
        raise ShardkitError(
            f"apply_cp: {type(model).__name__} did not switch its attention implementation to {name!r} "
            f"(it is {hf.config._attn_implementation!r}); the model must call ALL_ATTENTION_FUNCTIONS.get_interface"
        )
    _hf_attention.refuse_padding_masks(model)
    return ctx
