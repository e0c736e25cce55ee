"""The trainer's step options the planner needs, and the trainer's limits for a model and layout.

Pure functions of metadata (no process group), so a bad layout fails before anything runs.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any

from ..errors import ShardkitError
from ..pipeline_parallel.chunked import chunk_layers
from ..pipeline_parallel.schedules import gpipe_schedule, one_f_one_b_schedule
from ..pipeline_parallel.steps import global_chunk
from ..pipeline_parallel.tables import SCHEDULES as SCHEDULE_TABLES
from ..sharding import ParallelDims
from .model import ModelShape
from .rules import decoder_layout_rule, pp_tp_chunks_rule, schedule_rule, sequence_parallel_default

__all__ = [
    "StepOptions",
    "DTYPE_BYTES",
    "resolve_options",
    "fsdp_once_per_step",
    "stage_part",
    "check_layout",
    "hooked_params",
    "expert_fsdp_ranks",
    "stage_tp",
    "rank_stage",
    "zero_buckets",
]

DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2}


def __getattr__(name: str) -> Any:
    """``SCHEDULES`` (1F1B and GPipe as ``(p, m) -> Action table``), deprecated for one release:
    the registry :data:`shardkit.pipeline_parallel.tables.SCHEDULES` names every schedule."""
    if name != "SCHEDULES":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        "shardkit.plan.options.SCHEDULES is deprecated; use shardkit.pipeline_parallel.tables.SCHEDULES "
        "(every schedule, with schedule_table(name, p, v, m))",
        DeprecationWarning,
        stacklevel=2,
    )
    return {"1f1b": one_f_one_b_schedule, "gpipe": gpipe_schedule}


@dataclass(frozen=True)
class StepOptions:
    """The trainer options of one step that change its collectives.

    Attributes:
        seq_len: S tokens per sequence.
        global_batch: sequences per step (all data-parallel ranks together).
        microbatches: M per data-parallel rank (pipeline microbatches or gradient accumulation).
        dtype: ``float32``, ``bfloat16`` or ``float64`` (parameters and activations).
        sequence_parallel: Megatron-SP with tp (None: on for dense models with tp > 1, as the
            trainer's default; MoE models take it when asked).
        loss_parallel: vocab-parallel loss (logits never gathered).
        schedule: the pipeline schedule, a key of
            :data:`shardkit.pipeline_parallel.tables.SCHEDULES` (with ``pp`` 1 the trainer
            accumulates F B F B ... whatever it says).
        activation_checkpoint: ``none``, ``full``, ``selective`` or ``selective:N`` (``shardkit train --ac``): what
            each decoder block keeps for backward (:mod:`.activations`).
        virtual_stages: chunks per pipeline rank (``v``; :func:`.rules.schedule_rule`).
        zero: 0 (off), 1 or 2: ZeRO over the data ranks (``shardkit train --zero``,
            :class:`~shardkit.data_parallel.ZeroSync`); not with ``dp_shard > 1``.
        sp_activation: with sequence parallelism, what the column-parallel projections keep:
            ``"shard"`` (the trainer's default; gathered again in backward) or ``"gathered"``
            (:func:`shardkit.parallelize.parallelize`).
        async_tp: with sequence parallelism, the trainer's ``--async-tp``: SP's gathers and
            reduce-scatters as collective-matmul rings (:mod:`._tp_rings`).
    """

    seq_len: int = 4096
    global_batch: int = 1024
    microbatches: int = 1
    dtype: str = "bfloat16"
    sequence_parallel: bool | None = None
    loss_parallel: bool = False
    schedule: str = "1f1b"
    activation_checkpoint: str = "none"
    virtual_stages: int = 1
    zero: int = 0
    sp_activation: str = "shard"
    async_tp: bool = False

    @property
    def elem(self) -> int:
        """Bytes per element of ``dtype``."""
        return DTYPE_BYTES[self.dtype]


def resolve_options(shape: ModelShape, dims: ParallelDims, opts: StepOptions) -> StepOptions:
    """``opts`` with ``sequence_parallel`` decided as the trainer does
    (:func:`.rules.sequence_parallel_default`)."""
    if opts.sequence_parallel is None:
        opts = replace(opts, sequence_parallel=sequence_parallel_default(shape.experts > 0, dims.tp, dims.pp_tp))
    return opts


def check_layout(shape: ModelShape, dims: ParallelDims, opts: StepOptions) -> None:
    """The trainer's limits for this model and layout (pure): the rules of :mod:`.rules`, which
    ``shardkit train`` checks too, so the planner ranks exactly the layouts the trainer runs.

    Raises:
        ShardkitError: ``plan:`` and the first refusal of :func:`.rules.decoder_layout_rule`
            (batch not divisible by dp x microbatches, a cp rank without a token, more tp ranks
            than query heads, spatial layouts, sequence parallelism with ``pp_tp``, ...), or of
            :func:`.rules.schedule_rule` (the schedule, its virtual stages and microbatches), or
            of :func:`.rules.pp_tp_chunks_rule` (``pp_tp`` stages hold one chunk).
    """
    why = decoder_layout_rule(
        dims,
        seq_len=opts.seq_len,
        global_batch=opts.global_batch,
        microbatches=opts.microbatches,
        sequence_parallel=bool(resolve_options(shape, dims, opts).sequence_parallel),
        heads=shape.heads,
        kv_heads=shape.kv_heads,
        layers=shape.layers,
        experts=shape.experts,
    ) or schedule_rule(opts.schedule, dims.pp, opts.virtual_stages, opts.microbatches, shape.layers)
    why = why or pp_tp_chunks_rule(dims.pp_tp, opts.schedule, opts.virtual_stages)
    if why is None and opts.zero not in (0, 1, 2):
        why = f"zero must be 0, 1 or 2, got {opts.zero!r}"
    if why is None and opts.zero and dims.dp_shard > 1:
        why = f"zero {opts.zero} with dp_shard {dims.dp_shard}: FSDP2 already shards the optimizer state (ZeRO-3)"
    if why is not None:
        raise ShardkitError(f"plan: {dims.describe()}: {why}")


def stage_tp(dims: ParallelDims, stage: int) -> int:
    """The tp size of pipeline stage ``stage`` (``pp_tp[stage]`` for stages of different tp sizes)."""
    return dims.pp_tp[stage] if dims.pp_tp is not None else dims.tp


def expert_fsdp_ranks(dims: ParallelDims) -> int:
    """The ``edp`` ranks FSDP2 shards each expert weight over (``dp_shard > 1``, ``ep > 1``), else 1
    (experts whole on their ep rank; :func:`shardkit.data_parallel.apply_fsdp`)."""
    if dims.dp_shard == 1 or dims.ep == 1:
        return 1
    return dims.dp_replicate * dims.ep_borrow // dims.ep


def rank_stage(dims: ParallelDims, rank: int) -> tuple[int, int]:
    """``(pipeline stage, tp rank)`` of global rank ``rank`` (pp outermost, tp innermost;
    ``pp_tp``: replica-major, ``rank = d x sum(pp_tp) + offset_s + i``)."""
    if dims.pp_tp is None:
        return rank // (dims.product // dims.pp), rank % dims.tp
    offset = rank % sum(dims.pp_tp)
    for stage, t in enumerate(dims.pp_tp):
        if offset < t:
            return stage, offset
        offset -= t
    raise AssertionError("unreachable: offset < sum(pp_tp)")


def stage_part(shape: ModelShape, dims: ParallelDims, opts: StepOptions, stage: int) -> tuple[list[int], bool, bool]:
    """What a rank of pipeline stage ``stage`` holds: its decoder layers, whether it holds the
    embedding (the first chunk) and whether it holds the final norm and head (the last chunk).

    One chunk per rank: the stage's layers (:meth:`~.model.ModelShape.stage_layers`), the
    embedding on stage 0, the head on the last. ``v`` chunks per rank: the layers of its chunks
    (:func:`~shardkit.pipeline_parallel.chunked.chunk_layers`) under the schedule's placement;
    a V holds both ends on stage 0 and none elsewhere."""
    v = opts.virtual_stages if dims.pp > 1 else 1
    spec = SCHEDULE_TABLES.get(opts.schedule)
    if v == 1 or spec is None or dims.pp_tp is not None:
        return list(shape.stage_layers(dims.pp, stage)), stage == 0, stage == dims.pp - 1
    ranges = chunk_layers(shape.layers, dims.pp, v, spec.placement, stage)
    chunks = {global_chunk(spec.placement, stage, c, dims.pp) for c in range(v)}
    return [i for r in ranges for i in r], 0 in chunks, dims.pp * v - 1 in chunks


def hooked_params(shape: ModelShape, dims: ParallelDims, opts: StepOptions, stage: int) -> int:
    """Parameters with a sum-over-tp gradient hook (FSDP2 leaves them to the dense all-reduce):
    the norms with SP, Qwen3's q/k norms, replicated key/value heads, and with SP the routers
    of expert-parallel MoE blocks (they run on the local sequence block)."""
    tp = stage_tp(dims, stage)
    if tp == 1:
        return 0
    layers, _, last = stage_part(shape, dims, opts, stage)
    total = 0
    if opts.sequence_parallel:
        total += 2 * shape.hidden * len(layers) + (shape.hidden if last else 0)
        if dims.ep > 1:
            total += shape.experts * shape.hidden * sum(shape.is_moe_layer(i) for i in layers)
    if shape.family in ("qwen3", "qwen3_moe"):
        total += 2 * shape.head_dim * len(layers)
    if shape.kv_heads < tp and not shape.mla:
        total += 2 * shape.head_dim * shape.hidden * len(layers)
    return total


def fsdp_once_per_step(dims: ParallelDims, opts: StepOptions) -> bool:
    """Whether FSDP2 gathers and reduces each group once per step: with ``M > 1`` microbatches
    (:func:`shardkit.data_parallel.set_microbatch` for accumulation and one chunk per rank; the
    chunked runner's per-group controls, :mod:`shardkit.pipeline_parallel._fsdp_steps`), and
    under an I/W-split schedule, whose ``I`` must see the parameters its forward used."""
    spec = SCHEDULE_TABLES.get(opts.schedule)
    split = dims.pp > 1 and spec is not None and spec.split_backward
    return opts.microbatches > 1 or split


def zero_buckets(shape: ModelShape, dims: ParallelDims, opts: StepOptions, stage: int) -> list[tuple[int, int]]:
    """``(elements, ranks)`` of each flat ZeRO bucket of a rank of ``stage`` (pure): its dense
    parameters over ``dp_replicate x cp``, its expert weights (``ep > 1``) over ``edp``; each
    padded to a multiple of its ranks, as :class:`~shardkit.data_parallel.ZeroSync` lays them out.
    Empty without ``opts.zero``."""
    if not opts.zero:
        return []
    dense, expert = shape.rank_params(stage_tp(dims, stage), dims.ep, part=stage_part(shape, dims, opts, stage))
    if dims.ep == 1:
        dense, expert = dense + expert, 0
    edp = dims.dp_replicate * dims.ep_borrow // dims.ep
    out = []
    for n, r in ((dense, dims.dp * dims.cp), (expert, edp)):
        if n:
            out.append((-(-n // r) * r, r))
    return out
