"""The balanced router (``expert_parallel.router``) on transformers' own MoE routers: the same
routing as the router's forward without bias, the bias in the selection only, the auxiliary
losses' gradients equal to those of the losses written out and added to the objective, and the
load counted once per forward (not again in an activation checkpoint's recompute)."""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from shardkit import ShardkitError
from shardkit.expert_parallel.router import BIAS_BUFFER, balance_state, install_balanced_router

transformers = pytest.importorskip("transformers")

E, K, H, S, B = 4, 2, 8, 5, 3


def _router(kind: str, dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "qwen":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

        cfg = transformers.Qwen3MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=K, norm_topk_prob=True)
        router = Qwen3MoeTopKRouter(cfg)
    else:
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

        cfg = transformers.DeepseekV2Config(
            hidden_size=H,
            num_attention_heads=2,
            num_key_value_heads=2,
            n_routed_experts=E,
            num_experts_per_tok=K,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.5,
        )
        router = DeepseekV2TopkRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape))
    return router.to(dtype)


def _hidden(dtype=torch.float32, seed=1):
    return torch.randn(B * S, H, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _sorted(weights, index):
    order = index.argsort(dim=1)
    return weights.gather(1, order), index.gather(1, order)


@pytest.mark.parametrize("kind", ["qwen", "deepseek"])
def test_without_bias_and_losses_it_routes_as_the_router(kind):
    router = _router(kind)
    x = _hidden()
    logits, w, idx = router(x)
    install_balanced_router(router)
    logits2, w2, idx2 = router(x)
    assert torch.equal(logits, logits2)
    a, b = _sorted(w, idx), _sorted(w2, idx2)
    assert torch.equal(a[1], b[1]) and torch.allclose(a[0], b[0], rtol=1e-6, atol=0)
    state = balance_state(router)
    assert BIAS_BUFFER not in router._buffers
    # the load: every (token, slot) pair of the call, once
    assert torch.equal(state.load, torch.bincount(idx.reshape(-1), minlength=E).double())


@pytest.mark.parametrize("kind", ["qwen", "deepseek"])
def test_bias_moves_the_selection_not_the_weights(kind):
    router = _router(kind, torch.float64)
    x = _hidden(torch.float64)
    install_balanced_router(router, bias_rate=0.1)
    bias = router._buffers[BIAS_BUFFER]
    assert bias.dtype == torch.float32 and torch.equal(bias, torch.zeros(E))
    bias[2] = 10.0  # expert 2 always selected
    logits, w, idx = router(x)
    assert (idx == 2).any(1).all()
    probs = torch.softmax(logits, dim=-1).gather(1, idx)
    want = probs * 1.5 if kind == "deepseek" else probs / probs.sum(1, keepdim=True)
    torch.testing.assert_close(w, want, rtol=1e-12, atol=0)
    assert "e_score_correction_bias" in router.state_dict()  # saved with the module


@pytest.mark.parametrize("kind", ["qwen", "deepseek"])
def test_aux_losses_give_the_gradient_of_the_losses_added(kind):
    router = _router(kind, torch.float64)
    ref = _router(kind, torch.float64)
    x = _hidden(torch.float64).requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    zc, sc, tok, seq = 0.3, 0.7, 1.0 / 60, 1.0 / 12  # global counts larger than this call's
    install_balanced_router(router, z_loss=zc, seq_aux_loss=sc, token_scale=tok, seq_scale=seq, seq_len=S)
    _, w, idx = router(x)
    (w * torch.arange(1.0, K + 1, dtype=w.dtype)).sum().backward()
    # the reference: the router's math in float64 (transformers' Qwen3 router would round its
    # softmax to float32), the losses written out and added to the objective
    logits = x_ref @ ref.weight.T
    probs_all = torch.softmax(logits, dim=-1)
    idx_ref = probs_all.topk(K, dim=1).indices.sort(dim=1).values
    w_ref = probs_all.gather(1, idx_ref)
    w_ref = w_ref * 1.5 if kind == "deepseek" else w_ref / w_ref.sum(1, keepdim=True)
    order = idx.argsort(dim=1)
    assert torch.equal(idx.gather(1, order), idx_ref)
    weights = torch.arange(1.0, K + 1, dtype=w.dtype).expand_as(w).gather(1, order)
    lse = torch.logsumexp(logits, dim=-1)
    z = zc * tok * (lse**2).sum()
    probs = torch.softmax(logits, dim=-1).view(B, S, E)
    hits = torch.zeros(B, E, dtype=probs.dtype).scatter_add_(
        1, idx_ref.view(B, -1), torch.ones(B, S * K, dtype=probs.dtype)
    )
    f = hits * E / (K * S)
    p = (probs / probs.sum(-1, keepdim=True)).mean(1)
    seq_loss = sc * seq * (f * p).sum()
    ((w_ref * weights).sum() + z + seq_loss).backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(router.weight.grad, ref.weight.grad, rtol=1e-12, atol=1e-15)
    state = balance_state(router)
    torch.testing.assert_close(state.aux, torch.stack([z, seq_loss]).detach(), rtol=1e-12, atol=0)


def test_load_is_counted_once_under_activation_checkpointing_and_not_in_eval():
    router = _router("qwen")
    install_balanced_router(router, bias_rate=0.0, z_loss=0.1, token_scale=1 / 15)
    x = _hidden().requires_grad_(True)
    out = checkpoint(lambda t: router(t)[1], x, use_reentrant=False)
    out.sum().backward()  # the recompute runs inside the backward
    state = balance_state(router)
    assert state.load.sum().item() == B * S * K
    with torch.no_grad():
        router(x)
    assert state.load.sum().item() == B * S * K
    state.reset()
    assert state.load.sum().item() == 0 and state.aux.sum().item() == 0


def test_bad_arguments():
    router = _router("qwen")
    with pytest.raises(ShardkitError, match="bias_rate must be >= 0"):
        install_balanced_router(router, bias_rate=-1.0)
    with pytest.raises(ShardkitError, match="z_loss must be >= 0"):
        install_balanced_router(router, z_loss=float("nan"))
    with pytest.raises(ShardkitError, match="not a known transformers top-k router"):
        install_balanced_router(torch.nn.Linear(2, 2))
    install_balanced_router(router, seq_aux_loss=0.1, seq_len=4)
    with pytest.raises(ShardkitError, match="not whole sequences of 4"):
        router(_hidden())
