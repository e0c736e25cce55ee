"""FSDP2 on a :class:`~.stage.PipelineStage`: every group gathered once per step and reduced once,
after the last backward step of the rank's row that runs through it.

A rank's row interleaves the backwards of its ``v`` chunks, and of every microbatch; left at
FSDP2's defaults each group would be gathered before every forward and backward and reduced
after every backward. Here, for each FSDP2 group (a ``fully_shard`` module's own parameters:
a decoder layer, the root), :func:`last_backwards` finds in the table the row position of the
last ``B``, ``I`` or ``W`` step of a chunk whose computation runs through the group: the
group's "microbatch ``M - 1``" of :func:`~shardkit.data_parallel.set_microbatch`, which differs
from group to group. The runner then sets, before each backward step, every group's controls
(:func:`~shardkit.data_parallel.microbatches.set_group_sync`): gathered and unreduced until that
step, reduced (HSDP: all-reduced too) and resharded by it. Groups stay gathered after forward
(``set_reshard_after_forward(False)``): each is gathered once, by the step's first forward
through it.

``B`` runs autograd through FSDP2's hooks, which reduce a group at its last ``B``. The weight
gradient ``W`` of the zero-bubble split adds its gradients into ``.grad`` after its autograd
pass (:func:`~.split_backward.weight_grad`), so a group is never reduced inside ``I`` or ``W``:
after the ``W`` that is a group's last step, the runner turns its reduction on and runs FSDP2's
end of backward itself (:func:`~shardkit.data_parallel.microbatches.reduce_outside_autograd`).

A chunk runs through an FSDP2 group when the two share a parameter: a decoder layer's group
belongs to its chunk; the root of a stage module whose chunks are views of it
(:class:`~shardkit.parallelize.DecoderStageModule`) runs (its hooks fire) in every chunk, so it is
reduced after the rank's last backward step.

Memory: as :func:`~shardkit.data_parallel.set_microbatch` with ``M > 1``: a rank holds its
stage's unsharded parameters and gradients for the step, each group until its last backward.

Source: torch.distributed.pipelining keeps FSDP2 stages unsharded and unreduced over a
schedule's backwards and reduces each stage after its last ``B`` or ``W``
(``backward_maybe_with_nosync``, ``perform_reduce_grad``); torchtitan keeps pipelined stages
unsharded between microbatches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from torch import nn
from torch.distributed.fsdp import FSDPModule

from ..data_parallel.microbatches import reduce_outside_autograd, set_group_sync

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .stage import PipelineStage
    from .steps import Step

__all__ = ["FsdpSteps", "last_backwards", "fsdp_steps"]


def last_backwards(row: Sequence[Step], touches: Sequence[frozenset[int]]) -> tuple[int | None, ...]:
    """For each FSDP2 group, the position in ``row`` of its last backward step (pure).

    Args:
        row: one rank's steps (:class:`~.steps.Step`).
        touches: per group, the local chunks whose computation runs through it.

    Returns:
        Per group, the index in ``row`` of the last ``B``, ``I`` or ``W`` step of a chunk in its
        ``touches`` (a ``W`` follows its ``I``, so this is a ``B`` or a ``W``), or None when no
        step of the row touches the group.
    """
    out: list[int | None] = []
    for chunks in touches:
        hits = [i for i, s in enumerate(row) if s.kind != "F" and s.chunk in chunks]
        out.append(hits[-1] if hits else None)
    return tuple(out)


def _done(last: int | None, i: int, kind: str) -> bool:
    """Whether a group whose last backward step is ``last`` reduces during step ``i``: it did
    before, or this ``B`` is that step (an ``I`` or ``W`` reduces after it, see the module)."""
    return last is not None and (last < i or (last == i and kind == "B"))


class FsdpSteps:
    """The FSDP2 groups behind one rank's chunks and when each reduces (see the module).

    Args:
        roots: the FSDP2 roots (modules ``fully_shard`` was applied to last).
        groups: every FSDP2 module behind the chunks (roots included).
        last: :func:`last_backwards` of the rank's row, per group.
        keep_gathered: keep groups gathered after forward (``M > 1``, or a split backward whose
            ``I`` must see the parameters its forward used).
    """

    def __init__(
        self, roots: Sequence[nn.Module], groups: Sequence[nn.Module], last: Sequence[int | None], keep_gathered: bool
    ) -> None:
        self.roots, self.groups, self.last = list(roots), list(groups), list(last)
        self.end = max((x for x in last if x is not None), default=-1)
        for g in self.groups:
            if all(g is not r for r in self.roots):  # FSDP2's root never reshards after forward
                g.set_reshard_after_forward(not keep_gathered, recurse=False)  # type: ignore[operator]

    def before(self, i: int, kind: str) -> None:
        """Set every group's controls for backward step ``i`` of kind ``kind``."""
        for g, last in zip(self.groups, self.last, strict=True):
            if last is not None:
                set_group_sync(g, _done(last, i, kind))
        for r in self.roots:
            r.set_is_last_backward(i == self.end and kind == "B")  # type: ignore[operator]

    def after(self, i: int, kind: str) -> None:
        """After an ``I`` or ``W`` that is some group's last step: reduce those groups now."""
        if kind == "B":
            return
        ending = [g for g, last in zip(self.groups, self.last, strict=True) if last == i]
        if not ending:
            return
        for g in ending:
            set_group_sync(g, True)
        for r in self.roots:
            r.set_is_last_backward(i == self.end)  # type: ignore[operator]
            reduce_outside_autograd(r)


def fsdp_steps(stage: PipelineStage, row: Sequence[Step], m: int) -> FsdpSteps | None:
    """The :class:`FsdpSteps` of ``stage``'s chunks under ``row`` (``m`` microbatches), or None
    when no chunk holds an FSDP2 module."""
    trees = []
    for mod in stage.modules:
        owner = getattr(mod, "owner", None)  # a chunk view of a stage module (parallelize.decoder_stages)
        trees.append(owner if isinstance(owner, nn.Module) else mod)
    groups: list[nn.Module] = []
    for tree in trees:
        for g in tree.modules():
            if isinstance(g, FSDPModule) and all(g is not h for h in groups):
                groups.append(cast("nn.Module", g))  # FSDP2 modules are modules
    if not groups:
        return None
    inside = {id(sub) for g in groups for sub in g.modules() if sub is not g}
    roots = [g for g in groups if id(g) not in inside]
    chunk_params = [{id(p) for p in mod.parameters()} for mod in stage.modules]
    touches = []
    for g in groups:
        own = {id(p) for p in g.parameters()}
        touches.append(frozenset(c for c, ps in enumerate(chunk_params) if own & ps))
    split = any(s.kind == "I" for s in row)
    return FsdpSteps(roots, groups, last_backwards(row, touches), keep_gathered=m > 1 or split)
