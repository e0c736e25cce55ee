"""Numerical checks used by the communication tests (run inside a rank).

Adjoint identity for a linear communication op ``A`` (docs/design.md, Testing): with a random
cotangent ``y`` different on every rank, ``sum_r <A x, y>_r == sum_r <x, A^T y>_r`` where
``A^T y`` comes from autograd. float64 relative error <= 1e-12; a backward scaled by the world
size misses by about 1e-1. Per-rank ``gradcheck`` is not used: it fails on correct collectives
because each rank only sees its own term of the sum.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def coords(shape, dtype=torch.float64, scale=1.0, offset=0.0) -> torch.Tensor:
    """Coordinate-encoded tensor: element value = offset + scale * (global linear index)."""
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=dtype) * scale + offset).view(*shape)


def world_sum(values: list[float]) -> list[float]:
    """Sum a few float64 scalars over the world group."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, group=dist.group.WORLD)
    return t.tolist()


def cotangent(shape, dtype=torch.float64, replicated=False) -> torch.Tensor:
    """A random cotangent; different on every rank unless ``replicated``."""
    seed = 1234 if replicated else 1234 + 7919 * (dist.get_rank() + 1)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=dtype)


def adjoint_error(op, x: torch.Tensor, *, replicated_cotangent=False, lhs_once=False, rhs_once=False) -> float:
    """Relative error of ``sum_r <op(x), y> == sum_r <x, grad>``.

    Args:
        op: the function under test, ``y = op(x)``.
        x: float64 input (a leaf; grad is enabled here).
        replicated_cotangent: draw the same ``y`` on every rank (for ops whose output is
            replicated and whose backward assumes a replicated gradient).
        lhs_once: the output is one variable replicated on every rank (a loss computed
            identically everywhere and counted once); count ``<op(x), y>`` once.
        rhs_once: ``x`` is one variable replicated on every rank; count ``<x, grad>`` once
            (rank 0's term) instead of summing over ranks.
    """
    x = x.detach().requires_grad_(True)
    y = op(x)
    w = cotangent(y.shape, y.dtype, replicated=replicated_cotangent)
    (gx,) = torch.autograd.grad(y, x, grad_outputs=w)
    lhs = float((y.detach() * w).sum())
    rhs = float((x.detach() * gx).sum())
    if lhs_once and dist.get_rank() != 0:
        lhs = 0.0
    if rhs_once and dist.get_rank() != 0:
        rhs = 0.0
    lhs, rhs = world_sum([lhs, rhs])
    return abs(lhs - rhs) / max(abs(lhs), abs(rhs), 1e-300)
