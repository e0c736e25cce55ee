"""A pipeline stage: one slice of a model, its place in the pipeline group and (last stage) the loss."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..comm._group import GroupInfo, resolve_group
from ..errors import ShardkitError, ShardkitTypeError

__all__ = ["PipelineStage", "agree_error"]


def agree_error(g: GroupInfo, local_error: str | None, op: str) -> None:
    """Collective: raise the same ShardkitError on every rank of ``g`` if any rank has an error.

    For checks that could fail on one rank only (e.g. one rank's arguments); the message names
    every offending rank. One ``all_gather_object`` per call; a size-1 group is free.
    """
    if g.size == 1:
        errors = [local_error]
    else:
        errors = [None] * g.size
        dist.all_gather_object(errors, local_error, group=g.pg)
    bad = [(r, e) for r, e in enumerate(errors) if e is not None]
    if bad:
        detail = "; ".join(f"rank {r}: {e}" for r, e in bad)
        raise ShardkitError(f"{op}: {len(bad)} of {g.size} pipeline ranks rejected their arguments: {detail}")


class PipelineStage:
    """One stage of a pipeline: ``module`` maps one tensor to one tensor.

    The first stage takes the input microbatch (e.g. ``[B / M, S, H]``), the others the previous
    stage's output; the last stage also computes ``loss_fn(output, target)`` (a scalar).

    Args:
        module: this stage's slice of the model.
        pp_group: the pipeline group (``ProcessGroup`` or 1-D ``DeviceMesh``); stage = group rank.
        stage_index: this stage's index; must equal the group rank.
        num_stages: the number of stages; must equal the group size.
        loss_fn: ``loss_fn(output, target) -> scalar``; required on the last stage only.

    Raises:
        ShardkitTypeError: ``module`` is not an ``nn.Module``; ``loss_fn`` not callable.
        ShardkitError: on every rank of the group (agreed by one ``all_gather_object``) when any
            rank's ``stage_index``/``num_stages`` do not match its group rank/size, or the last
            stage has no ``loss_fn``.
    """

    def __init__(self, module: nn.Module, pp_group, stage_index: int, num_stages: int, loss_fn=None):
        op = "PipelineStage"
        if not isinstance(module, nn.Module):
            raise ShardkitTypeError(f"{op}: module must be a torch.nn.Module, got {type(module).__name__}")
        if loss_fn is not None and not callable(loss_fn):
            raise ShardkitTypeError(f"{op}: loss_fn must be callable, got {type(loss_fn).__name__}")
        g = resolve_group(pp_group, op)
        agree_error(g, self._layout_error(g, stage_index, num_stages, loss_fn), op)
        self.module, self.group, self.loss_fn = module, pp_group, loss_fn
        self.stage_index, self.num_stages = stage_index, num_stages
        self._info = g

    @staticmethod
    def _layout_error(g: GroupInfo, stage_index, num_stages, loss_fn) -> str | None:
        for name, v in (("stage_index", stage_index), ("num_stages", num_stages)):
            if not isinstance(v, int) or isinstance(v, bool):
                return f"{name} must be an int, got {v!r}"
        if num_stages != g.size:
            return f"num_stages={num_stages} but the pipeline group has {g.size} ranks"
        if stage_index != g.rank:
            return f"stage_index={stage_index} but this rank is group rank {g.rank} (stage = group rank)"
        if stage_index == num_stages - 1 and loss_fn is None:
            return f"the last stage ({stage_index}) needs loss_fn(output, target)"
        return None

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This stage's module on one microbatch."""
        return self.module(x)

    def loss(self, output: torch.Tensor, target) -> torch.Tensor:
        """The last stage's loss on one microbatch."""
        return self.loss_fn(output, target)
