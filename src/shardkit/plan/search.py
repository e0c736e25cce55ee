"""One layout's predicted step (:func:`estimate_step`) and every layout ranked (:func:`plan_layouts`).

Step time = the pipeline schedule's makespan (:func:`.pipeline.pipeline_cost`: its bubble and
the P2P transfers its dependencies put on the critical path, :mod:`.p2p_timeline`, with
``pp_tp`` at the pace of the slowest stage) + the other collectives a rank waits for, as the
runtime issues them (:mod:`.overlap`: tp, cp, ep, the pp check, ``pp_tp`` broadcasts and the
data-parallel reduction after the last backward in full; FSDP2's per-layer gathers and
reduce-scatters where they outlast the layer they are prefetched behind). The search ranks
schedules and virtual stages like the other layout dimensions.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..errors import ShardkitError
from ..pipeline_parallel.tables import SCHEDULES
from ..sharding import ParallelDims
from .activations import recompute_flops_per_token
from .cluster import Cluster
from .collectives import HEADER_BYTES, CommRow, step_collectives
from .memory import memory_per_rank
from .model import ModelShape
from .moe_time import grouped_gemm_extra_flops
from .options import StepOptions, check_layout, resolve_options
from .overlap import exposed_seconds
from .pipeline import pipeline_cost
from .timing import group_stride, row_seconds, tp_rings_exposed

__all__ = ["StepEstimate", "estimate_step", "plan_layouts", "enumerate_layouts", "schedule_choices"]

SEARCHED_V = (2, 4, 8)  # virtual stages the search tries where a schedule takes more than one

_CRITICAL = ("tp", "cp", "ep", "pp", "world")


@dataclass(frozen=True)
class StepEstimate:
    """The predicted cost of one training step of one layout.

    Attributes:
        dims: the layout. options: its step options.
        rows: ``(CommRow, seconds)`` of the busiest stage (shardkit's and FSDP2's collectives).
        compute_s: matmul and attention time of one rank, seconds (no bubble; with activation
            checkpointing, the recompute included; the routed experts as grouped GEMMs, each
            expert's rows in whole tiles: :mod:`.moe_time`).
        bubble: the idle fraction of the pipeline schedule's makespan (1F1B and GPipe
            ``(pp - 1) / (M + pp - 1)`` without P2P time; :func:`.pipeline.pipeline_cost`).
        comm_s: exposed communication seconds besides the pipeline's P2P (in its makespan;
            :func:`.overlap.exposed_seconds`).
        step_s: predicted seconds per step.
        memory: bytes per rank of the fullest stage (:func:`~shardkit.plan.memory.memory_per_rank`).
        fits: ``memory["total"]`` within the cluster's GPU memory.
        tokens_per_s: global tokens per second.
        mfu: model FLOPs utilisation ``flops / (step_s x gpus x peak)``.
    """

    dims: ParallelDims
    options: StepOptions
    rows: tuple[tuple[CommRow, float], ...]
    compute_s: float
    bubble: float
    comm_s: float
    step_s: float
    memory: dict[str, float]
    fits: bool
    tokens_per_s: float
    mfu: float

    def axis_seconds(self) -> dict[str, float]:
        """Communication seconds per axis (before overlap)."""
        out: dict[str, float] = {}
        for row, s in self.rows:
            out[row.axis] = out.get(row.axis, 0.0) + s
        return out


def estimate_step(shape: ModelShape, dims: ParallelDims, options: StepOptions, cluster: Cluster) -> StepEstimate:
    """Predict one training step of ``shape`` on ``cluster`` with layout ``dims``.

    Args:
        shape: the model (:meth:`ModelShape.from_config`).
        dims: the layout; its product must be ``cluster.gpus``.
        options: sequence length, global batch (sequences), microbatches per dp rank, dtype,
            sequence / loss parallelism, the pipeline schedule and its virtual stages.
        cluster: the machines.

    Returns:
        :class:`StepEstimate` (the busiest of the first, a middle and the last pipeline stage).

    Raises:
        ShardkitError: the layout does not match the cluster's GPU count, or the trainer refuses it.
    """
    if dims.product != cluster.gpus:
        raise ShardkitError(
            f"estimate_step: {dims.describe()} uses {dims.product} GPUs, the cluster has {cluster.gpus}"
        )
    check_layout(shape, dims, options)
    worst: tuple[float, list[tuple[CommRow, float]], float, int] | None = None
    memory: dict[str, float] = {}
    # embedding, a middle (MoE) stage, lm_head; every stage when their tp sizes differ (pp_tp)
    stages = range(dims.pp) if dims.pp_tp is not None else sorted({0, dims.pp // 2, dims.pp - 1})
    # the schedule changes a stage's collectives only through FSDP2's root gathers
    comm_opts = options if dims.dp_shard > 1 else replace(options, schedule="1f1b", virtual_stages=1)
    for stage in stages:
        critical, timed, overlappable = _stage_comm(shape, dims, comm_opts, cluster, stage)
        if worst is None or critical + overlappable > worst[0] + worst[2]:
            worst = (critical, timed, overlappable, stage)
        mem = memory_per_rank(shape, dims, options, stage)
        if mem["total"] > memory.get("total", -1.0):
            memory = mem
    assert worst is not None
    timed = worst[1]  # the busiest stage (all its communication)
    tokens = options.global_batch * options.seq_len
    flops = shape.flops_per_token(options.seq_len) * tokens
    # the recompute of checkpointed blocks is spread over the steps like the rest of the work
    # (exact for the 1F1B-form makespans, (m + p - 1)(F + B) with B growing by the recompute)
    work = flops + recompute_flops_per_token(shape, options.activation_checkpoint, options.seq_len) * tokens
    # the routed experts run as grouped GEMMs: each expert's rows in whole tiles (.moe_time)
    work += grouped_gemm_extra_flops(shape, dims, options) * tokens
    compute = work / cluster.gpus / (cluster.peak_tflops * 1e12 * cluster.efficiency)
    if dims.pp_tp is not None:  # the slowest stage sets the pace: its layers over its tp ranks
        share = max(len(shape.stage_layers(dims.pp, s)) / (shape.layers * t) for s, t in enumerate(dims.pp_tp))
        compute = work * share / dims.dp / (cluster.peak_tflops * 1e12 * cluster.efficiency)
    M, v = options.microbatches, options.virtual_stages if dims.pp > 1 else 1
    pipe = pipeline_cost(
        options.schedule, dims.pp, v, M, compute / (3 * M * v), _p2p_seconds(shape, dims, options, cluster)
    )
    # one decoder layer's forward on one microbatch: what FSDP2's prefetch hides a layer's gather behind
    layer_forward = compute / (3 * M) / max(1.0, shape.layers / dims.pp)
    rings = tp_rings_exposed(shape, dims, comm_opts, cluster, worst[3]) if options.async_tp else 0.0
    exposed = exposed_seconds(timed, layer_forward, rings)
    step = pipe.makespan + exposed
    fits = memory["total"] <= cluster.gpu_memory_gib * 2**30
    mfu = flops / (step * cluster.gpus * cluster.peak_tflops * 1e12)
    return StepEstimate(
        dims, options, tuple(timed), compute, pipe.bubble, exposed, step, memory, fits, tokens / step, mfu
    )


@functools.lru_cache(maxsize=1024)  # plan_layouts asks once per schedule of a layout
def _stage_comm(
    shape: ModelShape, dims: ParallelDims, options: StepOptions, cluster: Cluster, stage: int
) -> tuple[float, list[tuple[CommRow, float]], float]:
    """A stage's (critical seconds, timed rows, overlappable seconds); P2P is the schedule's."""
    timed = [(r, row_seconds(r, dims, cluster)) for r in step_collectives(shape, dims, options, stage)]
    critical = sum(s for r, s in timed if r.axis in _CRITICAL and not _p2p(r))
    overlappable = sum(s for r, s in timed if r.axis not in _CRITICAL)
    return critical, timed, overlappable


def _p2p(row: CommRow) -> bool:
    """A pipeline transfer (its time is in the schedule's makespan)."""
    return row.axis == "pp" and row.op in ("send", "recv")


def _p2p_seconds(shape: ModelShape, dims: ParallelDims, options: StepOptions, cluster: Cluster) -> float:
    """One P2P transfer of a microbatch's hidden states with its header, alpha-beta, on NVLink
    when the pipeline's ranks share a node, else on the NIC: ``[b, S / cp, H]``, or with sequence
    parallelism each tp rank's block ``[b, S / (cp tp), H]`` (the fullest rank's; the tp ranks
    send in parallel, each to its peer: :mod:`.collectives`' pp rows)."""
    if dims.pp == 1:
        return 0.0
    b = options.global_batch // (dims.dp * options.microbatches)
    S = options.seq_len // dims.cp
    if resolve_options(shape, dims, options).sequence_parallel and dims.tp > 1 and dims.pp_tp is None:
        S = -(-S // dims.tp)
    size = b * S * shape.hidden * options.elem + HEADER_BYTES
    inside = group_stride(dims, "pp", dims.pp) <= cluster.gpus_per_node
    gbps, alpha_us = (
        (cluster.intra_gbps, cluster.intra_latency_us) if inside else (cluster.inter_gbps, cluster.inter_latency_us)
    )
    return alpha_us * 1e-6 + size / (gbps * 1e9)


def schedule_choices(schedule: str | None = None, v: int | None = None) -> list[tuple[str, int]]:
    """The ``(schedule, virtual stages)`` pairs the search tries where ``pp > 1``: every schedule
    (or ``schedule``) at every ``v`` it accepts among 1, 2 and :data:`SEARCHED_V` (or at ``v``).
    An unknown name or a ``v`` it refuses is kept: :func:`.rules.schedule_rule` refuses it per
    layout (with the layers and microbatch rules), naming the limit."""
    names = list(SCHEDULES) if schedule is None else [schedule]
    out = []
    for name in names:
        spec = SCHEDULES.get(name)
        if v is not None or spec is None:
            out.append((name, v or 1))
            continue
        out += [(name, x) for x in sorted({1, 2, *SEARCHED_V}) if spec.v_min <= x <= (spec.v_max or x)]
    return out


def _divisors(n: int, limit: int | None = None) -> list[int]:
    return [d for d in range(1, (limit or n) + 1) if n % d == 0]


def enumerate_layouts(
    shape: ModelShape,
    gpus: int,
    gpus_per_node: int,
    options: StepOptions,
    max_cp: int = 32,
    schedules: Sequence[tuple[str, int]] | None = None,
) -> Iterator[tuple[ParallelDims, StepOptions]]:
    """Every layout of ``gpus`` the trainer accepts for ``shape`` (ParallelDims and
    :func:`~shardkit.plan.collectives.check_layout` decide), with one sequence per microbatch,
    under every ``(schedule, virtual stages)`` of ``schedules`` (None: :func:`schedule_choices`;
    with ``pp`` 1 only plain accumulation)."""
    moe = shape.experts > 0
    for tp in _divisors(gpus, gpus_per_node):
        for pp in _divisors(gpus // tp, shape.layers):
            for ring in _divisors(gpus // (tp * pp), max_cp):
                for uly in _divisors(gpus // (tp * pp * ring), max_cp // ring):
                    dp = gpus // (tp * pp * ring * uly)
                    if options.global_batch % dp:
                        continue
                    m = options.global_batch // dp
                    for shard in _divisors(dp):
                        for ep in _divisors(shape.experts) if moe else [1]:
                            try:
                                dims = ParallelDims(
                                    dp_replicate=dp // shard,
                                    dp_shard=shard,
                                    pp=pp,
                                    cp_ring=ring,
                                    cp_ulysses=uly,
                                    tp=tp,
                                    ep=ep,
                                    world_size=gpus,
                                )
                            except ShardkitError:
                                continue
                            pairs = schedule_choices() if schedules is None else schedules
                            for name, v in pairs if pp > 1 else [("1f1b", 1)]:
                                opts = replace(options, microbatches=m, schedule=name, virtual_stages=v)
                                try:
                                    check_layout(shape, dims, opts)
                                except ShardkitError:
                                    continue
                                yield dims, opts


def plan_layouts(
    config: Any,
    cluster: Cluster,
    options: StepOptions,
    top: int = 10,
    schedules: Sequence[tuple[str, int]] | None = None,
) -> list[StepEstimate]:
    """Rank every valid layout of ``config`` on ``cluster`` by predicted step time.

    Args:
        config: a transformers config, a ``config.json`` dict or path, or a :class:`ModelShape`.
        cluster: the machines (``cluster.gpus`` is the world size).
        options: sequence length, global batch, dtype (microbatches are set per layout: one
            sequence each, ``global_batch / dp``; the schedule and virtual stages by ``schedules``).
        top: how many to return.
        schedules: the ``(schedule, virtual stages)`` pairs to rank (None: every schedule at the
            virtual stages of :func:`schedule_choices`).

    Returns:
        The ``top`` fastest layouts that fit in memory, fastest first.

    Raises:
        ShardkitError: an unreadable or unsupported config; no layout fits (the message gives
            the smallest memory found).
    """
    shape = config if isinstance(config, ModelShape) else ModelShape.from_config(config)
    fitting: list[StepEstimate] = []
    smallest: StepEstimate | None = None
    for dims, opts in enumerate_layouts(shape, cluster.gpus, cluster.gpus_per_node, options, schedules=schedules):
        est = estimate_step(shape, dims, opts, cluster)
        if est.fits:
            fitting.append(est)
        elif smallest is None or est.memory["total"] < smallest.memory["total"]:
            smallest = est
    if not fitting:
        detail = (
            "no layout is valid"
            if smallest is None
            else (f"the smallest needs {smallest.memory['total'] / 2**30:.1f} GiB per GPU ({smallest.dims.describe()})")
        )
        raise ShardkitError(
            f"plan_layouts: no layout fits in {cluster.gpu_memory_gib} GiB on {cluster.gpus} GPUs: {detail}"
        )
    fitting.sort(key=lambda est: est.step_s)
    return fitting[:top]
