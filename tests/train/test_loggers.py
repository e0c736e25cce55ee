"""The trainer's loggers (issue 32, item 2): one interface, TensorBoard and Weights & Biases fed the
same scalars; W&B offline unless WANDB_MODE says otherwise; a missing package or a bad project
name refused before launch. The real wandb package is exercised offline in a tmp folder (its
run file read back record by record); the trainer's path through a recording stand-in module."""

from __future__ import annotations

import importlib.machinery
import json
import struct
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from harness.helpers import rank, remove_shared_dir, shared_tmpdir, world_size
from shardkit import ShardkitError
from shardkit._optional import MissingExtraError
from shardkit.cli.main import main
from shardkit.train.loggers import WandbLogger, check_loggers, scalars, wandb_mode
from shardkit.train.metrics import MetricsLog
from shardkit.train.trainer import StepStats

STEPS = [
    StepStats(loss=2.5, grad_norm=1.25, targets=64, seconds=0.5),
    StepStats(loss=2.0, grad_norm=0.75, targets=64, seconds=0.25),
]


class _FakeRun:
    def __init__(self, calls: list, folder: str | None) -> None:
        self.calls, self.dir = calls, f"{folder or '.'}/wandb/offline-run-x/files"

    def log(self, data: dict, step: int) -> None:
        self.calls.append(("log", step, dict(data)))

    def finish(self) -> None:
        self.calls.append(("finish",))


def fake_wandb() -> tuple[types.ModuleType, list]:
    """A stand-in ``wandb`` module recording ``init`` / ``log`` / ``finish`` (importable and
    found by ``find_spec``, as an installed package is)."""
    calls: list = []
    mod = types.ModuleType("wandb")
    mod.__spec__ = importlib.machinery.ModuleSpec("wandb", None)

    def init(**kwargs):
        calls.append(("init", kwargs))
        return _FakeRun(calls, kwargs.get("dir"))

    mod.init = init
    mod.Settings = lambda **kw: kw
    return mod, calls


def _write(metrics: MetricsLog) -> list[dict]:
    lines = [metrics.write(step, stats, lr=1e-3 * (step + 1)) for step, stats in enumerate(STEPS)]
    metrics.close()
    return lines


def test_wandb_gets_the_tensorboard_scalars_offline_by_default(tmp_path, monkeypatch):
    mod, calls = fake_wandb()
    monkeypatch.setitem(sys.modules, "wandb", mod)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    metrics = MetricsLog(
        str(tmp_path), "tokens", 32, 2, torch.device("cpu"), tensorboard=False, wandb_project="proj", config={"a": 1}
    )
    lines = _write(metrics)
    init = calls[0][1]
    assert (init["project"], init["id"], init["mode"], init["resume"]) == ("proj", metrics.run_id, "offline", "allow")
    assert init["dir"] == str(tmp_path) and init["config"] == {"a": 1}
    assert calls[1:] == [("log", 1, scalars(lines[0])), ("log", 2, scalars(lines[1])), ("finish",)]
    assert calls[1][2]["train/loss"] == 2.5 and calls[2][2]["train/grad_norm"] == 0.75
    assert metrics.files() == [str(tmp_path / "metrics.jsonl"), str(tmp_path / "wandb" / "offline-run-x")]


def test_the_users_wandb_mode_wins(monkeypatch):
    mod, calls = fake_wandb()
    monkeypatch.setitem(sys.modules, "wandb", mod)
    monkeypatch.setenv("WANDB_MODE", "online")
    assert wandb_mode() == "online"
    WandbLogger("proj", "run-1").close()
    assert calls[0][1]["mode"] == "online" and calls[0][1]["dir"] is None and calls[-1] == ("finish",)


def test_wandb_alone_writes_no_report_files(monkeypatch, tmp_path):
    mod, calls = fake_wandb()
    monkeypatch.setitem(sys.modules, "wandb", mod)
    monkeypatch.chdir(tmp_path)
    metrics = MetricsLog(None, "tokens", 32, 2, torch.device("cpu"), wandb_project="proj")
    _write(metrics)
    assert metrics.path is None and metrics.tb_dir is None and [c[0] for c in calls] == ["init", "log", "log", "finish"]
    assert list(tmp_path.iterdir()) == []


