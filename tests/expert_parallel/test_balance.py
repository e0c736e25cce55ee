"""Router load balancing: DeepSeek-V3's bias (selection only, sign update, same on every rank),
its sequence-wise balance loss and the ST-MoE z-loss, each against the formula written out."""

import math

import pytest
import torch

from harness.helpers import all_true, rank, world_group
from shardkit import ShardkitError
from shardkit.expert_parallel.balance import (
    biased_topk,
    expert_load,
    router_z_loss,
    sequence_balance_loss,
    update_router_bias_,
)


def _scores(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).sigmoid()


def test_bias_moves_selection_not_weights():
    scores = _scores(1, 6, 4).requires_grad_(True)
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0], dtype=torch.float64)  # expert 3 always selected
    w, idx = biased_topk(scores, bias, 2)
    assert (idx == 3).any(1).all()
    assert torch.equal(w, scores.detach().gather(1, idx))  # unbiased scores of the chosen experts
    w.sum().backward()
    assert torch.equal(scores.grad, torch.zeros_like(scores).scatter(1, idx, 1.0))
    w0, idx0 = biased_topk(scores, None, 2)
    assert torch.equal(idx0, scores.detach().topk(2, dim=1).indices)
    with pytest.raises(ShardkitError, match="k must be"):
        biased_topk(scores, bias, 5)
    with pytest.raises(ShardkitError, match="bias must be"):
        biased_topk(scores, bias[:3], 2)


def test_bias_update_is_the_sign_rule():
    load = torch.tensor([5.0, 1.0, 3.0, 3.0], dtype=torch.float64)  # mean 3
    bias = torch.tensor([0.5, 0.0, -0.1, 0.0])
    update_router_bias_(bias, load, 0.01)
    assert torch.allclose(bias, torch.tensor([0.49, 0.01, -0.1, 0.0]), rtol=0, atol=1e-7)
    with pytest.raises(ShardkitError, match="rate"):
        update_router_bias_(bias, load, -1.0)


@pytest.mark.world(2)
def test_load_and_bias_identical_on_every_rank():
    """Each rank routes different tokens; the all-reduced load and the updated bias agree."""
    idx = torch.tensor([[0, 1], [0, 2], [0, 1]]) if rank() == 0 else torch.tensor([[3, 1], [3, 2]])
    load = expert_load(idx, 4, world_group())
    bias = torch.zeros(4)
    update_router_bias_(bias, load, 0.1)
    ok = torch.equal(load, torch.tensor([3.0, 3.0, 2.0, 2.0], dtype=torch.float64))
    ok = ok and torch.equal(bias, torch.tensor([-0.1, -0.1, 0.1, 0.1]))  # mean 2.5
    assert all_true(ok), (load, bias)
    assert torch.equal(expert_load(idx, 4), torch.bincount(idx.reshape(-1), minlength=4).double())


def test_sequence_balance_loss_against_the_formula():
    B, S, E, k, alpha = 2, 5, 4, 2, 0.01
    scores = _scores(2, B, S, E).requires_grad_(True)
    idx = scores.detach().topk(k, dim=-1).indices
    got = sequence_balance_loss(scores, idx, alpha)
    want = 0.0
    for b in range(B):
        for i in range(E):
            f = E / (k * S) * sum(int(i in idx[b, t].tolist()) for t in range(S))
            p = sum(scores[b, t, i] / scores[b, t].sum() for t in range(S)) / S
            want = want + f * p
    want = alpha * want / B
    assert torch.allclose(got, want, rtol=1e-12, atol=0)
    g1, g2 = torch.autograd.grad(got, scores)[0], torch.autograd.grad(want, scores)[0]
    assert torch.allclose(g1, g2, rtol=1e-10, atol=1e-15)


def test_z_loss_against_the_formula():
    logits = torch.randn(3, 2, 5, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    logits.requires_grad_(True)
    got = router_z_loss(logits, 1e-3)
    flat = logits.reshape(-1, 5)
    want = 1e-3 * sum(math.log(sum(math.exp(v) for v in row.tolist())) ** 2 for row in flat) / flat.shape[0]
    assert abs(got.item() - want) <= 1e-12 * want
    assert torch.autograd.gradcheck(lambda x: router_z_loss(x, 1e-3), (logits,))
