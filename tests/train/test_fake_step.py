"""Placement on CUDA, proven on this CPU build: whole training steps (forward, backward, gradient
reduction, clipping, the optimizer) of every layout of the matrix, on fake CUDA tensors.

Each layout runs the trainer's ``train_step`` for two steps (a warm-up, then the steady state) in
a real 4-rank gloo world on CPU, rank 0 recording the value of every host read it makes. Rank 0
then runs the same steps of every layout of the tier in one process of its own
(``harness/fake_cuda_step.py``) on fake CUDA tensors, with a small library
(``harness/fake_cuda_shim.cpp``, built once per session) that lets a CPU build run the autograd
engine and FSDP2's streams on them; the reads are answered with the recorded values, so MoE token
counts, pipeline headers and spatial sizes are those of a real run.

Asserted on the steady-state step: every tensor handed to a c10d op is on CUDA; no op turns CUDA
inputs into a CPU tensor; every host-to-device copy is ``non_blocking``; the host reads are the
designed ones (one per step, plus one per dropless MoE layer) and each matched a read of the real
run at the same op and shape; the backward ran (its kernels are in the log); parameters and
optimizer state are on CUDA. Needs a C++ compiler (the shim); without one the tests skip, saying so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.fake_cuda_steps import record_reads
from harness.helpers import SMALL_CORPUS, rank, world_size

# The shim registers CUDA's hooks, which a CUDA build of torch already has (it refuses a second
# registration): there the real device is the check (scripts/gpu_first_checks.sh).
pytestmark = pytest.mark.skipif(torch.version.cuda is not None, reason="the fake CUDA shim is for CPU builds of torch")

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
    "pp=2 x dp=2, zbv": (dict(tp=1, pp=2, schedule="zbv", virtual_stages=2, layers=4, microbatches=2), 1),
    "pp=2 x dp=2, zb-h1": (dict(tp=1, pp=2, schedule="zb-h1", microbatches=2), 1),
    "moe ep=2 x FSDP2=4": (dict(model="moe", tp=1, dp_shard=4, ep=2), 1 + MOE_LAYERS),
    "moe tp=2 experts x dp=2": (dict(model="moe", tp=2), 1 + MOE_LAYERS),
    "conv-ae spatial=2 x dp=2": (dict(model="conv-ae", spatial=2, seq_len=2), 1),
}
# One 90 KB file of text, not the default corpus (the stdlib: 31 MB read by rank 0 and broadcast
# to every rank, a third of a small run's CPU); the packed layouts keep the stdlib's documents.
CORPUS = SMALL_CORPUS
LAYOUTS = {name: ({**o} if o.get("packed") else {"data": CORPUS, **o}, r) for name, (o, r) in LAYOUTS.items()}
# The quick tier (a developer's pre-commit run, under 3 minutes in all) keeps the layout whose
# device placement is most its own: MoE's token counts (the designed host reads) with FSDP2's
# streams and collectives (its dense layers sharded over 4, its experts over edp). The ring's
# fused attention blocks on CUDA stay quick in tests/context_parallel/test_fused_blocks_cuda.py;
# its whole step beside tp's collectives, a pipeline's P2P and headers and the spatial halo
# (4-8 core-s each) are the slow tier's, with the others. Where a device tensor lives does not
# depend on the order a schedule runs its microbatches in: 1f1b stands for the one-chunk runner
# (gpipe's too), zbv for chunked stages and the I/W split (interleaved-1f1b's chunks too), so
# neither of those two is a layout here.
QUICK = ("moe ep=2 x FSDP2=4",)
SLOW = tuple(name for name in LAYOUTS if name not in QUICK)


def _shim() -> str:
    """The shim library, built once per session (in the session's private cache directory) by the
    C++ compiler alone: building never loads the library, which must never happen in a test
    process. One compiler call against torch's headers and libraries (2 core-s measured), not
    ``torch.utils.cpp_extension.load``, which would pay a fresh ``import torch`` and ninja (4.7)."""
    out = Path(os.environ["XDG_CACHE_HOME"]) / "fake_cuda_shim"
    lib = out / "fake_cuda_shim.so"
    if not lib.exists():
        cxx = shutil.which(os.environ.get("CXX", "c++"))
        if cxx is None:
            pytest.skip("no C++ compiler: the fake CUDA shim cannot be built")
        out.mkdir(mode=0o700, exist_ok=True)
        partial = out / f"fake_cuda_shim.{os.getpid()}.so"
        torch_dir = Path(torch.__file__).parent  # its C++ headers and libraries ship in the wheel
        source = str(HARNESS / "fake_cuda_shim.cpp")
        build = [cxx, "-shared", "-fPIC", "-std=c++20", f"-isystem{torch_dir / 'include'}", source]
        build += ["-o", str(partial), f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu"]
        subprocess.run(build, check=True)
        partial.replace(lib)  # whole or absent: a build cut short leaves no library behind
    return str(lib)


def _fake_runs(layouts: dict, tmp: Path) -> dict:
    """Every layout's fake CUDA run, in one worker process (``harness/fake_cuda_step.py``)."""
    job = tmp / "job.json"
    job.write_text(json.dumps({"world": world_size(), "steps": STEPS, "layouts": layouts}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HARNESS.parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(HARNESS / "fake_cuda_step.py"), _shim(), str(job)],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    if done.returncode != 0:  # the Python traceback, without the dispatcher's kernel tables
        lines = [ln for ln in done.stderr.splitlines() if "registered at" not in ln]
        raise AssertionError("the fake CUDA worker failed:\n" + "\n".join(lines[-80:]))
    return json.loads(job.read_text())


def _problems(out: dict, reads: int) -> list[str]:
    """What is wrong with one layout's fake run (empty: nothing)."""
    if "error" in out:
        return [f"the fake CUDA run raised:\n{out['error'][-4000:]}"]
    found = []
    if not out["collectives"]:
        found.append("no collective in the steady-state step: the layout was not exercised")
    off_device = sorted({tuple(c) for c in out["collectives_all"] if c[1] != "cuda"})
    if off_device:
        found.append(f"c10d ops handed non-CUDA tensors: {off_device}")
    if out["to_host"]:
        found.append(f"CUDA inputs gave CPU outputs: {sorted(set(out['to_host']))}")
    blocking = [c for c in out["to_device"] if not c[2]]
    if blocking:
        found.append(f"blocking host-to-device copies in the steady-state step: {blocking}")
    if out["reads_per_step"][-1] != reads:
        found.append(f"host reads per step {out['reads_per_step']}, designed {reads} in the steady state")
    if out["reads_left"]:
        found.append("the real run read values the fake run never asked for")
    if not out["backward_ops"]:
        found.append("no backward kernel ran")
    if out["params"] != ["cuda"] or out["optimizer_state"] != ["cuda"]:
        found.append(f"parameters on {out['params']}, optimizer state on {out['optimizer_state']}")
    if out["skipped"] != [False] * STEPS:
        found.append("a step was not applied (non-finite loss or norm)")
    return found


@pytest.mark.world(4, timeout=900)
@pytest.mark.parametrize(
    "names", [pytest.param(QUICK, id="quick"), pytest.param(SLOW, id="slow", marks=pytest.mark.slow)]
)
def test_training_steps_stay_on_cuda(names):
    # collective: every rank runs each layout's real steps; rank 0 keeps the values it read
    layouts = {
        name: {"overrides": LAYOUTS[name][0], "answers": record_reads(LAYOUTS[name][0], STEPS)} for name in names
    }
    if rank() != 0:
        return
    tmp = Path(os.environ["XDG_CACHE_HOME"]) / f"fake_step_{os.getpid()}"
    tmp.mkdir(mode=0o700, exist_ok=True)
    results = _fake_runs(layouts, tmp)
    problems = {name: _problems(results[name], LAYOUTS[name][1]) for name in names}
    assert not any(problems.values()), "\n".join(f"{n}: {p}" for n, ps in problems.items() for p in ps)
