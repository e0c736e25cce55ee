"""A pipeline stage: one slice of a model, its place in the pipeline and (last stage) the loss.

A stage is one rank of a pipeline group, or a tp group of ranks (:class:`~.vtp.StageGroups`,
tp sizes may differ per stage) with the layouts of its input and output over that group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ..comm._group import GroupInfo, resolve_group
from ..errors import ShardkitError, ShardkitTypeError
from ..sharding import Replicate, StageGroups
from .vtp import check_layout

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from .._types import Group
    from ._exchange import ShapeCache
    from .vtp import Shard

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
        in_layout, out_layout: (tp stages only) the layout of the stage's input / output over
            its tp group, :class:`~shardkit.sharding.layouts.Replicate` (default) or
            :class:`~shardkit.sharding.layouts.Shard`.
        input_grad: (tp stages, replicated input) ``"replicated"``: every rank's input gradient
            is the full gradient (the module enters its TP regions through Megatron's ``f``);
            ``"partial"``: each rank's is a partial sum (e.g. the input feeds a column-parallel
            linear directly), summed over the stage before it is sent back.

    With a :class:`~.vtp.StageGroups` as ``pp_group``, every rank of a stage builds the same
    stage (its shard of the module) and runs the same schedule row; the first stage's ranks all
    get the inputs, the last stage's all get the targets and compute the loss.

    Raises:
        ShardkitTypeError: ``module`` is not an ``nn.Module``; ``loss_fn`` not callable.
        ShardkitError: on every rank of the group (agreed by one ``all_gather_object``) when any
            rank's ``stage_index``/``num_stages`` do not match its stage and the number of
            stages, the last stage has no ``loss_fn``, or ranks of one stage disagree on its
            layouts.
    """

    def __init__(
        self,
        module: nn.Module,
        pp_group: Group | Sequence[Group] | StageGroups,
        stage_index: int,
        num_stages: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        *,
        in_layout: Replicate | Shard | None = None,
        out_layout: Replicate | Shard | None = None,
        input_grad: str = "replicated",
    ):
        op = "PipelineStage"
        if not isinstance(module, nn.Module):
            raise ShardkitTypeError(f"{op}: module must be a torch.nn.Module, got {type(module).__name__}")
        if loss_fn is not None and not callable(loss_fn):
            raise ShardkitTypeError(f"{op}: loss_fn must be callable, got {type(loss_fn).__name__}")
        self.stages = pp_group if isinstance(pp_group, StageGroups) else None
        if self.stages is None:
            if in_layout is not None or out_layout is not None:
                raise ShardkitError(f"{op}: in_layout/out_layout need a StageGroups pp_group (stages with tp groups)")
            g = resolve_group(pp_group, op)
            agree_error(g, self._layout_error(g.rank, g.size, stage_index, num_stages, loss_fn), op)
        else:
            g = self.stages.info
            err = self._layout_error(
                self.stages.stage_index,
                self.stages.num_stages,
                stage_index,
                num_stages,
                loss_fn,
                ("has", "stages", "is in stage", "its StageGroups"),
            )
            layouts: tuple[Any, ...] = (in_layout or Replicate(), out_layout or Replicate())
            try:  # a bad argument on one rank must not leave the others waiting: agreed below
                for name, lay in zip(("in_layout", "out_layout"), layouts):
                    check_layout(lay, name)
                if input_grad not in ("replicated", "partial"):
                    raise ShardkitError(f"input_grad must be 'replicated' or 'partial', got {input_grad!r}")
            except ShardkitError as e:
                err, layouts = err or str(e), (repr(in_layout), repr(out_layout))
            self.layouts = _agree_layouts(self.stages, err, layouts + (input_grad,), op)
            self.input_grad = input_grad
        self.module, self.group, self.loss_fn = module, pp_group, loss_fn
        self.stage_index, self.num_stages = stage_index, num_stages
        self._info = g
        # run_schedule's negotiated P2P shapes, kept between its calls (None: none, or a call failed)
        self._shape_cache: ShapeCache | None = None

    @staticmethod
    def _layout_error(
        my_stage: int,
        stages: int,
        stage_index,
        num_stages,
        loss_fn,
        unit=("group has", "ranks", "is group rank", "stage = group rank"),
    ) -> str | None:
        for name, v in (("stage_index", stage_index), ("num_stages", num_stages)):
            if not isinstance(v, int) or isinstance(v, bool):
                return f"{name} must be an int, got {v!r}"
        if num_stages != stages:
            return f"num_stages={num_stages} but the pipeline {unit[0]} {stages} {unit[1]}"
        if stage_index != my_stage:
            return f"stage_index={stage_index} but this rank {unit[2]} {my_stage} ({unit[3]})"
        if stage_index == num_stages - 1 and loss_fn is None:
            return f"the last stage ({stage_index}) needs loss_fn(output, target)"
        return None

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    @property
    def tp_size(self) -> int:
        return 1 if self.stages is None else self.stages.tp.size

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """This stage's module on one microbatch (``kwargs``: that microbatch's stage keyword arguments)."""
        return self.module(x, **kwargs)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The last stage's loss on one microbatch."""
        if self.loss_fn is None:
            raise ShardkitError(
                f"PipelineStage.loss: stage {self.stage_index} has no loss_fn (only the last stage needs one)"
            )
        return self.loss_fn(output, target)


def _agree_layouts(stages: StageGroups, error: str | None, mine: tuple, op: str) -> list:
    """Every rank's (in_layout, out_layout, input_grad), agreed over the replica group; return
    the per-stage list. One ``all_gather_object``; raises the same error on every rank."""
    g = stages.info
    seen: list[Any] = [None] * g.size  # every rank's (error, stage, layouts), from all_gather_object
    dist.all_gather_object(seen, (error, stages.stage_index, mine), group=g.pg)
    bad = [f"rank {r}: {e}" for r, (e, _, _) in enumerate(seen) if e is not None]
    per_stage: dict[int, tuple[int, tuple]] = {}
    for r, (_, s, lay) in enumerate(seen):
        if per_stage.setdefault(s, (r, lay))[1] != lay:
            r0, lay0 = per_stage[s]
            bad.append(f"stage {s}: rank {r} passed layouts {lay} but rank {r0} passed {lay0}")
    if bad:
        raise ShardkitError(f"{op}: {len(bad)} problem(s) over the {g.size} ranks of the pipeline: " + "; ".join(bad))
    return [per_stage[s][1] for s in range(stages.num_stages)]
