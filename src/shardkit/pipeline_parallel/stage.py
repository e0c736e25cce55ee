"""A pipeline stage: one slice of a model, its place in the pipeline and (last stage) the loss.

A stage is a :class:`~.chunked.ChunkedStage` of one chunk, run by the one runner
(:mod:`._chunk_exec`) on every schedule: one rank of a pipeline group, or a tp group of ranks
(:class:`~.vtp.StageGroups`, tp sizes may differ per stage) with the layouts of its input and
output over that group, whose messages are boundary reshards (:mod:`._stage_links`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from ..comm._group import GroupInfo, resolve_group
from ..comm.agree import agree
from ..errors import ShardkitError, ShardkitTypeError
from ..sharding import Replicate, Shard, StageGroups
from ._transfer import ShapeTrust
from .chunked import ChunkedStage, link_groups, links_error
from .vtp import check_layout

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from .._types import Group

__all__ = ["PipelineStage"]


class PipelineStage(ChunkedStage):
    """One stage of a pipeline: ``module`` maps one tensor to one tensor.

    A :class:`~.chunked.ChunkedStage` holding one chunk (``modules == [module]``, looped
    placement, pipeline rank = stage): :func:`~.runner.run_schedule` runs it on the one runner,
    every one-chunk schedule (``1f1b``, ``gpipe``, ``zb-h1``), static ``boundary_shapes`` and the
    check mode included, on a pipeline group or on :class:`~.vtp.StageGroups`.

    The first stage takes the input microbatch (e.g. ``[B / M, S, H]``), the others the previous
    stage's output; the last stage also computes ``loss_fn(output, target)`` (a scalar).

    Args:
        module: this stage's slice of the model.
        pp_group: the pipeline group (``ProcessGroup`` or 1-D ``DeviceMesh``); stage = group rank.
        stage_index: this stage's index; must equal the group rank.
        num_stages: the number of stages; must equal the group size.
        loss_fn: ``loss_fn(output, target) -> scalar``; required on the last stage only.
        in_layout: (tp stages only) the layout of the stage's input over its tp group,
            :class:`~shardkit.sharding.layouts.Replicate` (default) or
            :class:`~shardkit.sharding.layouts.Shard`.
        out_layout: (tp stages only) the layout of the stage's output, as ``in_layout``.
        input_grad: (tp stages, replicated input) ``"replicated"``: every rank's input gradient
            is the full gradient (the module enters its TP regions through Megatron's ``f``);
            ``"partial"``: each rank's is a partial sum (e.g. the input feeds a column-parallel
            linear directly), summed over the stage before it is sent back.

    With a :class:`~.vtp.StageGroups` as ``pp_group``, every rank of a stage builds the same
    stage (its shard of the module) and runs the same schedule row; the first stage's ranks all
    get the inputs, the last stage's all get the targets and compute the loss.

    Raises:
        ShardkitTypeError: ``module`` is not an ``nn.Module``; ``loss_fn`` not callable.
        ShardkitError: on every rank of the group (agreed by :func:`~shardkit.comm.agree.agree`) when any
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
        self.module, self.stage_index, self.num_stages = module, stage_index, num_stages
        if not isinstance(pp_group, StageGroups):
            if in_layout is not None or out_layout is not None:
                raise ShardkitError(f"{op}: in_layout/out_layout need a StageGroups pp_group (stages with tp groups)")
            g = resolve_group(pp_group, op)
            # checked in the chunked stage's one agreement (_error), before its own checks
            self._index_error = self._layout_error(g.rank, g.size, stage_index, num_stages, loss_fn)
            super().__init__([module], cast("Group", pp_group), placement="looped", loss_fn=loss_fn)
            return
        self.stages = pp_group
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
        eager = getattr(dist.group.WORLD, "bound_device_id", None) is not None
        err = err or links_error(g.pg.name(), eager)
        self.layouts = _agree_layouts(self.stages, err, layouts + (input_grad,), op)
        self.input_grad = input_grad
        # the chunked stage's view of a tp-group stage: one looped chunk, stage = pipeline rank
        self.modules, self.placement, self.loss_fn = [module], "looped", loss_fn
        self.group = cast("Any", pp_group)  # the StageGroups itself
        self.rank, self.p, self.v = stage_index, num_stages, 1
        self.info: GroupInfo = g  # the replica group of the StageGroups
        self._caches = None
        # one group per link between stages on NCCL, as a one-rank stage's (stream_model.py)
        self.links = link_groups(g, separate=g.pg.name().lower() != "gloo", p=num_stages)
        self.shape_trust = ShapeTrust()

    def _error(self) -> str | None:
        return self._index_error or super()._error()

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
    the per-stage list. One :func:`~shardkit.comm.agree.agree` (every payload gathered: the
    stages differ); raises the same error on every rank."""
    # the layouts travel as their reprs (JSON text), rebuilt below once every rank's are valid
    payload = [stages.stage_index, [repr(mine[0]), repr(mine[1]), mine[2]], repr(mine)]

    def judge(seen: list) -> list[str]:
        bad: list[str] = []
        first: dict[int, tuple[int, str]] = {}  # stage -> (its first rank, that rank's layouts)
        for r, (s, _, text) in enumerate(seen):
            if first.setdefault(s, (r, text))[1] != text:
                bad.append(f"stage {s}: rank {r} passed layouts {text} but rank {first[s][0]} passed {first[s][1]}")
        return bad

    seen = agree(
        stages.info,
        op,
        error,
        payload,
        judge=judge,
        gather=True,
        headline="{n} problem(s) over the {size} ranks of the pipeline",
    )
    per_stage = {s: lay for s, lay, _ in reversed(seen)}  # every rank of a stage agreed: any one
    return [(_layout(i), _layout(o), grad) for i, o, grad in (per_stage[s] for s in range(stages.num_stages))]


def _layout(text: str) -> Replicate | Shard:
    """A valid boundary layout back from its repr (``Replicate()`` or ``Shard(dim)``)."""
    return Replicate() if text == "Replicate()" else Shard(int(text.removeprefix("Shard(").removesuffix(")")))
