"""Pipeline x tensor parallelism, stages of equal or different tp sizes (VTP): GPipe and 1F1B
losses and every parameter gradient against one process (float64, rtol 1e-9).

The model is a stack of residual MLP blocks ``x + down(tanh(up(x)))``. Inside a stage of tp
size t > 1 a block is either Megatron TP (replicated ``[B, S, H]`` in and out: ``f``, colwise
``up``, rowwise ``down`` with an all-reduce) or sequence parallel (``[B, S / t, H]``: sequence
all-gather, colwise, rowwise with a reduce-scatter, the ``down`` bias summed over tp), so the
stage boundaries see Replicate and Shard(1) layouts over different tp sizes. Microbatches have
different sequence lengths.
"""

import copy

import pytest
import torch
from torch import nn

from harness.helpers import all_true, rank, subgroup, world_group
from shardkit._shapes import balanced_split_sizes
from shardkit.comm import all_gather, gather_forward_split_backward, split_forward_gather_backward
from shardkit.errors import ShardkitError
from shardkit.pipeline_parallel import PipelineStage, gpipe_schedule, one_f_one_b_schedule, run_schedule
from shardkit.pipeline_parallel.vtp import Replicate, Shard
from shardkit.sharding import StageGroups, shard_spec
from shardkit.tensor_parallel.styles import ColwiseParallel, RowwiseParallel

H, F, LAYERS = 4, 6, 6
SCHEDULES = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(H, F, dtype=torch.float64), nn.Linear(F, H, dtype=torch.float64)
        self.mode, self.tp = None, None

    def forward(self, x):
        h = all_gather(x, self.tp, 1) if self.mode == "sp" else x  # "megatron": the colwise style adds f
        return x + self.down(torch.tanh(self.up(h)))


class Edge(nn.Module):
    """Enter (split) or leave (gather) the sequence-parallel region at the pipeline's ends."""

    def __init__(self, fn, tp):
        super().__init__()
        self.fn, self.tp = fn, tp

    def forward(self, x):
        return self.fn(x, self.tp, 1)


def _model():
    torch.manual_seed(4321)
    return nn.Sequential(*[Block() for _ in range(LAYERS)])


def _slice(model, s, P):
    sizes = balanced_split_sizes(LAYERS, P)
    start = sum(sizes[:s])
    return list(model)[start : start + sizes[s]]


def _stage_module(blocks, tp, mode, first, last):
    t = tp.size()
    mods = []
    if mode == "sp" and first:
        mods.append(Edge(split_forward_gather_backward, tp))
    for b in blocks:
        if t > 1:
            b.mode, b.tp = mode, tp
            # Megatron: the style's f on the input; SP: the gather's reduce-scatter sums instead.
            ColwiseParallel(balanced_split_sizes(F, t), reduce_input_grad=mode != "sp").apply(b.up, tp)
            # SP: reduce-scatter along the sequence; the style sums the down bias's gradient over tp.
            out = Shard(1) if mode == "sp" else Replicate()
            RowwiseParallel(balanced_split_sizes(F, t), output_layouts=out).apply(b.down, tp)
        mods.append(b)
    if mode == "sp" and last:
        mods.append(Edge(gather_forward_split_backward, tp))
    return nn.Sequential(*mods)


def _mse(out, target):
    return ((out - target) ** 2).mean()


def _data(M):
    gen = torch.Generator().manual_seed(7)
    lens = [4 + 2 * (m % 3) for m in range(M)]  # even: sequence-parallel blocks split evenly
    return (
        [torch.randn(2, S, H, generator=gen, dtype=torch.float64) for S in lens],
        [torch.randn(2, S, H, generator=gen, dtype=torch.float64) for S in lens],
    )


def _groups(stage_ranks):
    tps = [subgroup(tuple(r)) for r in stage_ranks]
    s = next(s for s, r in enumerate(stage_ranks) if rank() in r)
    return StageGroups(world_group(), stage_ranks, tps[s]), tps[s]


def _close(got, ref):
    return got is not None and got.shape == ref.shape and torch.allclose(got, ref, rtol=1e-9, atol=1e-14)


def _shard_of(ref_grad, param, tp_rank):
    spec = shard_spec(param)
    if spec is None:
        return ref_grad
    return torch.cat([ref_grad.narrow(spec.dim, a, b - a) for a, b in spec.ranges[tp_rank]], spec.dim)


def _parity(stage_ranks, modes, schedule_name, M=4):
    groups, tp = _groups(stage_ranks)
    s, P, i = groups.stage_index, groups.num_stages, groups.tp_rank
    full = _model()
    xs, ts = _data(M)
    full.zero_grad()
    ref_losses = [_mse(full(x), t) for x, t in zip(xs, ts)]
    (sum(ref_losses) / M).backward()
    blocks = copy.deepcopy(_slice(full, s, P))
    for b in blocks:
        b.zero_grad()
    mode = modes[s] if len(stage_ranks[s]) > 1 else None
    module = _stage_module(blocks, tp, mode, s == 0, s == P - 1)
    layout = Shard(1) if mode == "sp" else Replicate()
    stage = PipelineStage(
        module, groups, s, P, loss_fn=_mse if s == P - 1 else None, in_layout=layout, out_layout=layout
    )
    losses = run_schedule(stage, SCHEDULES[schedule_name](P, M), xs if s == 0 else None, ts if s == P - 1 else None)
    ok = losses is None if s < P - 1 else all(_close(a, b.detach()) for a, b in zip(losses, ref_losses, strict=True))
    for b, ref in zip(blocks, _slice(full, s, P), strict=True):
        for p, r in zip(b.parameters(), ref.parameters(), strict=True):
            ok &= _close(p.grad, _shard_of(r.grad, p, i))
    # the same stages evaluated (the forward-only table through the tp-group transport): the
    # same losses, no gradient touched
    grads = [p.grad.clone() for b in blocks for p in b.parameters()]
    with torch.no_grad():
        evals = run_schedule(stage, SCHEDULES[schedule_name](P, M), xs if s == 0 else None, ts if s == P - 1 else None)
    ok &= evals is None if s < P - 1 else all(_close(a, b.detach()) for a, b in zip(evals, ref_losses, strict=True))
    ok &= all(torch.equal(g, p.grad) for g, p in zip(grads, (p for b in blocks for p in b.parameters())))
    assert all_true(ok)


