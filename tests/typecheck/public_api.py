"""A typed user of the public API, checked by mypy (tests/test_typing.py), never executed.

mypy sees shardkit the way an installed user does (through ``py.typed``); a signature that
rejects a documented use, or returns a type a user cannot work with, fails here.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import shardkit
from shardkit import Group


def layouts(mesh: DeviceMesh, tp: Group) -> torch.Tensor:
    sizes: list[int] = shardkit.balanced_split_sizes(15, 2)
    q = torch.randn(1, sizes[0], 5, 8)
    heads: torch.Tensor = shardkit.all_to_all(q, tp, scatter_dim=2, gather_dim=1, gather_size=15)
    full: torch.Tensor = shardkit.all_gather(q, mesh["tp"], dim=1, sizes=sizes)
    part: torch.Tensor = shardkit.reduce_scatter(full, tp, dim=1, sizes=sizes)
    x = shardkit.split_forward_gather_backward(full, tp, dim=1, sizes=sizes, grad_scale="down")
    y = shardkit.gather_forward_split_backward(x, tp, dim=1, sizes=sizes)
    with shardkit.checks(True), shardkit.CommLedger() as ledger:
        z = shardkit.all_reduce_forward(shardkit.all_reduce_backward(y, tp), tp)
    count: int = ledger.count("all_to_all_single")
    return heads.sum() + part.sum() + z.sum() + count


def models(model: nn.Module, tp: Group, cp: DeviceMesh) -> None:
    report = shardkit.verify_tp_plan(model)
    assert report.ok
    shardkit.apply_tp(model, tp, shardkit.ep_plan(model), loss_parallel=True, check="error")
    ctx: shardkit.CPContext = shardkit.apply_cp(model, cp, "ulysses")
    assert ctx is not None
    state: dict[str, torch.Tensor] = shardkit.gather_full_state_dict(model)
    assert state
    shardkit.save_sharded_checkpoint(model, "ckpt", tp)
    shardkit.load_sharded_checkpoint(model, "ckpt", tp)
    shardkit.load_sharded(model, "hf-checkpoint", tp, device="cpu")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: Group, mesh2d: DeviceMesh) -> torch.Tensor:
    a = shardkit.ulysses_attention(q, k, v, cp, causal=True, seq_len=15)
    b = shardkit.ring_attention(q, k, v, cp, causal=True, seq_len=15)
    c = shardkit.usp_attention(q, k, v, mesh2d, causal=True, seq_len=15)
    s = shardkit.zigzag_split(torch.arange(15.0), cp, dim=0)
    return a + b + c + shardkit.zigzag_gather(s, cp, dim=0, seq_len=15).sum()


def experts(hidden: torch.Tensor, topk: torch.Tensor, weights: torch.Tensor, ep: Group) -> torch.Tensor:
    plan = shardkit.dispatch_plan(topk, 8, ep)
    tokens, per_expert = shardkit.token_dispatch(hidden, plan)
    assert sum(per_expert) == tokens.shape[0]
    return shardkit.token_combine(tokens, plan, weights)


def pipeline(stage_module: nn.Module, pp: Group, batch: torch.Tensor) -> list[torch.Tensor] | None:
    stage = shardkit.PipelineStage(stage_module, pp, 0, 2, loss_fn=nn.functional.mse_loss)
    schedule = shardkit.one_f_one_b_schedule(2, 4)
    return shardkit.run_schedule(stage, schedule, shardkit.split_microbatches(batch, 4))


def spatial(model: nn.Module, group: Group, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    shardkit.apply_spatial(model, group, dim=-1)
    y = shardkit.spatial_conv2d(x, w, None, group, dim=-1, padding=1)
    halo = shardkit.halo_exchange(y, group, dim=-1, left=1, right=1)
    conv = shardkit.SpatialConv2d(3, 4, 3, padding=1, group=group, dim=-1)
    norm = shardkit.SpatialGroupNorm(2, 4, group=group)
    return norm(conv(halo))
