"""The pipeline schedules bench case (:mod:`shardkit.bench.cases_pp_schedules`): its chunk puts
the input-gradient cost in ``I`` and the weight-gradient cost in ``W``, and its theory is the
simulated bubble of each table (1F1B's is ``(p - 1) / (m + p - 1)``)."""

from __future__ import annotations

import pytest
import torch

from shardkit.bench.cases_pp_schedules import CHUNKS, _Chunk, _theory
from shardkit.pipeline_parallel.split_backward import input_grad, weight_grad


def test_the_chunk_splits_its_backward_cost_into_i_and_w(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr("shardkit.bench.cases_pp_schedules.time.sleep", slept.append)
    busy = [0.0]
    chunk = _Chunk(f=0.001, i=0.002, w=0.003, busy=busy)
    x = torch.ones(1, 8, requires_grad=True)
    y = chunk(x)
    assert slept == [0.001] and torch.equal(y, torch.ones(1, 8))
    gx, pending = input_grad(x, y, list(chunk.parameters()), torch.ones(1, 8))
    assert slept == [0.001, 0.002] and chunk.weight.grad is None and torch.equal(gx, torch.ones(1, 8))
    weight_grad(pending)
    assert slept == [0.001, 0.002, 0.003] and torch.equal(chunk.weight.grad, torch.ones(8))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8)])
def test_the_theory_is_each_tables_simulated_bubble(p, m):
    costs = {"F": 1.0, "I": 1.0, "W": 1.0}
    theory = {name: _theory(name, p, m, costs) for name in CHUNKS}
    assert theory["1f1b"] == pytest.approx((p - 1) / (m + p - 1))
    assert theory["interleaved-1f1b"] < theory["1f1b"]
    assert theory["zb-h1"] < theory["1f1b"] and theory["zbv"] < theory["zb-h1"]
    assert theory["dualpipev"] < theory["1f1b"]
