"""Unbalanced stage counts per rank (torch's ``ScheduleUnbalanced`` test: 5 stages on 2 ranks,
3 on one and 2 on the other; our own port of its facts).

A :class:`~shardkit.pipeline_parallel.PipelineStage` holds the same ``v`` chunks on every rank (a
table's rows and the placement assume it), so ``3 + 2`` stages run as ``v = 3`` looped chunks
with a pass-through (``nn.Identity``) as the short rank's third chunk: ``3+2``, rank 0 holds
stages 0, 2 and 4, rank 1 stages 1 and 3 and the pass-through (global chunk 5, whose output is
stage 4's: the loss is computed there); ``2+3``, the pass-through is rank 0's global chunk 4.
Every looped table with ``v = 3`` then runs it, the I/W tables included (a pass-through's input
gradient is its output's: before that fix, ``2+3`` under ``interleaved-zb`` sent zeros).
Checked: losses and every parameter gradient against one process's backprop (float64, 1e-12).
Passing the uneven module lists themselves is refused at construction, on every rank, naming
the counts (before any step).
"""

import copy

import pytest
import torch
from torch import nn

from harness.helpers import all_true, rank, world_group
from harness.pipe_models import mse, tanh_mlp
from shardkit.errors import ShardkitError
from shardkit.pipeline_parallel import PipelineStage, run_schedule

H, STAGES = 4, 5  # five one-layer stages: rank 0 runs three of them, rank 1 two


def _stages(model):
    return [nn.Sequential(model[2 * s], model[2 * s + 1]) for s in range(STAGES)]


def _data(m):
    gen = torch.Generator().manual_seed(11)
    xs = [torch.randn(2, 3, H, generator=gen, dtype=torch.float64) for _ in range(m)]
    return xs, [torch.randn(2, 3, H, generator=gen, dtype=torch.float64) for _ in range(m)]


# rank -> its stages, in local chunk order; None: a pass-through chunk
LAYOUTS = {"3+2": ([0, 2, 4], [1, 3, None]), "2+3": ([0, 2, None], [1, 3, 4])}


@pytest.mark.world(2, timeout=120)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(("name", "m"), [("interleaved-1f1b", 4), ("looped-bfs", 3), ("interleaved-zb", 4)])
def test_three_plus_two_stages_equal_one_process(name, m, layout):
    """``2+3``: the pass-through is a middle chunk (global 4, on rank 0), so its input gradient
    is a message of its own: under ``interleaved-zb``'s I step too."""
    r = rank()
    full = tanh_mlp(H, STAGES, seed=99)
    xs, ts = _data(m)
    full.zero_grad()
    refs = [mse(full(x), t) for x, t in zip(xs, ts)]
    (sum(refs) / m).backward()
    stages = copy.deepcopy(_stages(full))
    held = LAYOUTS[layout][r]
    mine = [nn.Identity() if s is None else stages[s] for s in held]
    stage = PipelineStage(mine, world_group(), loss_fn=mse)
    losses = run_schedule(stage, name, xs, ts, num_microbatches=m)
    ok = (losses is None) if r == 0 else all(torch.allclose(a, b) for a, b in zip(losses, refs, strict=True))
    for mod, s in zip(mine, held, strict=True):
        if s is None:
            continue
        for a, b in zip(mod.parameters(), _stages(full)[s].parameters(), strict=True):
            ok &= a.grad is not None and torch.allclose(a.grad, b.grad, rtol=1e-12, atol=1e-12)
    assert all_true(ok), (name, r)


@pytest.mark.world(2, timeout=60)
def test_uneven_module_lists_are_refused_on_every_rank_before_any_step():
    full = tanh_mlp(H, STAGES, seed=99)
    stages = _stages(full)
    mine = [stages[0], stages[1], stages[4]] if rank() == 0 else [stages[2], stages[3]]  # torch's placement
    with pytest.raises(ShardkitError, match=r"rank 1 has \(v, placement\) \[2, 'looped'\], rank 0 \[3, 'looped'\]"):
        PipelineStage(mine, world_group(), loss_fn=mse)
