"""Activation checkpointing of decoder blocks: ``full`` recompute or an op-level ``selective`` policy.

* ``full``: every block's forward runs under non-reentrant :func:`torch.utils.checkpoint.checkpoint`;
  only the block's inputs are kept, and the whole block (its tp / sp / cp collectives included) runs
  again in backward.
* ``selective``: the same wrapper with a
  :func:`torch.utils.checkpoint.create_selective_checkpoint_contexts` policy that keeps the outputs
  of matmuls and attention kernels (:data:`SAVED_OPS`) except those of the block's output
  projections (:data:`OUTPUT_PROJECTIONS`: ``o_proj``, ``down_proj``), plus :class:`CollectiveReplay`, which
  keeps the result of every shardkit collective and hands it back in the recompute instead of
  communicating again. The collectives are autograd Functions whose c10d calls reach the
  dispatcher as in-place ``c10d.*_`` ops: the SAC policy sees them, but saving them through SAC
  would hand back the old output without filling the new buffer, so the replay writes the kept
  result into the destination buffer itself. Point-to-point ops (ring attention) are not
  replayed: they run again. A block may be recomputed twice (the zero-bubble split's ``I``, then
  ``W``): torch's SAC hands each kept output back once, so the first recompute keeps them
  (:class:`_KeptOutputs`) and later ones get them, and the collectives' results, from there.

  Why the output projections are recomputed: their outputs are ``H`` wide for every token of the
  rank (before the sequence-parallel reduce-scatter, for all of them) and backward never reads
  them; kept, they made a selective block hold more than an unchecked one under tp x cp. Only
  ``o_proj`` runs again (one matmul of seven): the recompute stops once the last tensor backward
  needs (``down_proj``'s input) exists, and the reduce-scatter after ``o_proj`` is replayed.

The wrapper replaces the block's ``forward`` (an instance attribute), so parameter names do not
change and FSDP2's hooks, applied afterwards, stay outside the recomputed region (as torchtitan
applies AC after tp and cp and before FSDP2).

Source: torchtitan ``apply_ac`` (full and op-level selective AC); Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models" (selective recomputation).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..comm import checks_enabled
from ..comm.replay_scope import replay_excluded
from ..errors import ShardkitError
from .ac_policy import OUTPUT_PROJECTIONS, SAVED_OPS, ACPolicy, BlockPolicy, as_policy, every_nth

__all__ = [
    "AC_MODES",
    "OUTPUT_PROJECTIONS",
    "SAVED_OPS",
    "REPLAYED_C10D_OPS",
    "CollectiveReplay",
    "apply_ac",
    "check_ac_mode",
    "selective_policy",
]

AC_MODES = ("none", "full", "selective")

# c10d ops the replay serves from the kept result: op name -> the ledger op names its callers record.
REPLAYED_C10D_OPS = {
    "allreduce_": ("all_reduce",),
    "_allgather_base_": ("all_gather_single", "metadata_all_gather"),
    "allgather_into_tensor_coalesced_": ("all_gather_single", "metadata_all_gather"),
    "_reduce_scatter_base_": ("reduce_scatter_single",),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter_single",),
    "alltoall_base_": ("all_to_all_single",),
    "broadcast_": ("broadcast",),
}


def check_ac_mode(mode: str | ACPolicy, where: str = "parallelize") -> str | ACPolicy:
    """``mode`` if it is one of :data:`AC_MODES`, ``"selective:N"`` or an :class:`~.ac_policy.ACPolicy`.

    Raises:
        ShardkitError: any other value, naming ``where`` and the allowed modes.
    """
    try:
        as_policy(mode)
    except ShardkitError as e:
        raise ShardkitError(
            f"{where}: activation checkpointing must be one of {', '.join(AC_MODES)}, selective:N or an ACPolicy; "
            f"got {mode!r} ({e})"
        ) from None
    return mode


def selective_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """Keep the outputs of :data:`SAVED_OPS`, recompute everything else (the SAC policy)."""
    return CheckpointPolicy.MUST_SAVE if func in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _destinations(func, args) -> list[torch.Tensor]:
    """The tensors a replayed c10d op fills (its first argument: a tensor or a list of them)."""
    first = args[0]
    return list(first) if isinstance(first, (list, tuple)) else [first]


def _works(out) -> list:
    items = out if isinstance(out, (list, tuple)) else [out]
    return [w for w in items if isinstance(w, torch.ScriptObject)]


class CollectiveReplay(TorchDispatchMode):
    """Keep each shardkit collective's result in forward; hand it back, without communicating, in the recompute.

    One instance pair (``record`` / ``replay``) per checkpointed call shares ``kept``: the results,
    in call order (every rank recomputes the same ops in the same order). The recorded op waits
    for its c10d work before copying the result (the caller would wait right after anyway).

    Attributes:
        replaying: True in the recompute context.
        replayed_ledger_ops: ledger op names whose calls are served from ``kept`` while
            ``replaying`` (:func:`shardkit.comm.ledger.record` does not record them: they are not issued).
        kept: the kept results (one list of tensors per replayed call).
    """

    def __init__(self, kept: list, replaying: bool) -> None:
        super().__init__()
        self.kept = kept
        self.replaying = replaying
        self._replayed_ops = frozenset(n for names in REPLAYED_C10D_OPS.values() for n in names) if replaying else ()
        self.position = 0  # the next kept result a recompute hands back

    @property
    def replayed_ledger_ops(self) -> frozenset | tuple:
        # a collective issued under comm.replay_scope.unreplayed is issued again: the ledger records it
        return () if replay_excluded() else self._replayed_ops

    def __enter__(self):
        self.position = 0  # every recompute (I's, then W's under a zero-bubble split) replays them all
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace != "c10d" or func._opname not in REPLAYED_C10D_OPS or replay_excluded():
            return func(*args, **kwargs)
        dests = _destinations(func, args)
        if self.replaying:
            if self.position >= len(self.kept):
                raise ShardkitError(
                    f"activation_checkpoint='selective': the recompute issued {func} beyond the "
                    "collectives of the forward (a block whose communication depends on state that changed)"
                )
            kept, out = self.kept[self.position]
            self.position += 1
            for d, k in zip(dests, kept, strict=True):
                d.copy_(k)
            return out  # the forward's (completed) work: waiting on it again returns at once
        out = func(*args, **kwargs)
        for w in _works(out):
            w.wait()
        self.kept.append(([d.detach().clone() for d in dests], out))
        return out


class _KeptOutputs(TorchDispatchMode):
    """The outputs the selective policy keeps, for a second recompute of one checkpointed call.

    torch's SAC hands each kept output back once (its first recompute consumes it; "Trying to
    backward an extra time"), but a zero-bubble split back-propagates a block twice: ``I``
    recomputes it, then ``W`` again (:mod:`shardkit.pipeline_parallel.split_backward`). Above
    SAC in the first recompute, this mode keeps what SAC hands back for the ops the policy keeps;
    in later ones (without SAC) it hands those back itself and runs the rest. Ops are matched by
    (op, n-th call of it): every recompute of a call runs the same ops in the same order.
    """

    def __init__(self, policy: BlockPolicy, kept: dict, serving: bool) -> None:
        super().__init__()
        self.policy, self.kept, self.serving = policy, kept, serving
        self.calls: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        key = (func, self.calls.get(func, 0))
        self.calls[func] = key[1] + 1
        if self.serving and key in self.kept:
            return self.kept[key]
        out = func(*args, **(kwargs or {}))
        if not self.serving and self.policy.keeps(func):
            self.kept[key] = out
        return out


class _Recompute:
    """The recompute context of one checkpointed call; re-enterable (see :class:`_KeptOutputs`):
    the first recompute replays the collectives under SAC and keeps SAC's outputs, later ones
    replay both without SAC."""

    def __init__(self, replay: CollectiveReplay, sac: Any, policy: BlockPolicy) -> None:
        self.replay, self.sac, self.policy = replay, sac, policy
        self.kept: dict = {}
        self.stacks: list[contextlib.ExitStack] = []
        self.entered = 0

    def __enter__(self) -> None:
        first, self.entered = self.entered == 0, self.entered + 1
        stack = contextlib.ExitStack()
        stack.enter_context(self.replay)  # lowest: SAC's mode and ours sit above the replay
        if first:
            stack.enter_context(self.sac)
        stack.enter_context(_KeptOutputs(self.policy, self.kept, serving=not first))
        self.stacks.append(stack)

    def __exit__(self, *exc: Any) -> bool:
        return bool(self.stacks.pop().__exit__(*exc))


def _contexts(policy: BlockPolicy | None):
    """``(forward, recompute)`` contexts of one checkpointed call (a fresh pair per call)."""
    if policy is None:
        return contextlib.nullcontext(), contextlib.nullcontext()
    kept: list = []
    record, replay = CollectiveReplay(kept, False), CollectiveReplay(kept, True)
    sac_fwd, sac_re = create_selective_checkpoint_contexts(policy)
    return _stacked(record, sac_fwd), _Recompute(replay, sac_re, policy)


@contextlib.contextmanager
def _stacked(lower, upper):
    """Enter ``lower`` then ``upper``: SAC's mode sits above the replay, so the ops the replay
    issues itself (copying a kept result) reach no SAC cache."""
    with lower, upper:
        yield


def _checkpointed(forward: Callable, policy: BlockPolicy | None, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, context_fn=functools.partial(_contexts, policy), **kwargs)


def apply_ac(blocks: Sequence[nn.Module], mode: str | ACPolicy) -> None:
    """Checkpoint the blocks' forwards in place as ``mode`` says (``"none"``: nothing).

    Args:
        blocks: the decoder blocks (:func:`~.decoder.decoder_layers`), after tp and cp, before FSDP2.
        mode: one of :data:`AC_MODES`, ``"selective:N"`` or an :class:`~.ac_policy.ACPolicy`
            (:mod:`.ac_policy`). Each block gets ``shardkit_ac_mode`` (``"none"``, ``"full"``
            or ``"selective"``) and ``shardkit_ac_policy`` (its :class:`~.ac_policy.BlockPolicy`
            or None), what the saved-bytes meter counts.

    Raises:
        ShardkitError: an unknown mode; an op-level policy (``"selective"``) with the check mode
            on (:func:`shardkit.comm.checks`).
    """
    policy = as_policy(check_ac_mode(mode))
    if policy is None:
        return
    if not policy.recomputes_whole and checks_enabled():
        # a tp model's forward agrees once for the ops inside it (comm.checks.covered); the
        # recompute runs outside that region, checks op by op and so dispatches other ops than
        # the forward did, which SAC cannot match. Every rank sets the check mode alike.
        raise ShardkitError(
            "activation_checkpoint='selective' with shardkit's check mode on (--checks / SHARDKIT_CHECKS): "
            "the recompute would run the checks' own ops, not the forward's; use 'full' or turn checks off"
        )
    blocks = list(blocks)
    for block, checkpointed in zip(blocks, every_nth(blocks, policy.every), strict=True):
        sel = None if policy.recomputes_whole or not checkpointed else BlockPolicy(block, policy)
        if checkpointed:
            block.forward = functools.partial(_checkpointed, block.forward, sel)
        kind = "none" if not checkpointed else "full" if sel is None else "selective"
        setattr(block, "shardkit_ac_policy", sel)  # what the saved-bytes meter counts as kept
        setattr(block, "shardkit_ac_mode", kind)
