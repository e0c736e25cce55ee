"""Cluster descriptions for the planner, and presets for H100, H800 and H200 nodes."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ShardkitError
from .peaks import gpu_peak

__all__ = ["Cluster", "CLUSTERS"]


@dataclass(frozen=True)
class Cluster:
    """A homogeneous GPU cluster.

    Attributes:
        gpus: GPUs in the job.
        gpus_per_node: GPUs sharing the intra-node fabric (NVLink).
        intra_gbps: per-GPU intra-node bandwidth, one direction, GB/s (nccl-tests bus bandwidth scale).
        inter_gbps: per-GPU inter-node bandwidth (its NIC), one direction, GB/s.
        intra_latency_us: alpha of one intra-node message step, microseconds.
        inter_latency_us: alpha of one inter-node message step, microseconds.
        gpu_memory_gib: usable memory per GPU, GiB.
        peak_tflops: dense bf16 peak per GPU, TFLOP/s.
        efficiency: fraction of the peak the matmuls reach (model FLOPs utilisation of compute).
        name: a label.
        host_gbps: device-to-host copy into pinned memory per GPU, GB/s (an async save's
            staging copy, :mod:`.saving`).
        checkpoint_gbps: checkpoint write bandwidth per GPU, GB/s: the file system's
            aggregate write bandwidth over the job's GPUs (a save's write, :mod:`.saving`).

    Raises:
        ShardkitError: a non-positive figure, or ``gpus`` not a multiple of ``gpus_per_node``
            when larger than one node.
    """

    gpus: int
    gpus_per_node: int = 8
    intra_gbps: float = 450.0
    inter_gbps: float = 50.0
    intra_latency_us: float = 3.0
    inter_latency_us: float = 10.0
    gpu_memory_gib: float = 80.0
    peak_tflops: float = 989.0
    efficiency: float = 0.5
    name: str = "custom"
    # Save figures, assumptions to replace with measurements: a PCIe Gen5 x16 link carries 64 GB/s
    # per direction, about half of it reached by pinned copies with two GPUs per host uplink; a
    # parallel file system's aggregate write of ~1-2 TB/s spread over 1000+ GPUs is ~1 GB/s each.
    host_gbps: float = 25.0
    checkpoint_gbps: float = 1.0

    def __post_init__(self) -> None:
        for field in (
            "gpus",
            "gpus_per_node",
            "intra_gbps",
            "inter_gbps",
            "gpu_memory_gib",
            "peak_tflops",
            "efficiency",
            "host_gbps",
            "checkpoint_gbps",
        ):
            if not getattr(self, field) > 0:
                raise ShardkitError(f"Cluster: {field} must be > 0, got {getattr(self, field)!r}")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ShardkitError(f"Cluster: gpus={self.gpus} is not a multiple of gpus_per_node={self.gpus_per_node}")


def _bf16(device_name: str) -> float:
    """The dense bf16 peak of a preset's GPU, from the one table of peaks (plan/peaks.py)."""
    row = gpu_peak(device_name)
    assert row is not None, device_name  # the presets name GPUs of the table
    return row.bf16


# Figures and sources:
# H100 SXM (DGX/HGX H100): NVLink 4 at 900 GB/s bidirectional = 450 GB/s per direction per GPU;
#   one 400 Gb/s ConnectX-7 NIC per GPU = 50 GB/s; 80 GB HBM3; 989 TFLOP/s dense BF16
#   (NVIDIA H100 datasheet; DGX H100 user guide; every GPU's peaks, with sources: plan/peaks.py).
#   Latencies: NCCL's typical per-step alpha, a few microseconds on NVLink, ~10 on InfiniBand
#   (nccl-tests small-message times).
# H800 SXM (DeepSeek-V3 technical report, section 3.1): NVLink 400 GB/s bidirectional, of which
#   about 160 GB/s achievable per GPU; 8 x 400 Gb/s InfiniBand per node = 50 GB/s per GPU;
#   80 GB; the same 989 TFLOP/s BF16 as the H100 SXM.
# H200 SXM (NVIDIA H200 datasheet): the H100's chip, NVLink and 989 TFLOP/s dense BF16, with
#   141 GB HBM3e at 4.8 TB/s: 131 GiB less the same ~4 GiB.
# Usable memory: 80 GB = 74.5 GiB less ~4 GiB for the CUDA context, NCCL and fragmentation.
CLUSTERS: dict[str, dict[str, float | str]] = {
    "h100": dict(
        gpus_per_node=8,
        intra_gbps=450.0,
        inter_gbps=50.0,
        intra_latency_us=3.0,
        inter_latency_us=10.0,
        gpu_memory_gib=70.0,
        peak_tflops=_bf16("NVIDIA H100 80GB HBM3"),
        name="H100 SXM, NVLink 4 + 400G IB per GPU",
    ),
    "h800": dict(
        gpus_per_node=8,
        intra_gbps=160.0,
        inter_gbps=50.0,
        intra_latency_us=3.0,
        inter_latency_us=10.0,
        gpu_memory_gib=70.0,
        peak_tflops=_bf16("NVIDIA H800"),
        name="H800 SXM, NVLink 160 GB/s + 400G IB per GPU",
    ),
}
CLUSTERS["h200"] = CLUSTERS["h100"] | dict(
    gpu_memory_gib=127.0, peak_tflops=_bf16("NVIDIA H200"), name="H200 SXM, NVLink 4 + 400G IB per GPU"
)
