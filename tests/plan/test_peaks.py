"""The MFU peak table (issue 32, item 2): every GPU named by the device string torch reports,
a variant never falling into its family's row, figures dense (half the datasheets' sparse ones)."""

import pytest
import torch

from shardkit.plan.cluster import CLUSTERS
from shardkit.plan.peaks import GPU_PEAKS, gpu_peak

# (what torch.cuda.get_device_name() reports, row key, dense bf16, fp16, fp8 TFLOP/s)
NAMES = [
    ("NVIDIA H100 80GB HBM3", "h100", 989.0, 989.0, 1979.0),
    ("NVIDIA H100 PCIe", "h100-pcie", 756.0, 756.0, 1513.0),
    ("NVIDIA H100 NVL", "h100-nvl", 835.0, 835.0, 1670.0),
    ("NVIDIA H800", "h800", 989.0, 989.0, 1979.0),
    ("NVIDIA H200", "h200", 989.0, 989.0, 1979.0),
    ("NVIDIA H200 NVL", "h200-nvl", 835.0, 835.0, 1670.0),
    ("NVIDIA GH200 480GB", "gh200", 989.0, 989.0, 1979.0),
    ("NVIDIA B200", "b200", 2250.0, 2250.0, 4500.0),
    ("NVIDIA GB200", "gb200", 2500.0, 2500.0, 5000.0),
    ("NVIDIA A100-SXM4-80GB", "a100", 312.0, 312.0, None),
    ("NVIDIA A100-PCIE-40GB", "a100", 312.0, 312.0, None),
    ("AMD Instinct MI300X", "mi300x", 1307.4, 1307.4, 2614.9),
    ("AMD Instinct MI300X VF", "mi300x", 1307.4, 1307.4, 2614.9),
]


@pytest.mark.parametrize(("name", "key", "bf16", "fp16", "fp8"), NAMES)
def test_the_lookup_finds_each_gpu_by_its_device_name(name, key, bf16, fp16, fp8):
    row = gpu_peak(name)
    assert row is not None and row.key == key
    assert (row.tflops("bf16"), row.tflops("fp16"), row.tflops("fp8")) == (bf16, fp16, fp8)
    assert gpu_peak(name.lower()) == row  # case does not matter


def test_unknown_gpus_and_dtypes_have_no_figure():
    assert gpu_peak("Tesla T4") is None and gpu_peak("NVIDIA GeForce RTX 4090") is None
    with pytest.raises(KeyError):
        GPU_PEAKS[0].tflops("int8")


def test_every_row_is_reachable_and_names_its_source():
    """A row shadowed by an earlier one (its own match string selecting another row) is dead."""
    for row in GPU_PEAKS:
        assert all(gpu_peak(f"X {m} Y") is row for m in row.match), row.key
        assert row.source and row.bf16 > 0 and (row.fp8 is None or row.fp8 >= row.bf16)
    assert len({row.key for row in GPU_PEAKS}) == len(GPU_PEAKS)


def test_the_planner_presets_take_their_peak_from_the_table():
    for key, figures in CLUSTERS.items():
        row = gpu_peak(key)
        assert row is not None and figures["peak_tflops"] == row.bf16


@pytest.mark.parametrize(("name", "key", "bf16", "fp16", "fp8"), NAMES[3:])
def test_the_trainer_mfu_uses_the_row(monkeypatch, name, key, bf16, fp16, fp8):
    from shardkit.train.metrics import peak_flops, utilisation

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    cuda = torch.device("cuda", 0)
    label = gpu_peak(name).label
    assert peak_flops(cuda) == (bf16 * 1e12, f"of the {label} dense bf16 peak, {bf16:g} TFLOP/s per GPU")
    assert peak_flops(cuda, "fp16")[0] == fp16 * 1e12
    if fp8 is None:
        assert peak_flops(cuda, "fp8") == (None, f"n/a (no fp8 peak figure for {name})")
    assert utilisation(1e9, 2e5, 8, cuda)["mfu"] == pytest.approx(2e14 / (8 * bf16 * 1e12))
