"""apply_tp on plain user modules with hand-written plans: every non-MoE style, uneven and empty
shards (torch.chunk semantics), a fused GQA qkv projection, tied weights, the plan check, errors.

Parity as in test_apply_tp: float64, rtol 1e-9 for outputs, input gradients and every parameter
gradient gathered from the shards.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness.helpers import rank, world_group
from shardkit import ShardkitError, ShardkitTypeError
from shardkit.tensor_parallel import (
    PackedColwiseParallel,
    RowwiseParallel,
    apply_tp,
    gather_full_grads,
    gather_full_state_dict,
    shard_spec,
    verify_tp_plan,
)

RTOL = 1e-9


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item() if b.norm() > 0 else (a - b).norm().item()


class MLP(nn.Module):
    def __init__(self, hidden=6, inner=10):
        super().__init__()
        self.up = nn.Linear(hidden, inner)
        self.down = nn.Linear(inner, hidden)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class FusedAttention(nn.Module):
    """GQA attention with one fused qkv projection [q | k | v] of unequal parts (N=4, N_kv=2)."""

    def __init__(self, hidden=12, heads=4, kv_heads=2, head_dim=3):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.qkv = nn.Linear(hidden, (heads + 2 * kv_heads) * head_dim)
        self.o = nn.Linear(heads * head_dim, hidden)

    def forward(self, x):
        B, S, _ = x.shape
        # Local head counts follow the (updated) out_features, as model code reading attributes does.
        total = self.qkv.out_features // self.head_dim
        kv = total * self.kv_heads // (self.heads + 2 * self.kv_heads)
        q, k, v = self.qkv(x).view(B, S, total, self.head_dim).split([total - 2 * kv, kv, kv], dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(out.transpose(1, 2).reshape(B, S, -1))


class Tiny(nn.Module):
    def __init__(self, vocab=16, hidden=12):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.attn = FusedAttention(hidden)
        self.mlp = MLP(hidden, 10)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.attn(h)
        h = h + self.mlp(h)
        return self.head(h)


def _pair(cls, *args, seed=0):
    torch.manual_seed(seed)
    ref = cls(*args).double()
    model = cls(*args).double()
    model.load_state_dict(ref.state_dict())
    return ref, model


def _check_grads(ref, model):
    grads = gather_full_grads(model)
    bad = {n: _rel(grads[n], p.grad) for n, p in ref.named_parameters() if _rel(grads[n], p.grad) > RTOL}
    assert not bad, bad
    state = gather_full_state_dict(model)
    assert all(torch.equal(state[n], p.detach()) for n, p in ref.named_parameters())


@pytest.mark.world(3)
def test_colwise_rowwise_intermediate_10_on_3_ranks():
    """The pair that crashes PyTorch DTensor TP (pytorch#150336): chunks [4, 4, 2]."""
    ref, model = _pair(MLP, 6, 10)
    apply_tp(model, world_group(), {"up": "colwise", "down": "rowwise"})
    assert model.up.weight.shape[0] == [4, 4, 2][rank()] and model.up.out_features == [4, 4, 2][rank()]
    x = torch.randn(2, 5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y = ref(x_ref), model(x_tp)
    y_ref.square().sum().backward()
    y.square().sum().backward()
    assert _rel(y.detach(), y_ref.detach()) <= RTOL and _rel(x_tp.grad, x_ref.grad) <= RTOL
    _check_grads(ref, model)


@pytest.mark.world(4)
def test_empty_shards():
    """Inner size 5 on 4 ranks: chunks [2, 2, 1, 0]; rank 3 holds empty weights and still works."""
    ref, model = _pair(MLP, 6, 5)
    apply_tp(model, world_group(), {"up": "colwise", "down": "rowwise"})
    assert model.up.weight.shape == ([2, 2, 1, 0][rank()], 6)
    x = torch.randn(3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    y_ref, y = ref(x), model(x)
    y_ref.sum().backward()
    y.sum().backward()
    assert _rel(y.detach(), y_ref.detach()) <= RTOL
    _check_grads(ref, model)


@pytest.mark.world(2)
@pytest.mark.parametrize("embed", ["embedding_rowwise", "embedding_colwise"])
def test_fused_gqa_qkv_embedding_and_gathered_head(embed):
    """Fused qkv [q 12 | k 6 | v 6] rows: each rank gets its heads of each part (q 2, k 1, v 1)."""
    ref, model = _pair(Tiny)
    plan = {
        "embed": embed,
        "attn.qkv": PackedColwiseParallel(parts=[12, 6, 6], unit=3),
        "attn.o": RowwiseParallel(unit=3),
        "mlp.up": "colwise",
        "mlp.down": "rowwise",
        "head": "colwise_gather_output",
    }
    apply_tp(model, world_group(), plan, check="error")
    spec = shard_spec(model.attn.qkv.weight)
    assert spec.ranges[rank()] == [((0, 6), (12, 15), (18, 21)), ((6, 12), (15, 18), (21, 24))][rank()]
    ids = torch.randint(0, 16, (2, 7), generator=torch.Generator().manual_seed(3))
    y_ref, y = ref(ids), model(ids)
    F.cross_entropy(y_ref.flatten(0, 1), ids.flatten()).backward()
    F.cross_entropy(y.flatten(0, 1), ids.flatten()).backward()
    assert _rel(y.detach(), y_ref.detach()) <= RTOL
    _check_grads(ref, model)


@pytest.mark.world(2)
def test_rowwise_split_input_and_tied_weights():
    """rowwise_split_input on a replicated input; a weight tied between an embedding_rowwise
    table and a colwise head is cut once and stays shared."""

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(9, 6)
            self.proj = nn.Linear(6, 6)
            self.head = nn.Linear(6, 9, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids):
            return self.head(self.proj(self.embed(ids)))

    ref, model = _pair(Tied)
    model.head.weight = model.embed.weight
    apply_tp(
        model,
        world_group(),
        {"embed": "embedding_rowwise", "proj": "rowwise_split_input", "head": "colwise_gather_output"},
        check="error",
    )
    assert model.head.weight is model.embed.weight and model.embed.num_embeddings == [5, 4][rank()]
    ids = torch.randint(0, 9, (3, 4), generator=torch.Generator().manual_seed(4))
    y_ref, y = ref(ids), model(ids)
    y_ref.square().sum().backward()
    y.square().sum().backward()
    assert _rel(y.detach(), y_ref.detach()) <= RTOL
    _check_grads(ref, model)


def test_verify_tp_plan_lists_unused_rules_and_unsharded_parameters():
    model = Tiny()
    report = verify_tp_plan(model, {"mlp.up": "colwise", "mlp.down": "rowwise", "layers.*.nothing": "colwise"})
    assert report.unused_rules == ("layers.*.nothing",)
    assert set(report.unsharded) == {
        "embed.weight",
        "attn.qkv.weight",
        "attn.qkv.bias",
        "attn.o.weight",
        "attn.o.bias",
        "head.weight",
    }
    assert not report.ok


@pytest.mark.world(2)
def test_bad_plans_raise_on_every_rank():
    with pytest.raises(ShardkitError, match="unknown style"):
        apply_tp(MLP(), world_group(), {"up": "colwize"})
    with pytest.raises(ShardkitTypeError, match="no 2-D weight"):
        apply_tp(nn.Sequential(nn.GELU()), world_group(), {"0": "colwise"}, check="off")
    with pytest.raises(ShardkitError, match="matched nothing"):
        apply_tp(MLP(), world_group(), {"up": "colwise", "down": "rowwise", "nope": "colwise"}, check="error")
    with pytest.raises(ShardkitError, match="several plan rules"):
        apply_tp(MLP(), world_group(), {"up": "colwise", "u*": "rowwise", "down": "rowwise"}, check="off")


def test_chunk_semantics_match_torch_chunk():
    """Shards follow torch.chunk (and DTensor Shard): 16 rows on 14 ranks -> eight 2s, six empty."""
    from shardkit._shapes import chunk_sizes

    assert chunk_sizes(16, 14) == [2] * 8 + [0] * 6
    for n in range(0, 30):
        for r in range(1, 9):
            chunks = [len(c) for c in torch.arange(n).chunk(r)] if n else []
            assert chunk_sizes(n, r) == chunks + [0] * (r - len(chunks))
