"""Measured activation memory: the bytes each decoder block keeps from its forward for its backward.

:class:`SavedBytesMeter` counts, per block and forward call, every distinct storage held for
backward, parameters excluded:

* ``none``: every tensor autograd saves (``torch.autograd.graph.saved_tensors_hooks``: the pack
  hook sees each one), deduplicated by storage (a tensor saved by two ops, or two views of one
  storage, count once, at the storage's size).
* ``full``: the tensors the checkpoint keeps to recompute the block: its tensor inputs (hidden
  states, rotary cos / sin, position ids, masks), deduplicated the same way. Inside the
  checkpoint autograd saves nothing (the checkpoint's own hooks hold only placeholders).
* ``selective``: the inputs, plus the outputs the block's policy keeps (matmuls and attention
  outside the output projections, seen by a dispatch mode below the SAC cache), plus the kept
  results of the collectives the replay serves (:class:`~.checkpointing.CollectiveReplay`, at
  their tensor sizes: they are clones).

Inputs shared by every block (cos / sin) are counted in each block: the figure is what one
block holds. On CPU these bytes are the activation measure (there is no allocator peak); on
CUDA the trainer also reports ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..comm.replay_scope import replay_excluded
from .ac_policy import ACPolicy, ac_kind
from .checkpointing import REPLAYED_C10D_OPS, check_ac_mode

__all__ = ["SavedBytesMeter", "activation_meter"]


class _Tally:
    """Distinct storages of one block call, parameters excluded."""

    def __init__(self, params: set[int]) -> None:
        self.seen: set[int] = set(params)
        self.bytes = 0

    def add(self, t) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.seen:
            self.seen.add(storage.data_ptr())
            self.bytes += storage.nbytes()


class _KeptOutputs(TorchDispatchMode):
    """Counts what the block's selective policy keeps: the outputs it keeps
    (``block.shardkit_ac_policy``, set by :func:`~.checkpointing.apply_ac`) and replayed collectives."""

    def __init__(self, tally: _Tally, keeps) -> None:
        super().__init__()
        self.tally = tally
        self.keeps = keeps

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.keeps(func):
            for t in tree_leaves(out):
                self.tally.add(t)
        elif func.namespace == "c10d" and func._opname in REPLAYED_C10D_OPS and not replay_excluded():
            first = args[0]
            self.tally.bytes += sum(t.nbytes for t in (first if isinstance(first, (list, tuple)) else [first]))
        return out


class SavedBytesMeter:
    """Count the activation bytes each block keeps for backward (see the module docstring).

    Use around the forward (the backward may run after it exits)::

        with SavedBytesMeter(decoder_layers(model), "full") as meter:
            loss = model(ids).loss
        meter.per_block  # [bytes of block 0, bytes of block 1, ...], summed over calls

    Args:
        blocks: the decoder blocks (:func:`~.decoder.decoder_layers`), parallelized with ``mode``.
        mode: the activation checkpointing they were parallelized with (a name, ``"selective:N"``
            or an :class:`~.ac_policy.ACPolicy`); each block is counted by the mode
            :func:`~.checkpointing.apply_ac` gave it (``shardkit_ac_mode``: with ``every > 1``
            the blocks between the checkpointed ones keep everything).

    Raises:
        ShardkitError: an unknown mode.
    """

    def __init__(self, blocks: Sequence[nn.Module], mode: str | ACPolicy) -> None:
        self.blocks = list(blocks)
        self.mode = ac_kind(check_ac_mode(mode))
        self.per_block = [0] * len(self.blocks)
        self._handles: list = []
        self._open: list[tuple[int, _Tally, contextlib.ExitStack]] = []

    def __enter__(self) -> SavedBytesMeter:
        for i, block in enumerate(self.blocks):
            self._handles.append(block.register_forward_pre_hook(self._pre(i), with_kwargs=True))
            self._handles.append(block.register_forward_hook(self._post, always_call=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre(self, i: int):
        def hook(module, args, kwargs):
            # a nested FSDP2 module's (the experts over edp) parameters are still sharded DTensors here
            params = [p.to_local() if hasattr(p, "to_local") else p for p in module.parameters()]
            tally = _Tally({p.untyped_storage().data_ptr() for p in params})
            stack = contextlib.ExitStack()
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack(tally), lambda t: t))
            mode = getattr(module, "shardkit_ac_mode", self.mode)
            if mode != "none":  # the checkpoint holds the inputs for the recompute
                for t in tree_leaves((args, kwargs)):
                    tally.add(t)
            if mode == "selective":
                stack.enter_context(_KeptOutputs(tally, module.shardkit_ac_policy.keeps))
            self._open.append((i, tally, stack))

        return hook

    @staticmethod
    def _pack(tally: _Tally):
        def pack(t: torch.Tensor) -> torch.Tensor:
            # a nested FSDP2 module (experts over edp) gathers its weights after the block's
            # pre-hook: they are parameters (or views of them) all the same, not activations
            if not isinstance(t, nn.Parameter) and not isinstance(t._base, nn.Parameter):
                tally.add(t)
            return t

        return pack

    def _post(self, module, args, output) -> None:
        i, tally, stack = self._open.pop()
        stack.close()
        self.per_block[i] += tally.bytes


def activation_meter(module: nn.Module, mode: str | ACPolicy) -> SavedBytesMeter | None:
    """A :class:`SavedBytesMeter` on ``module``'s decoder blocks, or None for a model without
    ``model.layers`` (the conv autoencoder)."""
    layers = getattr(getattr(module, "model", None), "layers", None)
    if layers is None:
        return None
    return SavedBytesMeter(list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers), mode)
