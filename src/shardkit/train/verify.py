"""``--verify``: rerun the same steps in one process and compare with the parallel run.

The reference is the same trainer with every degree 1: the unsharded model from the same
initial weights on the full global batch of every step (same sampler seed), with the same
optimizer, clipping and loss normalization. Differences then come only
from floating-point summation order (tp partial sums, dp averaging), so they sit at rounding
level: the tolerances below are far above it and far below any real bug (a missing or doubled
gradient reduction shows up as an O(1) relative difference).
"""

from __future__ import annotations

import math

import torch

__all__ = ["TOLERANCES", "relative_diff", "compare_runs"]

# Max relative difference allowed per dtype, for per-step losses and final parameters alike.
# Measured with the default run (20 steps, tp=2 x dp=2): float32 loss 2e-7 / params 1e-6,
# float64 loss 2e-16 / params 4e-15. bfloat16: the reference also runs in bfloat16 (same
# dtype, same ops), so the parameters end up about one bfloat16 rounding apart (2^-8 = 3.9e-3;
# measured 4e-3 to 5e-3, loss 7e-5 to 9e-5); 2e-2, about five roundings, is a loose bound that
# still catches a missing or doubled gradient reduction.
TOLERANCES = {"float32": 1e-4, "float64": 1e-9, "bfloat16": 2e-2}


def relative_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64 (``||a - b||`` when ``b`` is all zeros)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if a.shape != b.shape:
        return math.inf
    num, den = (a - b).norm().item(), b.norm().item()
    return num / den if den > 0 else num


def compare_runs(
    losses,
    ref_losses,
    params: dict,
    ref_params: dict,
    dtype: str,
    top: int = 5,
    grad_norms: tuple | None = None,
    moe_loads: tuple | None = None,
) -> dict:
    """Per-step loss and final-parameter differences of two runs, against the dtype tolerance.

    Args:
        losses: per-step losses of the parallel run.
        ref_losses: per-step losses of the reference run.
        params: final full parameters ``{name: tensor}`` of the parallel run.
        ref_params: the same of the reference run.
        dtype: training dtype name, selects the tolerance in :data:`TOLERANCES`.
        top: how many of the largest parameter differences to list.
        grad_norms: ``(norms, ref_norms)``, the per-step global gradient norms of both runs
            (checked against the same tolerance: clipping must see the single-process norm).
        moe_loads: ``(loads, ref_loads)``, per step the ``[layers][E]`` expert load counts of
            both runs (``--moe-*`` flags): the parallel run's all-reduced load must be the
            reference's load over the whole batch (relative to its total, same tolerance).

    Returns:
        A JSON-ready dict: ``tolerance``, ``loss_rel_diff`` (per step), ``max_loss_rel_diff``,
        ``max_param_rel_diff``, ``worst_params`` (``[name, diff]`` largest first),
        ``missing_params`` and ``passed``.
    """
    tol = TOLERANCES[dtype]
    loss_diffs = [abs(a - b) / abs(b) if b != 0 else abs(a - b) for a, b in zip(losses, ref_losses)]
    if len(losses) != len(ref_losses):
        loss_diffs.append(math.inf)
    missing = sorted(set(params) ^ set(ref_params))
    param_diffs = {name: relative_diff(params[name], ref_params[name]) for name in ref_params if name in params}
    worst = sorted(param_diffs.items(), key=lambda kv: kv[1], reverse=True)[:top]
    max_loss = max(loss_diffs, default=0.0)
    max_param = max(param_diffs.values(), default=0.0)
    norm_diffs = []
    if grad_norms is not None:
        norm_diffs = [abs(a - b) / abs(b) if b != 0 else abs(a - b) for a, b in zip(*grad_norms)]
    max_norm = max(norm_diffs, default=0.0)
    load_diffs = []
    if moe_loads is not None:
        for a, b in zip(*moe_loads):
            a_t, b_t = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
            load_diffs.append(math.inf if a_t.shape != b_t.shape else ((a_t - b_t).abs().sum() / b_t.sum()).item())
        if len(moe_loads[0]) != len(moe_loads[1]):
            load_diffs.append(math.inf)
    max_load = max(load_diffs, default=0.0)
    return {
        "dtype": dtype,
        "tolerance": tol,
        "loss_rel_diff": loss_diffs,
        "max_loss_rel_diff": max_loss,
        "max_param_rel_diff": max_param,
        "worst_params": [[name, d] for name, d in worst],
        "max_grad_norm_rel_diff": max_norm,
        **({"max_moe_load_rel_diff": max_load} if moe_loads is not None else {}),
        "missing_params": missing,
        "passed": max_loss <= tol and max_param <= tol and max_norm <= tol and max_load <= tol and not missing,
    }
