"""Per-step metrics of ``--report DIR``: metrics.jsonl, and TensorBoard scalars in DIR/tb when
tensorboard is installed (the missing path simulated by a failing import)."""

import json

import pytest
import torch

from shardkit.train.metrics import TB_DIR, MetricsLog
from shardkit.train.trainer import StepStats

STEPS = [
    StepStats(loss=2.5, grad_norm=1.25, targets=64, seconds=0.5),
    StepStats(loss=2.0, grad_norm=0.75, targets=64, seconds=0.25),
]


def _log(metrics):
    lines = [metrics.write(step, stats, lr=1e-3 * (step + 1)) for step, stats in enumerate(STEPS)]
    metrics.close()
    return lines


def _scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_jsonl_and_tensorboard_hold_the_same_steps(tmp_path):
    lines = _log(MetricsLog(str(tmp_path), "tokens", sample_size=32, batch_size=2, device=torch.device("cpu")))
    on_disk = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert on_disk == lines
    assert [m["step"] for m in on_disk] == [1, 2] and [m["tokens_per_s"] for m in on_disk] == [128.0, 256.0]
    scalars = _scalars(tmp_path / TB_DIR)
    assert sorted(scalars) == sorted(
        f"train/{k}" for k in ("loss", "grad_norm", "lr", "tokens_per_s", "step_time_s", "peak_memory_mib", "skipped")
    )
    assert [m["skipped"] for m in on_disk] == [False, False]
    assert scalars["train/loss"] == [(1, 2.5), (2, 2.0)]
    assert scalars["train/grad_norm"] == [(1, 1.25), (2, 0.75)]
    assert [s for s, _ in scalars["train/lr"]] == [1, 2]
    assert [v for _, v in scalars["train/lr"]] == pytest.approx([1e-3, 2e-3], rel=1e-6)  # stored as float32
    mib = [m["peak_memory_bytes"] / 2**20 for m in on_disk]
    assert [v for _, v in scalars["train/peak_memory_mib"]] == pytest.approx(mib, rel=1e-6)


def test_without_tensorboard_only_the_jsonl(tmp_path, hide_module):
    hide_module("tensorboard")
    metrics = MetricsLog(str(tmp_path), "pixels", sample_size=10, batch_size=1, device=torch.device("cpu"))
    assert metrics.tb_dir is None
    lines = _log(metrics)
    assert [m["pixels_per_s"] for m in lines] == [20.0, 40.0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
