"""Placement on CUDA, proven on this CPU build: whole training steps (forward, backward, gradient
reduction, clipping, the optimizer) of every layout of the matrix, on fake CUDA tensors.

Each case runs the trainer's ``train_step`` for two steps (a warm-up, then the steady state) in
a real 4-rank gloo world on CPU, rank 0 recording the value of every host read it makes. Rank 0
then runs the same steps in a process of its own (``harness/fake_cuda_step.py``) on fake CUDA
tensors, with a small library (``harness/fake_cuda_shim.cpp``, built once per session) that lets
a CPU build run the autograd engine and FSDP2's streams on them; the reads are answered with the
recorded values, so MoE token counts, pipeline headers and spatial sizes are those of a real run.

Asserted on the steady-state step: every tensor handed to a c10d op is on CUDA; no op turns CUDA
inputs into a CPU tensor; every host-to-device copy is ``non_blocking``; the host reads are the
designed ones (one per step, plus one per dropless MoE layer) and each matched a read of the real
run at the same op and shape; the backward ran (its kernels are in the log); parameters and
optimizer state are on CUDA. Needs a C++ compiler (the shim); without one the cases skip, saying so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.fake_cuda_steps import record_reads
from harness.helpers import rank, world_size
from harness.tiers import tiered

STEPS = 2
HARNESS = Path(__file__).resolve().parents[1] / "harness"
MOE_LAYERS = 2  # the moe model's decoder layers (SMALL's layers=2): one read of its counts each

# name -> (TrainConfig overrides, host reads per steady-state step); every world has 4 ranks
LAYOUTS = {
    "tp=2 (SP) x dp=2": (dict(tp=2, dp_replicate=2), 1),
    "tp=2 x FSDP2=2": (dict(tp=2, dp_shard=2), 1),
    "HSDP 2 x 2": (dict(tp=1, dp_replicate=2, dp_shard=2), 1),
    "uneven GQA tp=4 (6/2 heads)": (dict(tp=4, hidden_size=96, heads=6, kv_heads=2), 1),
    "packed tp=2 x dp=2": (dict(tp=2, packed=True), 1),
    "ring cp=2 x tp=2": (dict(tp=2, cp_ring=2), 1),
    "Ulysses cp=2 x FSDP2=2": (dict(tp=1, cp_ulysses=2, dp_shard=2), 1),
    "USP ring=2 x Ulysses=2, packed": (
        dict(tp=1, cp_ring=2, cp_ulysses=2, packed=True, batch_size=1, seq_len=64),
        1,
    ),
    "pp=2 x dp=2, 1f1b": (dict(tp=1, pp=2, microbatches=2), 1),
    "pp=2 x tp=2, gpipe": (dict(tp=2, pp=2, schedule="gpipe", microbatches=2), 1),
    "pp=2 x dp=2, interleaved-1f1b": (
        dict(tp=1, pp=2, schedule="interleaved-1f1b", virtual_stages=2, layers=4, microbatches=2),
        1,
    ),
    "pp=2 x dp=2, zbv": (dict(tp=1, pp=2, schedule="zbv", virtual_stages=2, layers=4, microbatches=2), 1),
    "pp=2 x dp=2, zb-h1": (dict(tp=1, pp=2, schedule="zb-h1", microbatches=2), 1),
    "moe ep=2 x FSDP2=4": (dict(model="moe", tp=1, dp_shard=4, ep=2), 1 + MOE_LAYERS),
    "moe tp=2 experts x dp=2": (dict(model="moe", tp=2), 1 + MOE_LAYERS),
    "conv-ae spatial=2 x dp=2": (dict(model="conv-ae", spatial=2, seq_len=2), 1),
}
QUICK = ("tp=2 x FSDP2=2", "ring cp=2 x tp=2", "pp=2 x dp=2, 1f1b", "moe ep=2 x FSDP2=4", "conv-ae spatial=2 x dp=2")


def _shim() -> str:
    """The shim library, built once per session (in the session's private cache directory) by a
    separate process: building loads the library, which must never happen in a test process."""
    out = Path(os.environ["XDG_CACHE_HOME"]) / "fake_cuda_shim"
    lib = out / "fake_cuda_shim.so"
    if not lib.exists():
        if shutil.which(os.environ.get("CXX", "c++")) is None:
            pytest.skip("no C++ compiler: the fake CUDA shim cannot be built")
        out.mkdir(mode=0o700, exist_ok=True)
        build = (
            "import sys; from torch.utils.cpp_extension import load; "
            "load(name='fake_cuda_shim', sources=[sys.argv[1]], build_directory=sys.argv[2], is_python_module=False)"
        )
        subprocess.run([sys.executable, "-c", build, str(HARNESS / "fake_cuda_shim.cpp"), str(out)], check=True)
    return str(lib)


def _fake_run(overrides: dict, answers: list, tmp: Path) -> dict:
    job = tmp / "job.json"
    job.write_text(json.dumps({"overrides": overrides, "steps": STEPS, "answers": answers, "world": world_size()}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HARNESS.parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(HARNESS / "fake_cuda_step.py"), _shim(), str(job)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    if done.returncode != 0:  # the Python traceback, without the dispatcher's kernel tables
        lines = [ln for ln in done.stderr.splitlines() if "registered at" not in ln]
        raise AssertionError("the fake CUDA run failed:\n" + "\n".join(lines[-80:]))
    return json.loads(job.read_text())


@pytest.mark.world(4, timeout=300)
@pytest.mark.parametrize("layout", tiered({k: k for k in LAYOUTS}, QUICK))
def test_training_step_stays_on_cuda(layout):
    overrides, reads = LAYOUTS[layout]
    answers = record_reads(overrides, STEPS)  # collective: every rank runs the real steps
    if rank() != 0:
        return
    tmp = Path(os.environ["XDG_CACHE_HOME"]) / f"fake_step_{os.getpid()}"
    tmp.mkdir(mode=0o700, exist_ok=True)
    out = _fake_run(overrides, answers, tmp)
    assert out["collectives"], "no collective in the steady-state step: the layout was not exercised"
    off_device = sorted({tuple(c) for c in out["collectives_all"] if c[1] != "cuda"})
    assert not off_device, f"c10d ops handed non-CUDA tensors: {off_device}"
    assert not out["to_host"], f"CUDA inputs gave CPU outputs: {sorted(set(out['to_host']))}"
    blocking = [c for c in out["to_device"] if not c[2]]
    assert not blocking, f"blocking host-to-device copies in the steady-state step: {blocking}"
    assert out["reads_per_step"][-1] == reads, out["reads_per_step"]
    assert out["reads_left"] == 0, "the real run read values the fake run never asked for"
    assert out["backward_ops"] > 0, "no backward kernel ran"
    assert out["params"] == ["cuda"] and out["optimizer_state"] == ["cuda"], out
    assert out["skipped"] == [False] * STEPS, "a step was not applied (non-finite loss or norm)"
