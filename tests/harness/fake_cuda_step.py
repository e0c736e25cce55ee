"""Whole training steps on fake CUDA, backward included: the worker of tests/train/test_fake_step.py.

Usage: ``python fake_cuda_step.py SHIM JOB``. ``SHIM`` is the library built from
``fake_cuda_shim.cpp``: loaded before ``import torch``, it makes a CPU build run the autograd
engine on fake CUDA tensors (the shim's comment says how), so this runs in a process of its own,
never inside pytest or a test world. ``JOB`` is a JSON file: ``world``, ``steps`` and
``layouts``, by name: ``overrides`` (the layout's ``TrainConfig`` fields) and ``answers``, the
host reads rank 0 made in a real gloo world running the same steps on CPU
(``fake_cuda_steps.record_reads``). The worker replaces it with each layout's facts of its fake
run (``fake_cuda_steps.fake_run``), or its ``error`` (a traceback).

The fake run is rank 0 of a world on torch's fake process group (every collective returns at
once, nothing moves): the model, its optimizer state, every activation and gradient live on a fake
``cuda`` device. A fake tensor has no values, so each host read is answered with the real run's
value at the same place (same op and shape; any other read fails the run): the reads a step makes
by design (the loss and the norm; an MoE layer's token counts; a pipeline's message headers on the
first step; a spatial layer's sizes on a new shape) get the values a real world had.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import os
import sys
import traceback


def _preload(shim: str) -> None:
    """Load torch's core libraries and the shim before ``import torch`` (see the shim)."""
    spec = importlib.util.find_spec("torch")
    assert spec is not None and spec.origin is not None
    lib = os.path.join(os.path.dirname(spec.origin), "lib")
    for name in ("libc10.so", "libtorch_cpu.so"):
        ctypes.CDLL(os.path.join(lib, name), mode=ctypes.RTLD_GLOBAL)
    ctypes.CDLL(shim, mode=ctypes.RTLD_GLOBAL)


def _cuda_python_api(torch) -> None:
    """``torch.cuda``'s Python functions that FSDP2, DDP and shardkit call, on the shim's one device
    and one stream (``torch.Stream`` / ``torch.Event`` reach the shim's device guard directly): a
    CPU build defines them but raises "Torch not compiled with CUDA enabled" before its runtime."""

    class Stream:  # classes, not functions: torch annotates with ``torch.cuda.Stream | None``
        def __new__(cls, device=None, priority=0, **kwargs):
            return torch.Stream(device="cuda")

    class Event:
        def __new__(cls, *args, **kwargs):
            return torch.Event(device="cuda")

    cuda = torch.cuda
    cuda._lazy_init = lambda: None
    cuda.current_device = lambda: 0
    cuda.device_count = lambda: 1
    cuda.set_device = lambda device: None
    cuda.Stream, cuda.Event = Stream, Event
    cuda.current_stream = lambda device=None: torch.Stream(device="cuda")
    cuda.stream = lambda stream: contextlib.nullcontext()
    # torch.accelerator (not torch.cuda: fake tensors read that) reports the device, so groups on
    # the fake process group keep their metadata on it, as on NCCL
    torch.accelerator.is_available = lambda: True


def main(argv: list[str]) -> int:
    shim, job = argv
    _preload(shim)
    import torch  # after the shim: torch asks for the accelerator once, at first use

    from harness.fake_cuda_steps import fake_run

    if torch._C._get_accelerator().type != "cuda":
        raise SystemExit("fake_cuda_step: the shim did not make CUDA the accelerator")
    _cuda_python_api(torch)
    with open(job) as f:
        spec = json.load(f)
    results = {}
    for name, layout in spec["layouts"].items():  # each on its own: one failure hides no other
        try:
            answers = [tuple(a) for a in layout["answers"]]
            results[name] = fake_run(layout["overrides"], spec["steps"], answers, spec["world"])
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    with open(job, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
