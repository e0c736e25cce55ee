"""``--profile-steps A:B`` and ``--memory-snapshot`` (issue 32, item 5): the flags' rules before
launch, and one rank's profiler writing a Chrome-trace JSON with exactly the profiled steps."""

import json
import os

import pytest
import torch

from shardkit import ShardkitError
from shardkit.train import profiling
from shardkit.train.options import TrainConfig
from shardkit.train.profile_rules import check_profile_options, parse_profile_steps, profile_dir
from shardkit.train.profiling import StepProfiler


def test_the_window_is_two_one_based_steps_within_the_run():
    assert parse_profile_steps("2:3", 3) == (2, 3) and parse_profile_steps("1:1", 1) == (1, 1)
    for bad in ("3", "0:2", "3:2", "2:4", "a:b", "1:2:3", ""):
        with pytest.raises(ShardkitError, match=r"--profile-steps must be A:B with 1 <= A <= B <= --steps 3"):
            parse_profile_steps(bad, 3)


def test_the_flags_need_a_folder_and_cuda_ranks(tmp_path):
    with pytest.raises(ShardkitError, match="give --report DIR .* or --profile-dir DIR"):
        check_profile_options(TrainConfig(profile_steps="1:2"), None)
    with pytest.raises(ShardkitError, match="--profile-dir: give --profile-steps A:B or --memory-snapshot"):
        check_profile_options(TrainConfig(profile_dir=str(tmp_path)), None)
    # the local launch's ranks are CPU processes: refused before launch, with what to do instead
    with pytest.raises(ShardkitError, match="--memory-snapshot .* needs CUDA ranks .* local launch runs CPU"):
        check_profile_options(TrainConfig(memory_snapshot=True, report=str(tmp_path)), None)
    check_profile_options(TrainConfig(profile_steps="1:2", report=str(tmp_path)), None)
    assert profile_dir(TrainConfig(report="r")) == os.path.join("r", "profile")
    assert profile_dir(TrainConfig(report="r", profile_dir="p")) == "p"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal where torch sees no GPU")
def test_under_torchrun_without_a_gpu_the_snapshot_is_refused():
    with pytest.raises(ShardkitError, match="needs CUDA, and torch sees no GPU here"):
        profiling.check_memory_snapshot_device(TrainConfig(memory_snapshot=True))


def _steps(prof: StepProfiler, n: int) -> None:
    x = torch.ones(8, 8, requires_grad=True)
    for step in range(n):
        with prof.step(step):
            (x @ x).sum().backward()


def _step_ranges(path) -> list[str]:
    with open(path) as f:
        trace = json.load(f)  # Chrome trace JSON: what Perfetto and chrome://tracing read
    return sorted({e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("shardkit step")})


def test_one_trace_per_rank_with_exactly_the_profiled_steps(tmp_path):
    for rank in (0, 1):  # each rank names its own file; two here stand for a world's ranks
        prof = StepProfiler((2, 3), str(tmp_path), trace=True, memory=False, rank=rank)
        _steps(prof, 4)
        assert prof.files == [str(tmp_path / f"rank{rank}.trace.json")]
        assert _step_ranges(prof.files[0]) == ["shardkit step 2", "shardkit step 3"]
        assert prof.result() == {"profile": {"dir": str(tmp_path), "steps": [2, 3], "files": prof.files}}


def test_a_resume_inside_the_window_profiles_from_its_first_step(tmp_path):
    prof = StepProfiler((2, 4), str(tmp_path), trace=True, memory=False, rank=0)
    x = torch.ones(4, requires_grad=True)
    for step in range(2, 4):  # resumed at step 3 (0-based 2)
        with prof.step(step):
            (x * 2).sum().backward()
    assert _step_ranges(prof.files[0]) == ["shardkit step 3", "shardkit step 4"]


def test_the_memory_snapshot_brackets_the_window(tmp_path, monkeypatch):
    # The allocator calls need CUDA: here they are recorded, not run (the wiring, not the snapshot itself).
    calls = []
    monkeypatch.setattr(profiling, "record_memory_history", lambda on: calls.append(("record", on)))
    monkeypatch.setattr(profiling, "dump_memory_snapshot", lambda path: calls.append(("dump", path)))
    prof = StepProfiler((1, 2), str(tmp_path), trace=False, memory=True, rank=3)
    _steps(prof, 3)
    path = str(tmp_path / "rank3.memory.pickle")
    assert calls == [("record", True), ("dump", path), ("record", False)] and prof.files == [path]
