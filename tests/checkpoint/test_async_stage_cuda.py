"""The staging copy of ``--async-checkpoint`` (:class:`shardkit.checkpoint.background.CpuStager`)
on fake CUDA tensors (no GPU here: tests/harness/fake_cuda.py): a CUDA tensor is staged into a
pinned CPU buffer of its shape and dtype (the buffer reused by the next save), a CPU tensor into a
plain one, and the CPU copy holds the tensor's values."""

from __future__ import annotations

from unittest import mock

import torch

from harness.fake_cuda import fake_cuda
from shardkit.checkpoint.background import CpuStager


def _pinned_requests(calls) -> list[bool]:
    return [bool(c.kwargs.get("pin_memory")) for c in calls]


def test_cuda_state_is_staged_to_pinned_cpu_buffers_reused_across_saves():
    stager = CpuStager()
    with fake_cuda():
        state = {"w": torch.randn(4, 8, device="cuda"), "m": torch.zeros(3, dtype=torch.bfloat16, device="cuda")}
        with mock.patch("torch.empty", wraps=torch.empty) as empty:
            first = stager.stage(state)
            buffers = dict(stager._buffers)
            second = stager.stage(state)
    assert _pinned_requests(empty.call_args_list) == [True, True]  # one pinned buffer per key, once
    for key, t in state.items():
        for out in (first[key], second[key]):
            assert out.device.type == "cpu" and out.shape == t.shape and out.dtype == t.dtype
        assert stager._buffers[key] is buffers[key]
    assert stager.staged_bytes == 4 * 8 * 4 + 3 * 2


def test_cpu_state_is_staged_to_plain_buffers_with_its_values():
    stager = CpuStager()
    w = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    with mock.patch("torch.empty", wraps=torch.empty) as empty:
        out = stager.stage({"w": w})
    assert _pinned_requests(empty.call_args_list) == [False]
    w.add_(1)  # training goes on: the staged copy must not follow
    assert torch.equal(out["w"], torch.arange(12, dtype=torch.float64).reshape(3, 4))
