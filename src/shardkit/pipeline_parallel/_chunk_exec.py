"""Run one rank's row of a :class:`~.steps.Step` table on a :class:`~.stage.PipelineStage`.

Steps: ``F`` runs a chunk on a microbatch and hands its output to the next chunk; ``B`` runs
``torch.autograd.backward`` and hands the input gradient to the previous chunk; ``I``/``W`` are
:func:`~.split_backward.input_grad` and :func:`~.split_backward.weight_grad` (a chunk with
post-accumulate-grad hooks runs ``I`` as ``B``: :func:`.run_mode.accumulate_hooks`). The last
chunk's loss is scaled by ``1 / M`` (gradients of the mean of the microbatch losses), or not
(``scale_grads=False``: the sum). A forward-only call (:mod:`.run_mode`) runs the table's
:func:`~.steps.forward_only` rows under ``torch.no_grad``.

Messages (:mod:`._mailbox`). A hand-over to a chunk on this rank (``"v"``: chunk ``p - 1`` to
``p`` on the last rank; every chunk when ``p = 1``) is a dictionary entry, no P2P. Every other
one goes to the neighbour ``r + 1`` or ``r - 1`` (mod ``p``) as one negotiated transfer of
:mod:`.p2p` (``loop=True``): activations as ``send_forward``/``recv_forward`` (ledger phase
``forward``), gradients as ``send_backward``/``recv_backward`` (``backward``), towards whichever
neighbour holds the chunk (a V's ascending leg sends activations to ``r - 1``), on the process
group of its link (``stage.links``, :func:`._mailbox.link_groups`). Shapes are cached per (kind,
receiving chunk) on both ends (one :class:`~._transfer.ShapeCache` each). No tags: between two
ranks the messages pair in FIFO order, so a rank receives each neighbour's messages in the order
it sends them, an order both derive from the table (:func:`.simulate.transfers`), and holds
those that arrive before the step that needs them (V tables need this: their receivers need
messages in another order than they are sent, :func:`.simulate.fifo_mismatches`). On gloo each
neighbour's next receive is posted as soon as the previous one completed, so its data moves
while this rank computes (gloo hands a send over only to a posted receive). The transport
(:mod:`._links`) also sends static ``boundary_shapes`` without a header and, under the check
mode, a header judged on the host with every message; tp-group stages (:class:`~.vtp.StageGroups`)
move each message as a boundary reshard (:mod:`._stage_links`).

FSDP2 chunks: every group is gathered once per step and reduced once, after the last ``B`` or
``W`` of the row that runs through it (:mod:`._fsdp_steps`, set around each backward step).

Why it cannot hang. Sends are waited for only at the end; a receive waits only for messages the
sender produces before the one the step needs, so a rank is never later than in the dataflow
model of :func:`.simulate.simulate_steps`, which :func:`check_table` runs on the table first,
provided no send waits in front of a receive it depends on. Gloo never blocks a post and pairs
each direction of a rank pair on its own. NCCL runs a group's P2P between two ranks (or, with an
eagerly initialized communicator, all of a rank's) in order on one stream: with one process
group per link, no two links of a group sharing a rank, each stream carries one rank pair's
messages one way. The stream model (``tests/harness/stream_model.py``) replays the runner's
own posting order on a model of those streams for every table of :data:`~.tables.SCHEDULES`
(tested; not run on a GPU here).

Source: Megatron-LM's interleaved schedule (explicit gradients between model chunks);
torch.distributed.pipelining's ``PipelineScheduleMulti`` (per-step actions of several stages per
rank, ``I``/``W`` for zero-bubble tables); Qi et al., ICLR 2024 (the I/W split).
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from typing import TYPE_CHECKING, cast

import torch

from ..comm.agree import agree
from ..comm.checks import checks_enabled
from ..errors import ShardkitError
from ._agreed import REJECTED, agree_once
from ._fsdp_steps import fsdp_steps
from ._links import Links, boundary_decls
from ._mailbox import Mailbox, Message, Transport, incoming, step_messages
from ._stage_links import StageLinks
from .run_mode import TRAIN, RunMode, ScheduleOutput, accumulate_hooks, resolve_mode, targets_needed
from .simulate import simulate_steps, transfers
from .split_backward import input_grad, weight_grad
from .steps import Step, Table, forward_only
from .tables import SCHEDULES

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .stage import PipelineStage

__all__ = ["run_chunked", "resolve_table", "check_table", "execute"]


def resolve_table(stage: PipelineStage, schedule, num_microbatches: int | None, op: str) -> tuple[Table, int]:
    """The :class:`Step` table and ``M`` of ``schedule``: a name of :data:`~.tables.SCHEDULES`
    (built for this pipeline's ``p``, ``v`` and ``num_microbatches``), a :class:`Step` table, or a
    one-chunk ``Action`` table (lifted to chunk 0). Pure.

    Raises:
        ShardkitError: an unknown name, a placement other than the stage's, sizes the schedule
            refuses, a missing ``num_microbatches`` with a name, or a malformed table.
    """
    if isinstance(schedule, str):
        spec = SCHEDULES.get(schedule)
        if spec is None:
            raise ShardkitError(f"{op}: unknown pipeline schedule {schedule!r}; expected one of {sorted(SCHEDULES)}")
        if spec.placement != stage.placement:
            raise ShardkitError(
                f"{op}: schedule {schedule!r} places chunks {spec.placement!r}, the stage was built {stage.placement!r}"
            )
        if not isinstance(num_microbatches, int) or isinstance(num_microbatches, bool):
            raise ShardkitError(f"{op}: a schedule name needs num_microbatches= (an int), got {num_microbatches!r}")
        return spec.build(stage.p, stage.v, num_microbatches), num_microbatches
    try:
        table = tuple(tuple(Step(*s) for s in row) for row in schedule)
    except TypeError:
        raise ShardkitError(
            f"{op}: the schedule must be a name or one row of Step per rank, got {schedule!r}"
        ) from None
    m = 1 + max((s.microbatch for row in table for s in row if isinstance(s.microbatch, int)), default=-1)
    if num_microbatches is not None and num_microbatches != m:
        raise ShardkitError(f"{op}: num_microbatches={num_microbatches} but the table runs {m} microbatches")
    return table, m


def check_table(table: Table, stage: PipelineStage, m: int, op: str) -> None:
    """Raise ShardkitError unless ``table`` has one row per rank, runs every (microbatch, chunk)
    of ``v`` chunks and cannot deadlock (:func:`.simulate.simulate_steps`; cached, pure)."""
    if len(table) != stage.p:
        raise ShardkitError(f"{op}: the table has {len(table)} rows, the pipeline {stage.p} ranks (one row per rank)")
    error = _simulated(table, stage.placement, stage.v, m)
    if error is not None:
        raise ShardkitError(f"{op}: the table cannot run on {stage.p} ranks x {stage.v} chunks: {error}")


@lru_cache(maxsize=64)
def _simulated(table: Table, placement: str, v: int, m: int) -> str | None:
    if m < 1:
        return "it runs no microbatch"
    return simulate_steps(table, placement=placement, v=v, num_microbatches=m).error


class _Run:
    """One call's state on this rank (see the module docstring)."""

    def __init__(
        self, stage: PipelineStage, table: Table, m: int, inputs, targets, kwargs, links: Transport, mode: RunMode
    ) -> None:
        self.stage, self.m, self.inputs, self.targets, self.kwargs = stage, m, inputs, targets, kwargs
        self.mode = mode
        # why only gloo: :mod:`._mailbox`; a tp-group stage receives when the step needs it
        early = stage.info.pg.name().lower() == "gloo" and stage.stages is None
        mine = incoming(transfers(table, placement=stage.placement, v=stage.v)[0], stage.rank)
        self.mail = Mailbox(stage.rank, stage.owner, mine, links, early)
        self.stash: dict[tuple[int, int], tuple] = {}  # (microbatch, local chunk) -> (input, output)
        self.pending: dict[tuple[int, int], object] = {}  # (microbatch, local chunk) -> I's pending W
        self.losses: list[torch.Tensor | None] = [None] * m
        self.outputs: list[torch.Tensor | None] = [None] * m
        self.plain = [bool(accumulate_hooks(mod)) for mod in stage.modules]  # these chunks run I as B

    def step(self, s: Step) -> None:
        j, c = s.microbatch, s.chunk
        g = self.stage.global_chunk(c)
        need, give = step_messages(s.kind, j, g, self.stage.num_chunks)
        if s.kind == "F":
            self.forward(j, c, need, give)
        elif s.kind == "W":
            if not self.plain[c]:  # a plain chunk's I ran as B
                weight_grad(self.pending.pop((j, c)))  # type: ignore[arg-type]
        else:
            self.backward(j, c, need, give, split=s.kind == "I" and not self.plain[c])

    def forward(self, j: int, c: int, need: Message | None, give: Message | None) -> None:
        st, train = self.stage, self.mode.train
        x = self.inputs[j] if need is None else self.mail.take(need).requires_grad_(train)
        y = st.modules[c](x, **self.kwargs[j])
        if give is None:  # the last chunk
            assert st.loss_fn is not None  # checked when the stage was built
            if self.mode.return_outputs:
                self.outputs[j] = y.detach()
            if self.targets is not None:  # always when training (checked)
                loss = st.loss_fn(y, self.targets[j])
                self.losses[j] = loss.detach()
                y = loss / self.m if self.mode.scale_grads else loss  # the mean, or the sum
        else:
            self.mail.deliver(give, y.detach())
        if train:  # a forward-only call keeps nothing
            self.stash[(j, c)] = (x, y)

    def backward(self, j: int, c: int, need: Message | None, give: Message | None, split: bool) -> None:
        """``B`` (``split`` False) or ``I``; both hand the input gradient to the previous chunk."""
        x, y = self.stash.pop((j, c))
        grad = None if need is None else self.stage.shape_trust.fit(self.mail.take(need), y)
        if split:
            dx, self.pending[(j, c)] = input_grad(x, y, self.stage.modules[c].parameters(), grad)
        else:
            dx = _backward(x, y, grad)
        if give is not None:
            self.mail.deliver(give, dx if dx is not None else torch.zeros_like(x))


def _backward(x: torch.Tensor, y: torch.Tensor, grad: torch.Tensor | None) -> torch.Tensor | None:
    """A chunk's full backward: parameter gradients accumulate; returns ``x``'s gradient (None:
    ``x`` is the data). One small function: the place a hook around each backward goes."""
    if y.requires_grad:  # else nothing upstream to differentiate
        torch.autograd.backward(y, grad)
    return x.grad if x.requires_grad else None


def execute(
    stage: PipelineStage,
    table: Table,
    m: int,
    inputs,
    targets,
    kwargs: Sequence[dict],
    caches: dict,
    mode: RunMode = TRAIN,
    decls=None,
):
    """Run this rank's row of ``table``; return the ``M`` losses on the rank holding the last
    chunk, else None (parameter gradients accumulate into ``.grad``); with
    ``mode.return_outputs`` a :class:`~.run_mode.ScheduleOutput` on every rank. ``decls``: the
    boundaries' static ``(shape, dtype)`` (:mod:`._links`), or None (negotiated)."""
    links = Links(stage, caches, decls) if stage.stages is None else StageLinks(stage, decls)
    run = _Run(stage, table, m, inputs, targets, kwargs, links, mode)
    fsdp = fsdp_steps(stage, table[stage.rank], m) if mode.train else None  # each group gathered, reduced once
    with torch.set_grad_enabled(mode.train):
        for i, s in enumerate(table[stage.rank]):
            if fsdp is not None and s.kind != "F":
                fsdp.before(i, s.kind)
            run.step(s)
            if fsdp is not None and s.kind != "F":
                fsdp.after(i, s.kind)
    run.mail.finish()
    last = stage.holds(stage.num_chunks - 1)
    losses = cast("list[torch.Tensor]", run.losses) if last and targets is not None else None  # every one ran
    if mode.return_outputs:
        return ScheduleOutput(losses, cast("list[torch.Tensor]", run.outputs) if last else None)
    return losses


def run_chunked(
    stage: PipelineStage,
    schedule,
    inputs,
    targets,
    stage_kwargs,
    num_microbatches,
    boundary_shapes,
    op,
    shape_key=None,
    mode: tuple = (None, True, False),
):
    """:func:`~.runner.run_schedule` on a :class:`~.stage.PipelineStage`: resolve and check the
    table (its forward-only rows in an eval call), agree on it and on every rank's data (one
    small all-reduce when all is well), run. ``mode``: ``(train, scale_grads, return_outputs)``
    as passed (:func:`.run_mode.resolve_mode`)."""
    error, digest, table, m, decls = None, None, cast("Table", ()), 0, None
    run_mode, error = resolve_mode(*mode)
    try:
        table, m = resolve_table(stage, schedule, num_microbatches, op)
        if not run_mode.train:  # a rank in another mode has another table: refused by the agreement
            table = forward_only(table)
        check_table(table, stage, m, op)
        decls = boundary_decls(boundary_shapes, stage.num_chunks - 1, op)
        digest = hashlib.sha1(repr(table).encode()).hexdigest()
        error = error or _data_error(stage, m, inputs, targets, stage_kwargs, run_mode)
    except ShardkitError as e:
        error = str(e)

    def judge(seen: list) -> list[str]:
        differ = [r for r, (d, _, _) in enumerate(seen) if d != seen[0][0]]
        if differ:
            why = "another schedule table than rank 0 (or ran in another mode: train / forward-only)"
            return [f"ranks {differ} passed {why}"]
        differ = [r for r, (_, b, _) in enumerate(seen) if b != seen[0][1]]
        return (
            [f"ranks {differ} passed boundary_shapes {seen[differ[0]][1]}, rank 0 passed {seen[0][1]}"]
            if differ
            else []
        )

    def agreed() -> bool:
        seen = agree(stage.info, op, error, [digest, repr(decls), stage.has_caches], judge=judge, headline=REJECTED)
        return all(c for *_, c in seen)

    # the table's hash once per stage in the default mode (every call with checks on)
    keep = agree_once(stage, f"{digest} {decls!r}", stage.has_caches, error, op, agreed)
    caches = stage.take_caches(keep)
    stage.shape_trust.begin(None if checks_enabled() else shape_key, keep)  # checks: every header read
    losses = execute(stage, table, m, inputs, targets, stage_kwargs or [{}] * m, caches, run_mode, decls)
    stage.keep_caches(caches)  # completed: the next call may keep them (agreed by every rank)
    stage.shape_trust.end(shape_key)
    return losses


def _data_error(stage: PipelineStage, m: int, inputs, targets, stage_kwargs, mode: RunMode) -> str | None:
    who = f"rank {stage.rank}" if stage.stages is None else f"stage {stage.rank}"  # a tp group's
    for chunk, name, xs, needed in (
        (0, "inputs_microbatches", inputs, True),
        (stage.num_chunks - 1, "targets_microbatches", targets, targets_needed(mode, targets)),
    ):
        if needed and stage.holds(chunk) and (not isinstance(xs, (list, tuple)) or len(xs) != m):
            got = len(xs) if isinstance(xs, (list, tuple)) else type(xs).__name__
            return f"{who} holds chunk {chunk} and needs {m} {name} (the schedule's M), got {got}"
    if stage.holds(0) and not all(isinstance(x, torch.Tensor) for x in inputs):
        return f"{who}: every input microbatch must be a tensor"
    if stage_kwargs is not None and (
        not isinstance(stage_kwargs, (list, tuple))
        or len(stage_kwargs) != m
        or not all(isinstance(k, dict) for k in stage_kwargs)
    ):
        return f"{who}: stage_kwargs must be None or {m} dicts (one per microbatch)"
    return stage.kwargs_error(stage_kwargs, who)