def test_without_wandb_the_error_names_the_extra_before_launch(hide_module, capsys):
    hide_module("wandb")
    with pytest.raises(MissingExtraError, match=r"pip install 'shardkit\[wandb\]'"):
        check_loggers("proj")
    assert main(["train", "--wandb", "proj", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "shardkit train: error: shardkit train --wandb needs wandb, which is not installed: "
        "pip install 'shardkit[wandb]'"
    ]


@pytest.mark.parametrize("name", ["", "  ", "team/proj", "a:b"])
def test_a_bad_project_name_is_refused(name, capsys):
    with pytest.raises(ShardkitError, match="is not a W&B project name"):
        check_loggers(name)
    assert main(["train", "--wandb", name, "--steps", "1"]) == 2
    assert "--wandb:" in capsys.readouterr().err


def _wandb_records(run_file: Path) -> list:
    """The records of an offline W&B run file: a 7-byte header (``:W&B``, magic, version), then
    LevelDB-log framed records (crc32, length, type; one block holds this small file), each a
    ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    blob = run_file.read_bytes()
    assert blob[:4] == b":W&B"
    out, i = [], 7
    while i + 7 <= len(blob):
        _, length, kind = struct.unpack("<IHB", blob[i : i + 7])
        if (length == 0 and kind == 0) or i + 7 + length > len(blob):  # zero padding; still being written
            break
        assert kind == 1, "a record split over blocks: this reader handles one-block files only"
        record = wandb_internal_pb2.Record()
        record.ParseFromString(blob[i + 7 : i + 7 + length])
        out.append(record)
        i += 7 + length
    return out


@pytest.mark.slow  # wandb's own service process (5 core-s); the quick tier keeps the logger interface's tests
def test_the_real_wandb_package_logs_every_step_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")  # the test extra installs it: CI runs this for real
    monkeypatch.delenv("WANDB_MODE", raising=False)  # the default must be offline (no network here)
    monkeypatch.setenv("WANDB_SILENT", "true")
    metrics = MetricsLog(str(tmp_path), "tokens", 32, 2, torch.device("cpu"), wandb_project="shardkit-test")
    lines = _write(metrics)
    run_dir = Path(metrics.files()[-1])
    assert run_dir.parent == tmp_path / "wandb" and run_dir.name.startswith("offline-run-")
    # ``finish()`` returns once wandb's service process has the run; that process may still be
    # writing the file: read it again until its last record (``exit``) is there.
    deadline = time.monotonic() + 60
    while True:
        records = _wandb_records(next(run_dir.glob("run-*.wandb")))
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run.run_id, run.project) == (metrics.run_id, "shardkit-test")
    history = [r.history for r in records if r.WhichOneof("record_type") == "history"]
    assert [h.step.num for h in history] == [1, 2]
    for h, line in zip(history, lines):
        items = {(item.key or "/".join(item.nested_key)): item.value_json for item in h.item}  # "a/b": nested
        logged = {key: json.loads(value) for key, value in items.items() if not key.startswith("_")}
        assert logged == pytest.approx(scalars(line))
    on_disk = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert on_disk == lines  # the JSONL and TensorBoard are unchanged beside it
    assert (tmp_path / "tb").is_dir()


@pytest.mark.world(2, timeout=240)
def test_the_trainer_logs_each_step_of_its_run_to_wandb():
    """Through ``train`` on 2 ranks (tp 2): rank 0 alone opens the W&B run, logs the losses the
    run returns, step by step, and finishes it; rank 1 never touches wandb."""
    from shardkit.train.config import TrainConfig, validate_config
    from shardkit.train.run import train

    root = shared_tmpdir("shardkit-wandb-")
    saved = sys.modules.get("wandb")
    mod, calls = fake_wandb()
    sys.modules["wandb"] = mod
    try:
        cfg = TrainConfig(
            seq_len=16, batch_size=2, dtype="float32", layers=1, steps=2, tp=2, report=root, wandb="proj",
            data=__file__,
        )  # fmt: skip
        checked = validate_config(cfg, world_size=world_size())
        result = train(checked, "gloo", torch.device("cpu"), time.perf_counter(), False)
    finally:
        sys.modules.pop("wandb")
        if saved is not None:
            sys.modules["wandb"] = saved
        remove_shared_dir(root)
    if rank() != 0:
        assert calls == []
        return
    assert calls[0][0] == "init" and calls[0][1]["id"] == result["run_id"] and calls[0][1]["config"]["wandb"] == "proj"
    logged = [c for c in calls if c[0] == "log"]
    assert [c[1] for c in logged] == [1, 2]
    assert [c[2]["train/loss"] for c in logged] == result["losses"]
    assert calls[-1] == ("finish",)
