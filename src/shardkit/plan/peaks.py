"""Dense peak tensor-core throughput of one GPU, per dtype: the denominator of MFU.

Pure data and a name lookup (no torch): the trainer's summary (``train/metrics.py``,
:func:`~shardkit.train.metrics.peak_flops`) matches ``torch.cuda.get_device_name()`` against
:data:`GPU_PEAKS`, and the planner's presets (:data:`~shardkit.plan.cluster.CLUSTERS`) take
their ``peak_tflops`` from it, so the two never disagree.

Every figure is *dense* (no 2:4 structured sparsity). NVIDIA's datasheets print the sparse
figure with a footnote ("with sparsity"); dense is half of it. AMD's MI300X datasheet prints
both. The sources are named row by row below.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GpuPeak", "GPU_PEAKS", "gpu_peak"]


@dataclass(frozen=True)
class GpuPeak:
    """One GPU model's dense peaks.

    Attributes:
        key: short name (``"h100"``), also the planner preset's key where one exists.
        label: what the summary prints (``"H100 SXM"``).
        match: substrings of ``torch.cuda.get_device_name()`` that select this row, any of them,
            compared case-insensitively; rows are tried in :data:`GPU_PEAKS` order, so a variant
            (``"H100 PCIe"``) precedes its family's catch-all (``"H100"``).
        bf16: dense bf16 tensor-core peak, TFLOP/s.
        fp16: dense fp16 tensor-core peak, TFLOP/s.
        fp8: dense fp8 tensor-core peak, TFLOP/s; None where the GPU has no fp8 tensor cores.
        source: the datasheet the figures come from.
    """

    key: str
    label: str
    match: tuple[str, ...]
    bf16: float
    fp16: float
    fp8: float | None
    source: str

    def tflops(self, dtype: str = "bf16") -> float | None:
        """The dense peak for ``dtype`` (``"bf16"``, ``"fp16"`` or ``"fp8"``), TFLOP/s; None
        where the GPU has none (fp8 on an A100).

        Raises:
            KeyError: another dtype name.
        """
        return {"bf16": self.bf16, "fp16": self.fp16, "fp8": self.fp8}[dtype]


# Order matters: variants whose names contain a family's name come before that family's row
# (an "H100 PCIe" is not an H100 SXM: 756 not 989 TFLOP/s, so it must not fall into the SXM row).
GPU_PEAKS: tuple[GpuPeak, ...] = (
    # NVIDIA H100 Tensor Core GPU datasheet, "H100 PCIe" column: BF16/FP16 1,513 and FP8 3,026
    # TFLOP/s with sparsity.
    GpuPeak("h100-pcie", "H100 PCIe", ("H100 PCIE",), 756.0, 756.0, 1513.0, "NVIDIA H100 datasheet (PCIe)"),
    # NVIDIA H100 datasheet, "H100 NVL" column: BF16/FP16 1,671 and FP8 3,341 TFLOP/s with sparsity.
    GpuPeak("h100-nvl", "H100 NVL", ("H100 NVL",), 835.0, 835.0, 1670.0, "NVIDIA H100 datasheet (NVL)"),
    # NVIDIA H100 datasheet, "H100 SXM" column: BF16/FP16 1,979 and FP8 3,958 TFLOP/s with sparsity.
    GpuPeak("h100", "H100 SXM", ("H100",), 989.0, 989.0, 1979.0, "NVIDIA H100 datasheet (SXM)"),
    # The H800 SXM is the H100 SXM's chip with NVLink cut to 400 GB/s (DeepSeek-V3 technical
    # report, section 3.1): the same tensor-core peaks.
    GpuPeak("h800", "H800 SXM", ("H800",), 989.0, 989.0, 1979.0, "NVIDIA H100 datasheet (SXM); DeepSeek-V3 report 3.1"),
    # NVIDIA H200 Tensor Core GPU datasheet, "H200 NVL" column: BF16/FP16 1,671 and FP8 3,341
    # TFLOP/s with sparsity.
    GpuPeak("h200-nvl", "H200 NVL", ("H200 NVL",), 835.0, 835.0, 1670.0, "NVIDIA H200 datasheet (NVL)"),
    # NVIDIA GH200 Grace Hopper Superchip datasheet: the Hopper GPU's FP16/BF16 1,979 and FP8
    # 3,958 TFLOP/s with sparsity (its name holds "H200": this row comes first).
    GpuPeak("gh200", "GH200", ("GH200",), 989.0, 989.0, 1979.0, "NVIDIA GH200 datasheet"),
    # NVIDIA H200 datasheet, "H200 SXM" column: BF16/FP16 1,979 and FP8 3,958 TFLOP/s with
    # sparsity (the H100 SXM's compute with 141 GB of HBM3e).
    GpuPeak("h200", "H200 SXM", ("H200",), 989.0, 989.0, 1979.0, "NVIDIA H200 datasheet (SXM)"),
    # NVIDIA GB200 NVL72 datasheet (72 GPUs): FP16/BF16 360 PFLOP/s and FP8 720 PFLOP/s with
    # sparsity, so 2.5 and 5 PFLOP/s dense per GPU (its name holds "B200": this row comes first).
    GpuPeak("gb200", "GB200", ("GB200",), 2500.0, 2500.0, 5000.0, "NVIDIA GB200 NVL72 datasheet"),
    # NVIDIA HGX B200 datasheet (8 GPUs): FP16/BF16 36 PFLOP/s and FP8 72 PFLOP/s with sparsity,
    # so 2.25 and 4.5 PFLOP/s dense per GPU.
    GpuPeak("b200", "B200", ("B200",), 2250.0, 2250.0, 4500.0, "NVIDIA HGX B200 datasheet"),
    # NVIDIA A100 Tensor Core GPU datasheet, "A100 80GB SXM" column: BF16/FP16 312 TFLOP/s dense
    # (624 with sparsity); Ampere has no fp8 tensor cores. The PCIe and 40 GB parts list the same
    # 312, so every A100 matches this row.
    GpuPeak("a100", "A100 SXM 80GB", ("A100",), 312.0, 312.0, None, "NVIDIA A100 datasheet (80GB SXM)"),
    # AMD Instinct MI300X accelerator datasheet: peak FP16 and BF16 1,307.4 TFLOP/s dense
    # (2,614.9 with sparsity), FP8 2,614.9 dense. ROCm's torch reports it as a "cuda" device
    # named "AMD Instinct MI300X" (a "VF" suffix under virtualization).
    GpuPeak("mi300x", "MI300X", ("MI300X",), 1307.4, 1307.4, 2614.9, "AMD Instinct MI300X datasheet"),
)
"""The known GPUs, tried in order by :func:`gpu_peak`."""


def gpu_peak(device_name: str) -> GpuPeak | None:
    """The row of :data:`GPU_PEAKS` whose ``match`` occurs in ``device_name`` (case-insensitive;
    the first such row), or None for a GPU without figures.

    Args:
        device_name: as ``torch.cuda.get_device_name()`` reports it, e.g. ``"NVIDIA H200"``,
            ``"NVIDIA A100-SXM4-80GB"``, ``"AMD Instinct MI300X"``.
    """
    name = device_name.upper()
    return next((row for row in GPU_PEAKS if any(m in name for m in row.match)), None)
