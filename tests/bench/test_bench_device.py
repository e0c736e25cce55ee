"""``shardkit bench --device cuda`` plumbing, on the CPU: the timer's CUDA branch against a
stand-in of ``torch.cuda`` (event pairs, synchronize), the torchrun world (a 1-rank gloo world
made from torchrun's environment variables, in a subprocess), the skip reasons, and the error
without torchrun on a machine without CUDA."""

import json
import os
import socket
import subprocess
import sys
import tempfile

import pytest
import torch

from harness.helpers import world_group
from shardkit.bench import CASES, LAUNCH, Settings, Timer, run_in_world, torchrun_env
from shardkit.bench._method import time_interleaved
from shardkit.bench.registry import skip_reason
from shardkit.cli.main import build_parser
from shardkit.errors import ShardkitError


class FakeCuda:
    """``torch.cuda`` as far as :class:`Timer` uses it; every call lands in ``log``. An event's
    time is the number of calls logged before its ``record`` (1 ms each)."""

    def __init__(self):
        self.log: list = []
        cuda = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                self.at = None

            def record(self):
                cuda.log.append("record")
                self.at = len(cuda.log)

            def synchronize(self):
                cuda.log.append("event.synchronize")

            def elapsed_time(self, end):
                assert self.at is not None and end.at is not None
                return float(end.at - self.at)  # milliseconds

        self.Event = Event

    def synchronize(self, device=None):
        self.log.append(("synchronize", str(device)))


def test_cuda_timer_records_an_event_pair_around_the_region_and_waits_for_the_end():
    cuda = FakeCuda()
    timer = Timer(torch.device("cuda", 0), cuda=cuda)
    seconds = timer.time(lambda: cuda.log.append("op"), reps=2)
    assert cuda.log == ["record", "op", "op", "record", "event.synchronize"]
    assert seconds == pytest.approx(3 / 1e3 / 2)  # 3 calls from start to end, in ms; per rep
    cuda.log.clear()
    timer.start()
    assert timer.stop() == pytest.approx(1e-3) and cuda.log == ["record", "record", "event.synchronize"]


def test_cuda_timer_without_events_synchronizes_the_device_on_both_sides():
    cuda = FakeCuda()
    timer = Timer("cuda:1", events=False, cuda=cuda)
    assert timer.time(lambda: cuda.log.append("op")) >= 0
    assert cuda.log == [("synchronize", "cuda:1"), "op", ("synchronize", "cuda:1")]


def test_cpu_timer_reads_the_host_clock_only():
    timer = Timer("cpu", cuda=FakeCuda())  # never touches a CUDA module
    assert timer.cuda is None and timer.time(lambda: sum(range(1000))) > 0


@pytest.mark.world(1, timeout=60)
def test_time_interleaved_on_a_cuda_setting_times_every_op_with_events(monkeypatch):
    """``Settings(device="cuda")``: every op of every round between an event pair (the world's
    gloo all-reduce of the times stays on the CPU: the group's device)."""
    cuda = FakeCuda()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Event", cuda.Event)
    monkeypatch.setattr(torch.cuda, "synchronize", cuda.synchronize)
    settings = Settings(rounds=40, warmup=5, device="cuda")
    assert settings.torch_device == torch.device("cuda", 0)
    fns = {"a": lambda: cuda.log.append("a"), "b": lambda: cuda.log.append("b")}
    times = time_interleaved(fns, world_group(), settings, reps=3)
    assert cuda.log.count("record") == 2 * 45 * 2 and cuda.log.count("event.synchronize") == 45 * 2
    assert cuda.log[:6] == ["record", "a", "a", "a", "record", "event.synchronize"]
    assert times["a"] == times["b"] == [4 / 1e3 / 3] * 40  # 4 logged calls from start to end


