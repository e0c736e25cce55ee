"""``--verify``'s tolerance is tight where it must be: each dtype's bound tested at 0.5x (passes)
and 2x (fails) for every compared quantity, and a whole ``--verify`` run with a one-line bug
injected (one rank's gradients scaled by 1 + 1e-3 after the data-parallel sum) fails.

Found by mutation testing: loosening every tolerance 1000x left the suite green, because the
tolerance was only tested at 1.0 and 1e-6.
"""

import io
import time
from unittest import mock

import pytest
import torch
from rich.console import Console

from harness.helpers import rank, world_size
from shardkit.cli.report import print_parity
from shardkit.data_parallel import GradientSync
from shardkit.train.config import TrainConfig, validate_config
from shardkit.train.run import train
from shardkit.train.verify import TOLERANCES, compare_runs

# The documented bounds (src/shardkit/train/verify.py), written out: the cases below are built from
# these numbers, not from TOLERANCES, so a loosened or tightened tolerance fails them.
BOUNDS = {"float64": 1e-9, "float32": 1e-4, "bfloat16": 2e-2}
REF = {"w": torch.linspace(-1.0, 2.0, 12, dtype=torch.float64), "b": torch.full((3,), 0.5, dtype=torch.float64)}


def _compare(dtype: str, what: str, factor: float) -> dict:
    """``compare_runs`` with one quantity off by ``factor`` x the dtype's tolerance (relative)."""
    rel = factor * BOUNDS[dtype]
    params = {k: v.clone() for k, v in REF.items()}
    losses, norms = [2.0, 1.5], [0.8, 0.6]
    if what == "loss":
        losses = [2.0, 1.5 * (1 + rel)]
    elif what == "param":
        params["w"] = REF["w"] * (1 + rel)  # ||w (1 + rel) - w|| / ||w|| = rel
    else:
        norms = [0.8 * (1 + rel), 0.6]
    return compare_runs(losses, [2.0, 1.5], params, REF, dtype, grad_norms=(norms, [0.8, 0.6]))


@pytest.mark.parametrize("what", ["loss", "param", "grad_norm"])
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_tolerance_bound_at_half_passes_and_at_twice_fails(dtype, what):
    half, twice = _compare(dtype, what, 0.5), _compare(dtype, what, 2.0)
    key = {"loss": "max_loss_rel_diff", "param": "max_param_rel_diff", "grad_norm": "max_grad_norm_rel_diff"}[what]
    assert half[key] == pytest.approx(0.5 * BOUNDS[dtype], rel=1e-6)
    assert twice[key] == pytest.approx(2.0 * BOUNDS[dtype], rel=1e-6)
    assert half["passed"] and not twice["passed"]
    assert half["tolerance"] == twice["tolerance"] == TOLERANCES[dtype]
    if what == "param":
        assert twice["worst_params"][0][0] == "w"


@pytest.mark.world(4)
def test_verify_run_with_an_injected_gradient_bug_fails_clearly():
    """Default layout (dp_replicate=2 x tp=2), float64, 2 steps: rank 1 scales its gradients by
    1 + 1e-3 after the dp sum (a one-line bug). The parallel run must disagree with the
    one-process reference and the printed verdict must say FAILED and name a parameter."""
    cfg = validate_config(
        TrainConfig(steps=2, seq_len=16, batch_size=4, dtype="float64", verify=True), world_size=world_size()
    )
    original = GradientSync.reduce

    def buggy(self):
        original(self)
        if self.mesh is not None and rank() == 1:
            for p, _ in self.params:
                if p.grad is not None:
                    p.grad.mul_(1 + 1e-3)

    with mock.patch.object(GradientSync, "reduce", buggy):
        result = train(cfg, "gloo", torch.device("cpu"), time.perf_counter(), progress=False)
    if rank() != 0:
        return
    parity = result["parity"]
    assert not parity["passed"], parity
    assert parity["max_param_rel_diff"] > 10 * parity["tolerance"]
    assert parity["max_grad_norm_rel_diff"] > 10 * parity["tolerance"]
    out = io.StringIO()
    print_parity(parity, Console(file=out, width=120))
    text = out.getvalue()
    assert "FAILED" in text and parity["worst_params"][0][0] in text
