"""Expert ids outside ``[0, E)`` from a custom router: one clear error, never a silent drop.

``routed_experts_forward`` (tensor-parallel experts, the ``ep_router`` all-reduce mode, and the
eager experts loop the trainer swaps in) sorted every id outside its own block into the "held
elsewhere" bucket, so an id ``>= E`` or ``< 0`` contributed nothing on every rank: a silently
dropped route. The all-to-all dispatch already refused them (:func:`dispatch_plan`); these tests
pin both paths. The check rides in the counts' one device read (no extra host sync).

Parity first (float64, exact): with valid ids the sort-based sum equals a loop of
:func:`expert_forward` over the (token, slot) pairs, so the check changed nothing else.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from harness.helpers import world_group, world_size
from harness.limits import patient
from shardkit.errors import ShardkitError
from shardkit.expert_parallel import expert_forward, routed_experts_forward, shard_experts

E, H, T, K = 4, 8, 6, 2


def _experts():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(
        vocab_size=16,
        hidden_size=H,
        moe_intermediate_size=4,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=4,
        num_experts=E,
        num_experts_per_tok=K,
        experts_implementation="eager",
    )
    torch.manual_seed(0)
    experts = Qwen3MoeSparseMoeBlock(config).double().experts
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, dtype=p.dtype) * 0.5)
    return experts


def _inputs(bad: int | None = None):
    """Tokens ``x[t, h] = (t + 1) / 10 + h / 100`` (coordinate-encoded), ids cycling through the
    experts, weights ``(t + 1) * (j + 1) / 10``; ``bad`` replaces one id (token 3, slot 1)."""
    t, h = torch.arange(T, dtype=torch.float64)[:, None], torch.arange(H, dtype=torch.float64)[None]
    x = (t + 1) / 10 + h / 100
    idx = (torch.arange(T)[:, None] + torch.arange(K)[None] * 3) % E
    w = (t + 1) * torch.arange(1, K + 1, dtype=torch.float64)[None] / 10
    if bad is not None:
        idx[3, 1] = bad
    return x, idx, w


def test_valid_ids_equal_the_loop_of_experts():
    experts = _experts()
    x, idx, w = _inputs()
    want = torch.zeros_like(x)
    for t in range(T):
        for j in range(K):
            want[t] += w[t, j] * expert_forward(experts, int(idx[t, j]), x[t : t + 1])[0]
    torch.testing.assert_close(routed_experts_forward(experts, x, idx, w, 0), want, rtol=1e-12, atol=0)


@pytest.mark.parametrize("bad", [E, E + 7, -1])
def test_out_of_range_id_raises(bad):
    x, idx, w = _inputs(bad)
    with pytest.raises(ShardkitError, match=rf"routed_experts_forward: 1 expert ids outside \[0, {E}\)"):
        routed_experts_forward(_experts(), x, idx, w, 0)


def test_block_of_experts_checks_the_global_range():
    """A module holding experts 2..3 (``offset`` 2): ids 0..1 are held elsewhere (no error, no
    contribution), id ``E`` is out of range (error) once ``num_experts`` is given; without it
    only negative ids can be told apart."""
    full = _experts()
    block = _experts()
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.data = getattr(full, name).detach()[2:].clone()
    x, idx, w = _inputs()
    held = (idx >= 2).to(w.dtype)
    want = routed_experts_forward(full, x, idx, w * held, 0)  # the routes to 2..3 only
    got = routed_experts_forward(block, x, idx, w, 2, num_experts=E)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    x, idx, w = _inputs(E)
    with pytest.raises(ShardkitError, match=r"outside \[0, 4\)"):
        routed_experts_forward(block, x, idx, w, 2, num_experts=E)
    x, idx, w = _inputs(-3)
    with pytest.raises(ShardkitError, match=r"outside \[0, E\)"):
        routed_experts_forward(block, x, idx, w, 2)


def _same_error_on_every_rank(fn, fragment: str) -> str:
    start = time.monotonic()
    with pytest.raises(ShardkitError, match=fragment) as info:
        fn()
    assert time.monotonic() - start < patient(30.0)  # raised, not a wait for the group's timeout
    msgs = [None] * world_size()
    dist.all_gather_object(msgs, str(info.value), group=world_group())
    assert len(set(msgs)) == 1, msgs
    return msgs[0]


@pytest.mark.world(2)
@pytest.mark.parametrize(
    "options",
    [dict(mode="local"), dict(mode="dispatch"), dict(mode="local", capacity_factor=1.0)],
    ids=["ep_router (all-reduce)", "all-to-all dispatch", "ep_router with capacity"],
)
@pytest.mark.parametrize("bad", [E, -1])
def test_expert_parallel_out_of_range_id_raises_on_every_rank(options, bad):
    experts = shard_experts(_experts(), world_group(), tokens="replicated", **options)
    x, idx, w = _inputs(bad)
    _same_error_on_every_rank(lambda: experts(x, idx, w), r"expert ids outside \[0, 4\)")
    x, idx, w = _inputs()  # the group is usable after, and valid ids run
    assert torch.isfinite(experts(x, idx, w)).all()
