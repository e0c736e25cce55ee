"""Alpha-beta times of collectives, with the nccl-tests bus-bandwidth factors.

A call of size ``n`` bytes (nccl-tests "size": the all-reduce buffer, the all-gather output,
the reduce-scatter input, the all-to-all send buffer) on ``R`` ranks takes
``steps x alpha + n x factor / bandwidth``: ring all-reduce ``2(R-1)`` steps and factor
``2(R-1)/R``; all-gather, reduce-scatter, all-to-all ``R-1`` and ``(R-1)/R``; send/recv 1 and 1.
The bandwidth is the intra-node one when the group fits in a node, else the NIC's.

An all-reduce whose group spans nodes may also run as NCCL's double binary tree (NCCL >= 2.4,
for all-reduce): a chain through the group's ``L`` ranks in each node and a binary tree over its
``K`` nodes, up (reduce) and down (broadcast), so ``2 ((L - 1) alpha_intra + ceil(log2 K)
alpha_inter)`` of latency and every byte through the NIC twice (``2 n / bandwidth``). NCCL's tuner
runs, per call, the algorithm its model predicts to be fastest (``NCCL_ALGO`` unset), and the
planner does the same: the cheaper of ring and tree. The tree wins where latency dominates (the
step's world all-reduces of one or two numbers over thousands of ranks: ``2 (R - 1)`` ring steps
of the NIC's alpha, 0.33 s at 16,384 ranks, against 0.3 ms on the tree); the ring where the bytes
dominate (its ``2 (R - 1) / R < 2``).

Source: Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication Operations in
MPICH" (2005); NVIDIA nccl-tests ``doc/PERFORMANCE.md`` (bus bandwidth); Jeaugey, "Massively
Scale Your Deep Learning Training with NCCL 2.4" (NVIDIA blog, 2019: double binary trees,
latency logarithmic in the nodes, chosen by NCCL's tuner by message size and scale).
"""

from __future__ import annotations

import math

from ..sharding import AXES, ParallelDims
from ._tp_rings import rings_exposed_seconds, stage_rings
from .cluster import Cluster
from .collectives import CommRow
from .model import ModelShape
from .options import StepOptions, resolve_options, stage_part, stage_tp

__all__ = ["bus_factor", "group_stride", "row_seconds", "tree_all_reduce_seconds", "tp_rings_exposed"]

_AXIS_DIMS = {
    "tp": ("tp",),
    "cp": ("cp_ring", "cp_ulysses"),
    "pp": ("pp",),
    "world": AXES,
    "dp": ("dp_replicate", "dp_shard", "cp_ring", "cp_ulysses"),
    "fsdp": ("dp_shard", "cp_ring", "cp_ulysses"),
    "ep": ("dp_shard", "cp_ring", "cp_ulysses", "tp"),
}


def bus_factor(op: str, ranks: int) -> tuple[float, int]:
    """``(bandwidth factor, latency steps)`` of ``op`` on ``ranks`` ranks (nccl-tests)."""
    if op in ("send", "recv"):
        return 1.0, 1
    if ranks <= 1:
        return 0.0, 0
    if op == "all_reduce":
        return 2.0 * (ranks - 1) / ranks, 2 * (ranks - 1)
    return (ranks - 1) / ranks, ranks - 1


def group_stride(dims: ParallelDims, axis: str, size: int) -> int:
    """Span in global ranks of one group of ``axis``: the innermost of its dims sets the stride
    (tp innermost: its ranks are adjacent)."""
    order = list(AXES)
    members = [d for d in _AXIS_DIMS.get(axis, AXES) if getattr(dims, d) > 1] or ["tp"]
    inner = max(order.index(d) for d in members)
    stride = 1
    for d in order[inner + 1 :]:
        stride *= getattr(dims, d)
    if axis == "ep":  # ep blocks are the innermost ep ranks of dp_shard x cp x tp
        return size
    return stride * size


def tree_all_reduce_seconds(calls: int, size: int, ranks: int, span: int, cluster: Cluster) -> float:
    """Seconds of ``calls`` all-reduces of ``size`` bytes in all on NCCL's double binary tree,
    for a group of ``ranks`` spread over ``span`` consecutive global ranks (pure; the module
    docstring). Only meaningful where the group spans nodes (``span > gpus_per_node``)."""
    local = max(1, min(ranks, cluster.gpus_per_node * ranks // span))  # the group's ranks per node
    nodes = -(-ranks // local)
    hops = (local - 1) * cluster.intra_latency_us + math.ceil(math.log2(nodes)) * cluster.inter_latency_us
    return calls * 2 * hops * 1e-6 + 2 * size / (cluster.inter_gbps * 1e9)


def row_seconds(row: CommRow, dims: ParallelDims, cluster: Cluster) -> float:
    """Alpha-beta seconds of every call of ``row`` (one rank's view); an all-reduce across nodes
    takes the cheaper of ring and tree, as NCCL's tuner does."""
    factor, steps = bus_factor(row.op, row.group_size)
    span = group_stride(dims, row.axis, row.group_size)
    inside = span <= cluster.gpus_per_node
    bandwidth = (cluster.intra_gbps if inside else cluster.inter_gbps) * 1e9
    alpha = (cluster.intra_latency_us if inside else cluster.inter_latency_us) * 1e-6
    size = max(row.bytes_sent, row.bytes_received)
    if row.op == "recv":
        return 0.0  # the matching send carries the time
    ring = row.count * steps * alpha + size * factor / bandwidth
    if row.op != "all_reduce" or inside or row.group_size <= 1:
        return ring
    return min(ring, tree_all_reduce_seconds(row.count, size, row.group_size, span, cluster))


def tp_rings_exposed(shape: ModelShape, dims: ParallelDims, opts: StepOptions, cluster: Cluster, stage: int) -> float:
    """Seconds of pipeline stage ``stage``'s async-TP rings on the critical path of a step: one
    block's transfer (one ``send`` of ``[T / t, H]``, alpha-beta as :func:`row_seconds`) against
    one block's matmul at the cluster's sustained rate (:func:`._tp_rings.rings_exposed_seconds`).
    0 without sequence parallelism or with one tp rank."""
    opts = resolve_options(shape, dims, opts)
    t = stage_tp(dims, stage)
    if t <= 1 or not opts.sequence_parallel or not opts.async_tp:
        return 0.0
    M = opts.microbatches
    T = opts.global_batch // (dims.dp * M) * (opts.seq_len // dims.cp)
    layers, _, last = stage_part(shape, dims, opts, stage)
    rings = stage_rings(shape, opts, layers, last, T, M, t, dims.ep)
    step = row_seconds(
        CommRow("tp", "send", "all_gather_matmul", "forward", t, 1, T // t * shape.hidden * opts.elem, 0), dims, cluster
    )
    return rings_exposed_seconds(rings, t, step, cluster.peak_tflops * 1e12 * cluster.efficiency)