def test_torchrun_env_and_the_skip_reasons():
    assert torchrun_env({}) is None and torchrun_env({"RANK": "0", "WORLD_SIZE": "2"}) is None
    assert torchrun_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}) == dict(rank=3, world=4, local_rank=1)
    at_one = {n for n in CASES if skip_reason(n, 1) is None}
    assert at_one == {
        "collectives",
        "all_to_all",
        "all_to_all_fused",
        "ulysses",
        "spatial_conv",
        "vocab_loss",
        "moe",
        "tp_step",
        "host_overhead",
        "checks",
        "async_checkpoint",
        "startup",  # one rank that launches its own worlds
    }
    assert skip_reason("pipeline_bubble", 2) == "needs 4 ranks, this world has 2 (torchrun --nproc-per-node 4)"
    assert skip_reason("ring", 1) == "needs 2, 4 or 8 ranks, this world has 1 (torchrun --nproc-per-node 2)"
    assert all(skip_reason(n, spec.nproc) is None for n, spec in CASES.items())  # the CPU worlds


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # a torchrun launch (13 s, 6 core-s): the quick tier keeps the skip rules above
def test_a_torchrun_world_of_one_gloo_rank_runs_its_cases_and_records_the_skipped():
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID",)}
    port = str(_free_port())
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    env.update(GLOO_SOCKET_IFNAME="lo" if "lo" in {n for _, n in socket.if_nameindex()} else "lo0")
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "shardkit", "bench", "--quick", "--cases", "vocab_loss,p2p", "--out", out]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
        with open(os.path.join(out, "bench.json")) as f:
            doc = json.load(f)
    assert [(r["case"], r["nproc"]) for r in doc["records"]] == [("vocab_loss", 1)]
    assert doc["skipped"] == [dict(case="p2p", reason="needs 2 ranks, this world has 1 (torchrun --nproc-per-node 2)")]
    assert doc["settings"]["device"] == "cpu" and doc["environment"]["backend"] == "gloo (CPU)"
    assert "p2p: skipped: needs 2 ranks" in done.stderr
    assert (
        "Skipped or failed (not passed): 1 case(s)" in done.stdout and "1 case(s) skipped (not run): p2p" in done.stdout
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_torchrun_or_cuda_says_how_to_launch(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    assert LAUNCH == "torchrun --standalone --nproc-per-node N -m shardkit bench --device cuda"
    with pytest.raises(ShardkitError, match=r"CUDA is not available here .*`torchrun --standalone --nproc-per-node N"):
        run_in_world(["collectives"], Settings(device="cuda"), progress=False)
    args = build_parser().parse_args(["bench", "--device", "cuda", "--cases", "collectives", "--out", "x"])
    with pytest.raises(SystemExit, match=r"^shardkit bench --device cuda: CUDA is not available"):
        args.func(args)
    # With one GPU but only cases that need more ranks: the torchrun line for them.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ShardkitError, match=r"need more than one rank; launch with `torchrun .* --cases p2p,ring`"):
        run_in_world(["p2p", "ring"], Settings(device="cuda"), progress=False)


def test_a_failing_case_alone_in_its_world_is_recorded_as_failed_and_the_next_runs():
    from shardkit.bench._world import _isolated

    def boom():
        raise RuntimeError("no kernel image\nsecond line")

    skipped: list = []
    assert _isolated("tp_step", True, skipped, boom) == [] and _isolated("x", True, skipped, lambda: [1]) == [1]
    assert skipped == [dict(case="tp_step", reason="failed: RuntimeError: no kernel image", failed=True)]
    with pytest.raises(RuntimeError):  # in a larger world the error propagates (as on the CPU)
        _isolated("tp_step", False, skipped, boom)


def test_the_cuda_cases_run_without_tf32_and_the_setting_is_restored():
    from shardkit.bench._world import _ieee_fp32

    conv, matmul = torch.backends.cudnn.conv, torch.backends.cuda.matmul
    before = (conv.fp32_precision, matmul.fp32_precision)
    with _ieee_fp32():
        assert (conv.fp32_precision, matmul.fp32_precision) == ("ieee", "ieee")
    assert (conv.fp32_precision, matmul.fp32_precision) == before
