"""Per-step metrics of ``--report DIR``: metrics.jsonl, and TensorBoard scalars in DIR/tb when
tensorboard is installed (the missing path simulated by a failing import)."""

import json
import os

import pytest
import torch

from shardkit.train.metrics import RUNS_DIR, TB_DIR, MetricsLog
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


def test_non_finite_metrics_are_json_null_with_a_flag(tmp_path):
    # issue 31 item 6: a skipped step wrote "loss": NaN / "grad_norm": Infinity (tokens no JSON
    # parser but Python's accepts); now null, the fields named in "nonfinite"
    metrics = MetricsLog(str(tmp_path), "tokens", 32, 2, torch.device("cpu"), tensorboard=False)
    bad = StepStats(loss=float("nan"), grad_norm=float("inf"), targets=64, seconds=0.5, skipped=True)
    written = [metrics.write(0, STEPS[0], 1e-3), metrics.write(1, bad, 1e-3, eval_loss=float("-inf"))]
    metrics.close()

    def refuse(token):
        raise ValueError(f"not JSON: {token}")

    on_disk = [
        json.loads(line, parse_constant=refuse) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ]
    assert on_disk == written
    assert "nonfinite" not in on_disk[0] and on_disk[0]["loss"] == 2.5
    assert (on_disk[1]["loss"], on_disk[1]["grad_norm"], on_disk[1]["eval_loss"]) == (None, None, None)
    assert on_disk[1]["nonfinite"] == ["loss", "grad_norm", "eval_loss"] and on_disk[1]["skipped"] is True


def test_without_tensorboard_only_the_jsonl(tmp_path, hide_module):
    hide_module("tensorboard")
    metrics = MetricsLog(str(tmp_path), "pixels", sample_size=10, batch_size=1, device=torch.device("cpu"))
    assert metrics.tb_dir is None
    lines = _log(metrics)
    assert [m["pixels_per_s"] for m in lines] == [20.0, 40.0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_new_run_starts_afresh_and_keeps_the_old_under_its_run_id(tmp_path):
    """A second (not resumed) run into the same folder gets a fresh metrics.jsonl and tb/; the
    first run's files move to runs/<its run id>/; every line carries its run's id."""
    cpu = torch.device("cpu")
    first = MetricsLog(str(tmp_path), "tokens", 32, 2, cpu)
    _log(first)
    (tmp_path / "report.json").write_text("{}")
    second = MetricsLog(str(tmp_path), "tokens", 32, 2, cpu)
    assert second.run_id != first.run_id and second.archived == str(tmp_path / RUNS_DIR / first.run_id)
    old = tmp_path / RUNS_DIR / first.run_id
    assert sorted(p.name for p in old.iterdir()) == ["metrics.jsonl", "report.json", TB_DIR]
    assert [m["run_id"] for m in _lines(old / "metrics.jsonl")] == [first.run_id] * 2
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "report.json").exists()
    _log(second)
    assert [(m["run_id"], m["step"]) for m in _lines(tmp_path / "metrics.jsonl")] == [
        (second.run_id, 1),
        (second.run_id, 2),
    ]
    assert [s for s, _ in _scalars(tmp_path / TB_DIR)["train/loss"]] == [1, 2]  # the first run's events moved


def test_a_resumed_run_appends_under_the_same_run_id(tmp_path):
    cpu = torch.device("cpu")
    first = MetricsLog(str(tmp_path), "tokens", 32, 2, cpu, tensorboard=False)
    _log(first)
    resumed = MetricsLog(str(tmp_path), "tokens", 32, 2, cpu, tensorboard=False, resumed=True)
    assert resumed.run_id == first.run_id and resumed.archived is None
    resumed.write(2, STEPS[0], lr=1e-3)
    assert [(m["run_id"], m["step"]) for m in _lines(tmp_path / "metrics.jsonl")] == [
        (first.run_id, s) for s in (1, 2, 3)
    ]
    assert not (tmp_path / RUNS_DIR).exists()


def test_files_of_a_run_without_ids_are_kept_too(tmp_path):
    """A metrics.jsonl written before run ids (or torn by a kill) is moved under an ``unnamed-<time>`` id."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    log = MetricsLog(str(tmp_path), "tokens", 32, 2, torch.device("cpu"), tensorboard=False)
    assert os.path.basename(log.archived).startswith("unnamed-")
    assert (tmp_path / RUNS_DIR / os.path.basename(log.archived) / "metrics.jsonl").read_text().startswith('{"step": 1')
    again = MetricsLog(str(tmp_path), "tokens", 32, 2, torch.device("cpu"), tensorboard=False)
    assert again.archived is None  # nothing left to move: the folder already starts afresh


def test_model_size_and_the_peak_figures(monkeypatch):
    """Parameters counted once each, the planner's FLOPs per token; MFU's peak from the planner's
    GPU figures, none on a CPU or an unknown GPU."""
    from harness.tiny_lm import tiny_decoder
    from shardkit.plan.model import ModelShape
    from shardkit.train.metrics import model_size, peak_flops, utilisation

    model = tiny_decoder("llama")
    size = model_size(model, seq_len=16)
    assert size["parameters"] == sum(p.numel() for p in model.parameters()) > 0
    assert size["flops_per_token"] == ModelShape.from_config(model.config).flops_per_token(16)
    assert model_size(torch.nn.Linear(3, 2), seq_len=16) == {"parameters": 8, "flops_per_token": None}
    assert peak_flops(torch.device("cpu")) == (None, "n/a on cpu (no peak figure)")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert peak_flops(torch.device("cuda", 0)) == (989e12, "of the H100 SXM dense bf16 peak, 989 TFLOP/s per GPU")
    assert utilisation(1e9, 2e5, 4, torch.device("cuda", 0))["mfu"] == pytest.approx(2e14 / (4 * 989e12))
    assert utilisation(None, 2e5, 4, torch.device("cuda", 0))["mfu_basis"] == "n/a (no FLOPs count for this model)"
    assert utilisation(1e9, 2e5, 4, torch.device("cpu")) == {"mfu": None, "mfu_basis": "n/a on cpu (no peak figure)"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    assert peak_flops(torch.device("cuda", 0)) == (None, "n/a (no bf16 peak figure for Tesla T4)")
