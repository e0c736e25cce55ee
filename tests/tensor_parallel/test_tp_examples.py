"""PyTorch's own TP example test ``test_mlp_training`` (test/distributed/tensor/parallel/
test_tp_examples.py), ported to shardkit's styles.

Facts carried over: ``MLPModule`` is ``Linear(10, 16) -> ReLU -> Linear(16, 10)`` with biases,
input ``[8, 10]`` per rank, plan ``net1: ColwiseParallel(input_layouts=Shard(0))``, ``net2:
RowwiseParallel(output_layouts=Shard(0))`` with sequence parallelism (each rank's rows differ:
seeded by rank) or plain ``ColwiseParallel`` / ``RowwiseParallel`` (same input everywhere), SGD
with lr 0.25, loss ``output.sum()``; the single-device reference sees every rank's rows. Here:
float64 and rtol 1e-9 (project rule), several iterations, and an uneven row split.

The sequence-parallel case is the regression test of the row-parallel bias: with its output
reduce-scattered, each rank adds the replicated bias to its own rows only, so its gradient must be
summed over tp; without the sum it is found at about ``1 / R`` of the reference.
"""

import copy

import pytest
import torch
from torch import nn

from harness.helpers import rank, world_group, world_size
from shardkit import CommLedger, Replicate, Shard
from shardkit.tensor_parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    apply_tp,
    gather_full_grads,
    gather_full_state_dict,
)

RTOL = 1e-9
LR = 0.25
STEPS = 3


class MLPModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.split = nn.Identity()  # a place for the sequence split of a replicated input
        self.net1 = nn.Linear(10, 16, dtype=torch.float64)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(16, 10, dtype=torch.float64)

    def forward(self, x):
        return self.net2(self.relu(self.net1(self.split(x))))


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item() if b.norm() > 0 else (a - b).norm().item()


def _rows(n, seed):
    return torch.rand(n, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _train(seq_parallel: bool, rows: list[int] | None):
    """Train the reference and the tp model side by side; return the worst relative errors."""
    torch.manual_seed(0)
    model = MLPModule()
    model_tp = copy.deepcopy(model)
    R = world_size()
    if seq_parallel:
        plan = {"net1": ColwiseParallel(input_layouts=Shard(0)), "net2": RowwiseParallel(output_layouts=Shard(0))}
        if rows is not None:  # a replicated input, split unevenly by the model itself
            plan["split"] = PrepareModuleInput(Replicate(), Shard(0))
    else:
        plan = {"net1": ColwiseParallel(), "net2": RowwiseParallel()}
    apply_tp(model_tp, world_group(), plan, check="off")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    opt_tp = torch.optim.SGD(model_tp.parameters(), lr=LR)
    worst = {"output": 0.0, "grad": 0.0, "param": 0.0}
    for step in range(STEPS):
        if not seq_parallel:
            full = local_in = _rows(8, 100 + step)  # the same input on every rank
            local_rows = slice(None)
        elif rows is None:  # every rank holds its own 8 rows (PyTorch seeds by rank)
            parts = [_rows(8, 10 * step + r) for r in range(R)]
            full, local_in = torch.cat(parts), parts[rank()]
            local_rows = slice(8 * rank(), 8 * rank() + 8)
        else:
            full = local_in = _rows(sum(rows), 100 + step)
            start = sum(rows[: rank()])
            local_rows = slice(start, start + rows[rank()])
        out = model(full)
        out.sum().backward()
        out_tp = model_tp(local_in)
        out_tp.sum().backward()
        grads = gather_full_grads(model_tp)
        worst["output"] = max(worst["output"], _rel(out_tp.detach(), out.detach()[local_rows]))
        worst["grad"] = max(worst["grad"], *(_rel(grads[n], p.grad) for n, p in model.named_parameters()))
        opt.step()
        opt_tp.step()
        opt.zero_grad()
        opt_tp.zero_grad()
        params = gather_full_state_dict(model_tp)
        worst["param"] = max(worst["param"], *(_rel(params[n], p.detach()) for n, p in model.named_parameters()))
    return worst, model_tp


@pytest.mark.world(2)
@pytest.mark.parametrize("seq_parallel", [True, False])
def test_mlp_training(seq_parallel):
    worst, _ = _train(seq_parallel, None)
    assert all(v <= RTOL for v in worst.values()), worst


@pytest.mark.world(3)
def test_mlp_training_sequence_parallel_uneven_rows():
    """17 rows over 3 ranks (6, 6, 5), split by PrepareModuleInput(Replicate(), Shard(0))."""
    worst, _ = _train(True, [6, 6, 5])
    assert all(v <= RTOL for v in worst.values()), worst


@pytest.mark.world(2)
def test_mlp_sequence_parallel_collectives():
    """Forward: one all-gather of the rows (net1) and one reduce-scatter (net2); backward: the
    reduce-scatter's all-gather and the bias gradient's all-reduce (the input needs no gradient)."""
    torch.manual_seed(0)
    model = MLPModule()
    apply_tp(
        model,
        world_group(),
        {"net1": ColwiseParallel(input_layouts=Shard(0)), "net2": RowwiseParallel(output_layouts=Shard(0))},
        check="off",
    )
    with CommLedger() as fwd:
        out = model(_rows(8, rank()))
    with CommLedger() as bwd:
        out.sum().backward()
    assert (fwd.count(api="all_gather"), fwd.count(api="reduce_scatter"), fwd.count()) == (1, 1, 2), fwd.summary()
    assert (bwd.count(api="reduce_scatter", phase="backward"), bwd.count(api="sum_grad_over"), bwd.count()) == (
        1,
        1,
        2,
    ), bwd.summary()