SCHED = pytest.mark.parametrize("schedule_name", sorted(SCHEDULES))


@pytest.mark.world(4, timeout=30)
@SCHED
@pytest.mark.parametrize("modes", [("megatron", "megatron"), ("sp", "sp"), ("sp", "megatron")], ids="-".join)
def test_uniform_tp2_pp2(schedule_name, modes):
    _parity([[0, 1], [2, 3]], modes, schedule_name)


@pytest.mark.world(4, timeout=30)
@SCHED
@pytest.mark.parametrize("mode", ["megatron", "sp"])
def test_vtp_2_1_1(schedule_name, mode):
    _parity([[0, 1], [2], [3]], (mode, None, None), schedule_name)


@pytest.mark.world(3, timeout=30)
@SCHED
@pytest.mark.parametrize("mode", ["megatron", "sp"])
def test_vtp_1_2(schedule_name, mode):
    _parity([[0], [1, 2]], (None, mode), schedule_name, M=3)


@pytest.mark.world(3, timeout=30)
def test_partial_input_grads_are_summed_over_the_stage():
    """Stage 1 (tp=2) starts with a colwise linear without ``f``: its input gradients are partial
    sums per rank, and ``input_grad="partial"`` sums them before they go back."""
    groups, tp = _groups([[0], [1, 2]])
    s, i = groups.stage_index, groups.tp_rank
    torch.manual_seed(3)
    up, down = nn.Linear(H, F, dtype=torch.float64), nn.Linear(F, H, dtype=torch.float64)
    first = nn.Linear(H, H, dtype=torch.float64)
    xs, ts = _data(2)
    ref = [_mse(down(torch.tanh(up(first(x)))), t) for x, t in zip(xs, ts)]
    (sum(ref) / 2).backward()
    if s == 0:
        module = copy.deepcopy(first)
        module.zero_grad()
    else:
        module = nn.Sequential(copy.deepcopy(up), nn.Tanh(), copy.deepcopy(down))
        module.zero_grad()
        ColwiseParallel(balanced_split_sizes(F, 2), reduce_input_grad=False).apply(module[0], tp)
        RowwiseParallel(balanced_split_sizes(F, 2)).apply(module[2], tp)
    stage = PipelineStage(module, groups, s, 2, loss_fn=_mse if s == 1 else None, input_grad="partial")
    run_schedule(stage, one_f_one_b_schedule(2, 2), xs, ts)
    refs = [first] if s == 0 else [up, None, down]
    ok = True
    for m, r in zip(module if s else [module], refs):
        for p, rp in zip(m.parameters(), r.parameters() if r is not None else []):
            ok &= _close(p.grad, _shard_of(rp.grad, p, i))
    assert all_true(ok)


@pytest.mark.world(3, timeout=30)
def test_stage_layouts_that_differ_within_a_stage_raise_on_every_rank():
    groups, _ = _groups([[0], [1, 2]])
    s = groups.stage_index
    layout = Shard(1) if rank() == 2 else Replicate()
    with pytest.raises(ShardkitError, match=r"stage 1: rank 2 passed layouts \(Shard\(1\)"):
        PipelineStage(nn.Identity(), groups, s, 2, loss_fn=_mse, in_layout=layout)
    with pytest.raises(ShardkitError, match=r"rank 1: stage_index=0 but this rank is in stage 1"):
        PipelineStage(nn.Identity(), groups, 0 if rank() == 1 else s, 2, loss_fn=_mse)
    stage = PipelineStage(nn.Identity(), groups, s, 2, loss_fn=_mse)
    xs = [torch.zeros(1, 2, 3)] * 2
    with pytest.raises(ShardkitError, match=r"rank 2: stage 1 holds chunk 1 and needs 2 targets_microbatches"):
        run_schedule(stage, gpipe_schedule(2, 2), xs, xs if rank() < 2 else xs[:1])
    with pytest.raises(ShardkitError, match=r"ranks \[1\] passed boundary_shapes"):
        run_schedule(
            stage,
            gpipe_schedule(2, 2),
            xs,
            xs,
            boundary_shapes=[((1, 2, 3), torch.float32 if rank() == 1 else torch.float64)],
        )
    losses = run_schedule(stage, gpipe_schedule(2, 2), xs, xs, boundary_shapes=[((1, 2, 3), torch.float32)])
    assert all_true(s == 0 or [float(v) for v in losses] == [0.0, 0.0])
