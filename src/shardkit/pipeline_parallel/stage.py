"""A pipeline stage: the chunks (slices of a model) one rank holds, its place in the pipeline
and, on the rank holding the last chunk, the loss.

One class for every stage the runner (:mod:`._chunk_exec`) runs: one module per rank, ``v``
chunks per rank (virtual stages, placed ``"looped"`` or ``"v"``: :mod:`.steps`), or one module
per tp group of ranks (:class:`~.vtp.StageGroups`, tp sizes may differ per stage) with the
layouts of its input and output over that group, whose messages are boundary reshards
(:mod:`._stage_links`).

Source: Megatron-LM's virtual pipeline (a list of model chunks per rank, Narayanan et al., SC
2021); torch.distributed.pipelining's ``PipelineStage``; ZB-V / DualPipeV's V placement.
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
from ._agreed import REJECTED
from ._mailbox import link_groups, links_error
from ._transfer import ShapeTrust
from .steps import PLACEMENTS, chunk_owner, global_chunk
from .vtp import check_layout

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from .._types import Group

__all__ = ["PipelineStage"]

_RANKS = ("group has", "ranks", "is group rank", "stage = group rank")  # the words of _index_error
_STAGES = ("has", "stages", "is in stage", "its StageGroups")


class PipelineStage:
    """The chunks one rank holds: ``modules[c]`` is local chunk ``c`` (each maps one tensor to one
    tensor, e.g. ``[B / M, S, H] -> [B / M, S, H]``); one module is one chunk.

    The first chunk takes the input microbatch, the others the previous chunk's output; the rank
    (every rank of the tp group) holding the last chunk also computes ``loss_fn(output, target)``
    (a scalar). :func:`~.runner.run_schedule` runs it under any schedule of its placement.

    Args:
        module: this rank's slice of the model, or its ``v`` chunk modules in local chunk order
            (:func:`~.chunked.chunk_layers`).
        pp_group: the pipeline group (``ProcessGroup`` or 1-D ``DeviceMesh``; pipeline rank =
            group rank), or :class:`~.vtp.StageGroups` (one chunk per tp group: every rank of a
            stage builds the same stage, its shard of the module, and runs the same row).
        stage_index: None, or this rank's stage (one chunk per rank: the pipeline rank); checked.
        num_stages: None, or the number of pipeline ranks (stages of one chunk); checked.
        loss_fn: ``loss_fn(output, target) -> scalar``; required where the last chunk is
            (``p - 1`` looped, 0 for ``"v"``).
        placement: ``"looped"`` (default) or ``"v"`` (two chunks per rank); the schedule's.
        in_layout: (StageGroups only) the layout of the stage's input over its tp group,
            :class:`~shardkit.sharding.layouts.Replicate` (default) or
            :class:`~shardkit.sharding.layouts.Shard`.
        out_layout: (StageGroups only) the layout of the stage's output, as ``in_layout``.
        input_grad: (StageGroups, replicated input) ``"replicated"``: every rank's input gradient
            is the full gradient (the module enters its TP regions through Megatron's ``f``);
            ``"partial"``: each rank's is a partial sum, summed over the stage before it is sent.

    Attributes:
        links: the process group of each link between neighbours (:func:`._mailbox.link_groups`).

    Raises:
        ShardkitTypeError: a module is not an ``nn.Module``; ``loss_fn`` not callable.
        ShardkitError: on every rank (one :func:`~shardkit.comm.agree.agree`) when any rank's
            ``stage_index`` / ``num_stages`` do not match its stage and the number of stages, it
            has no modules, an unknown placement, ``v != 2`` with ``"v"``, the last chunk without
            a ``loss_fn``, ranks disagree on ``v`` or the placement (or, StageGroups, on a stage's
            layouts), several chunks on StageGroups, or an NCCL pipeline whose default group was
            initialized eagerly (:func:`._mailbox.links_error`).
    """

    def __init__(
        self,
        module: nn.Module | Sequence[nn.Module],
        pp_group: Group | Sequence[Group] | StageGroups,
        stage_index: int | None = None,
        num_stages: int | None = None,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        *,
        placement: str = "looped",
        in_layout: Replicate | Shard | None = None,
        out_layout: Replicate | Shard | None = None,
        input_grad: str = "replicated",
    ):
        op = type(self).__name__
        modules = [module] if isinstance(module, nn.Module) else module
        if not isinstance(modules, (list, tuple)) or not all(isinstance(m, nn.Module) for m in modules):
            raise ShardkitTypeError(f"{op}: module must be a torch.nn.Module or a list of them (one per chunk)")
        if loss_fn is not None and not callable(loss_fn):
            raise ShardkitTypeError(f"{op}: loss_fn must be callable, got {type(loss_fn).__name__}")
        self.modules, self.placement, self.loss_fn = list(modules), placement, loss_fn
        self.v, self.group = len(self.modules), pp_group
        self.stages: StageGroups | None = pp_group if isinstance(pp_group, StageGroups) else None
        eager = getattr(dist.group.WORLD, "bound_device_id", None) is not None
        if self.stages is None:
            if in_layout is not None or out_layout is not None:
                raise ShardkitError(f"{op}: in_layout/out_layout need a StageGroups pp_group (stages with tp groups)")
            g = resolve_group(cast("Group", pp_group), op)
            self.info: GroupInfo = g
            self.rank, self.p = g.rank, g.size
            error = _index_error(g.rank, g.size, stage_index, num_stages, loss_fn, self.v, _RANKS)
            error = error or self._error() or links_error(g.pg.name(), eager)

            def judge(seen: list) -> list[str]:
                differ = [r for r, x in enumerate(seen) if x != seen[0]]
                return [f"rank {r} has (v, placement) {seen[r]}, rank 0 {seen[0]}" for r in differ[:1]]

            agree(g, op, error, [self.v, placement], judge=judge, headline=REJECTED)
        else:
            self._init_stage_groups(self.stages, stage_index, num_stages, (in_layout, out_layout, input_grad), op)
        # one group per link on NCCL (tests/harness/stream_model.py); a tp-group stage's link a pair of stages
        self.links = link_groups(self.info, separate=self.info.pg.name().lower() != "gloo", p=self.p)
        # run_schedule's negotiated shapes per (receiving chunk, direction), kept between calls
        self._caches: dict | None = None
        self.shape_trust = ShapeTrust()  # trusted negotiated shapes (run_schedule's shape_key)

    def _init_stage_groups(self, st: StageGroups, stage_index, num_stages, layout: tuple, op: str) -> None:
        """A stage made of a tp group: one looped chunk, pipeline rank = stage; the layouts of
        every stage agreed by every rank of the replica group (:func:`_agree_layouts`)."""
        self.info, self.rank, self.p = st.info, st.stage_index, st.num_stages
        in_layout, out_layout, input_grad = layout
        err = _index_error(self.rank, self.p, stage_index, num_stages, self.loss_fn, self.v, _STAGES)
        if err is None and self.v != 1:
            err = f"a stage of a tp group (StageGroups) holds one chunk, got {self.v} modules"
        layouts: tuple[Any, ...] = (in_layout or Replicate(), out_layout or Replicate())
        try:  # a bad argument on one rank must not leave the others waiting: agreed below
            for name, lay in zip(("in_layout", "out_layout"), layouts):
                check_layout(lay, name)
            if input_grad not in ("replicated", "partial"):
                raise ShardkitError(f"input_grad must be 'replicated' or 'partial', got {input_grad!r}")
        except ShardkitError as e:
            err, layouts = err or str(e), (repr(in_layout), repr(out_layout))
        eager = getattr(dist.group.WORLD, "bound_device_id", None) is not None
        err = err or self._error() or links_error(self.info.pg.name(), eager)
        self.layouts = _agree_layouts(st, err, layouts + (input_grad,), op)
        self.input_grad = input_grad

    def _error(self) -> str | None:
        if self.v < 1:
            return "needs at least one chunk module"
        if self.placement not in PLACEMENTS:
            return f"unknown placement {self.placement!r}; expected one of {PLACEMENTS}"
        if self.placement == "v" and self.v != 2:
            return f"placement 'v' holds 2 chunks per rank, got {self.v} modules"
        if self.holds(self.num_chunks - 1) and self.loss_fn is None:
            return f"rank {self.rank} holds the last chunk ({self.num_chunks - 1}) and needs loss_fn(output, target)"
        return None

    @property
    def module(self) -> nn.Module:
        """The one chunk of a one-chunk stage.

        Raises:
            ShardkitError: the stage holds several chunks (use ``modules``)."""
        if self.v != 1:
            raise ShardkitError(f"PipelineStage.module: the stage holds {self.v} chunks; use .modules")
        return self.modules[0]

    @property
    def stage_index(self) -> int:
        """This rank's pipeline rank (one chunk per rank: its stage)."""
        return self.rank

    @property
    def num_stages(self) -> int:
        """The number of pipeline ranks (stages of one chunk; tp groups of StageGroups)."""
        return self.p

    @property
    def tp_size(self) -> int:
        return 1 if self.stages is None else self.stages.tp.size

    @property
    def num_chunks(self) -> int:
        """``p * v``, the chunks of the whole pipeline."""
        return self.p * self.v

    def global_chunk(self, local: int) -> int:
        """The global index of local chunk ``local``."""
        return global_chunk(self.placement, self.rank, local, self.p)

    def owner(self, chunk: int) -> int:
        """The pipeline rank holding global ``chunk``."""
        return chunk_owner(self.placement, chunk, self.p)[0]

    def holds(self, chunk: int) -> bool:
        """Whether this rank holds global ``chunk``."""
        return self.owner(chunk) == self.rank

    @property
    def is_first(self) -> bool:
        """Whether this rank holds the first chunk (it takes the inputs)."""
        return self.holds(0)

    @property
    def is_last(self) -> bool:
        """Whether this rank holds the last chunk (it computes the loss)."""
        return self.holds(self.num_chunks - 1)

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """A one-chunk stage's module on one microbatch (``kwargs``: its stage keyword arguments)."""
        return self.module(x, **kwargs)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The last stage's loss on one microbatch."""
        if self.loss_fn is None:
            raise ShardkitError(f"PipelineStage.loss: rank {self.rank} has no loss_fn (only the last stage needs one)")
        return self.loss_fn(output, target)

    def kwargs_error(self, stage_kwargs: Sequence[dict] | None, who: str) -> str | None:
        """Why ``stage_kwargs`` (``M`` dicts, or None) lack what a chunk module needs, or None: a
        module's ``required_kwargs`` lists per need its alternatives (a sequence-parallel
        boundary's length: ``seq_len`` or ``position_ids``, :class:`~shardkit.parallelize.DecoderStageModule`)."""
        for need in sorted({n for m in self.modules for n in getattr(m, "required_kwargs", ())}):
            if not all(any(k in kw for k in need) for kw in stage_kwargs or [{}]):
                return f"{who}: its stage modules need {' or '.join(need)} in every microbatch's stage_kwargs"
        return None

    def take_caches(self, keep: bool) -> dict:
        """The shape caches a call runs with: the kept ones if ``keep`` (agreed by every rank),
        else new ones; none is held until :meth:`keep_caches` (a failed call leaves none)."""
        caches = (self._caches if keep else None) or {}
        self._caches = None
        return caches

    def keep_caches(self, caches: dict) -> None:
        """Keep ``caches`` for the next call (this rank's call completed)."""
        self._caches = caches

    @property
    def has_caches(self) -> bool:
        return self._caches is not None


def _index_error(my_stage: int, stages: int, stage_index, num_stages, loss_fn, v: int, unit) -> str | None:
    """Why ``stage_index`` / ``num_stages`` (None: not checked) do not fit this rank (pure)."""
    for name, x in (("stage_index", stage_index), ("num_stages", num_stages)):
        if x is not None and (not isinstance(x, int) or isinstance(x, bool)):
            return f"{name} must be an int, got {x!r}"
    if num_stages is not None and num_stages != stages:
        return f"num_stages={num_stages} but the pipeline {unit[0]} {stages} {unit[1]}"
    if stage_index is not None and stage_index != my_stage:
        return f"stage_index={stage_index} but this rank {unit[2]} {my_stage} ({unit[3]})"
    if v == 1 and stage_index is not None and stage_index == stages - 1 and loss_fn is None:
        return f"the last stage ({stage_index}) needs loss_fn(output, target)"
    return None


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
