"""One layout's predicted step (:func:`estimate_step`) and every layout ranked (:func:`plan_layouts`).

Step time = compute x (M + pp - 1) / M (the bubble of 1F1B and GPipe alike, Narayanan et al.
2021; with ``pp_tp`` the compute of the slowest stage) + the
collectives on the critical path (tp, cp, ep, pp: they wait for their inputs) + the part of the
data-parallel and FSDP2 traffic that backward (two thirds of the compute) cannot hide.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from ..errors import ShardkitError
from ..sharding import ParallelDims
from .cluster import Cluster
from .collectives import CommRow, step_collectives
from .memory import memory_per_rank
from .model import ModelShape
from .options import StepOptions, check_layout
from .timing import row_seconds

__all__ = ["StepEstimate", "estimate_step", "plan_layouts", "enumerate_layouts"]

_CRITICAL = ("tp", "cp", "ep", "pp", "world")


@dataclass(frozen=True)
class StepEstimate:
    """The predicted cost of one training step of one layout.

    Attributes:
        dims: the layout. options: its step options.
        rows: ``(CommRow, seconds)`` of the busiest stage (shardkit's and FSDP2's collectives).
        compute_s: matmul and attention time of one rank, seconds (no bubble).
        bubble: the pipeline bubble fraction ``(pp - 1) / (M + pp - 1)`` (1F1B and GPipe).
        comm_s: exposed communication seconds.
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
            sequence / loss parallelism.
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
    worst: tuple[float, list[tuple[CommRow, float]], float] | None = None
    memory: dict[str, float] = {}
    # embedding, a middle (MoE) stage, lm_head; every stage when their tp sizes differ (pp_tp)
    stages = range(dims.pp) if dims.pp_tp is not None else sorted({0, dims.pp // 2, dims.pp - 1})
    for stage in stages:
        rows = step_collectives(shape, dims, options, stage)
        timed = [(r, row_seconds(r, dims, cluster)) for r in rows]
        critical = sum(s for r, s in timed if r.axis in _CRITICAL)
        overlappable = sum(s for r, s in timed if r.axis not in _CRITICAL)
        if worst is None or critical + overlappable > worst[0] + worst[2]:
            worst = (critical, timed, overlappable)
        mem = memory_per_rank(shape, dims, options, stage)
        if mem["total"] > memory.get("total", -1.0):
            memory = mem
    assert worst is not None
    critical, timed, overlappable = worst
    tokens = options.global_batch * options.seq_len
    flops = shape.flops_per_token(options.seq_len) * tokens
    compute = flops / cluster.gpus / (cluster.peak_tflops * 1e12 * cluster.efficiency)
    if dims.pp_tp is not None:  # the slowest stage sets the pace: its layers over its tp ranks
        share = max(len(shape.stage_layers(dims.pp, s)) / (shape.layers * t) for s, t in enumerate(dims.pp_tp))
        compute = flops * share / dims.dp / (cluster.peak_tflops * 1e12 * cluster.efficiency)
    M, p = options.microbatches, dims.pp
    bubble = (p - 1) / (M + p - 1)  # GPipe and 1F1B alike (1F1B saves memory, not time)
    exposed = critical + max(0.0, overlappable - compute * 2 / 3)
    step = compute * (M + p - 1) / M + exposed
    fits = memory["total"] <= cluster.gpu_memory_gib * 2**30
    mfu = flops / (step * cluster.gpus * cluster.peak_tflops * 1e12)
    return StepEstimate(dims, options, tuple(timed), compute, bubble, exposed, step, memory, fits, tokens / step, mfu)


def _divisors(n: int, limit: int | None = None) -> list[int]:
    return [d for d in range(1, (limit or n) + 1) if n % d == 0]


def enumerate_layouts(
    shape: ModelShape, gpus: int, gpus_per_node: int, options: StepOptions, max_cp: int = 32
) -> Iterator[tuple[ParallelDims, StepOptions]]:
    """Every layout of ``gpus`` the trainer accepts for ``shape`` (ParallelDims and
    :func:`~shardkit.plan.collectives.check_layout` decide), with one sequence per microbatch."""
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
                                opts = replace(options, microbatches=m)
                                check_layout(shape, dims, opts)
                            except ShardkitError:
                                continue
                            yield dims, opts


def plan_layouts(config: Any, cluster: Cluster, options: StepOptions, top: int = 10) -> list[StepEstimate]:
    """Rank every valid layout of ``config`` on ``cluster`` by predicted step time.

    Args:
        config: a transformers config, a ``config.json`` dict or path, or a :class:`ModelShape`.
        cluster: the machines (``cluster.gpus`` is the world size).
        options: sequence length, global batch, dtype (microbatches are set per layout: one
            sequence each, ``global_batch / dp``).
        top: how many to return.

    Returns:
        The ``top`` fastest layouts that fit in memory, fastest first.

    Raises:
        ShardkitError: an unreadable or unsupported config; no layout fits (the message gives
            the smallest memory found).
    """
    shape = config if isinstance(config, ModelShape) else ModelShape.from_config(config)
    fitting: list[StepEstimate] = []
    smallest: StepEstimate | None = None
    for dims, opts in enumerate_layouts(shape, cluster.gpus, cluster.gpus_per_node, options):
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
