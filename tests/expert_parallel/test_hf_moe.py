"""Expert-parallel transformers MoE (Qwen3-MoE, its own modeling code) against the unsharded model.

Parity (docs/design.md, Testing), float64: output, input gradient, router gradient and every expert
parameter gradient (this rank's slice of the full gradient) to rtol 1e-9, for the all-to-all
mode with replicated or sharded tokens and the all-reduce (``ep_router``) mode; E = 6 or 5
experts over R = 2, 3, 4 (uneven blocks, ranks without tokens).
"""

import copy

import pytest
import torch
from torch import nn

from harness.helpers import all_true, rank, world_group, world_size
from shardkit import ShardkitError, all_reduce_backward, all_reduce_forward, balanced_split_sizes
from shardkit._shapes import split_offsets
from shardkit.comm import CommLedger
from shardkit.expert_parallel import expert_shard, identity_expert_parallel, shard_expert_param, shard_experts

RTOL = 1e-9
H = 16
# The first test of a fresh world imports transformers in every rank: slow on a loaded machine.
WALL = 180


def _config(num_experts=6, layers=1):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=50,
        hidden_size=H,
        intermediate_size=24,
        moe_intermediate_size=8,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=num_experts,
        num_experts_per_tok=2,
        use_cache=False,
        experts_implementation="eager",
        norm_topk_prob=True,
    )


def _block(num_experts, force_rank0=False):
    """A float64 Qwen3MoeSparseMoeBlock with O(1) weights; ``force_rank0`` routes every token to
    the experts of rank 0 (feature 0 of the input is set to 10 by ``_tokens``)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(_config(num_experts)).double()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, dtype=p.dtype) * 0.5)
        if force_rank0:
            n0 = balanced_split_sizes(num_experts, world_size())[0]
            block.gate.weight[:, 0] = -5.0
            block.gate.weight[:n0, 0] = 5.0
    return block


def _tokens(seed, rows, force_rank0=False):
    x = torch.randn(1, rows, H, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    if force_rank0:
        x[..., 0] = 10.0
    return x


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item() if b.norm() > 0 else (a - b).norm().item()


def _run(block, x, c):
    x = x.clone().requires_grad_(True)
    out = block(x)
    (out * c).sum().backward()
    return out.detach(), x.grad


def _errors(ref, sharded, out, ref_out, gx, ref_gx, router_grad):
    """Relative errors of everything compared; expert grads are this rank's slices."""
    errs = {"out": _rel(out, ref_out), "x.grad": _rel(gx, ref_gx), "router": _rel(router_grad, ref.gate.weight.grad)}
    for name, p in sharded.experts.named_parameters():
        shard = expert_shard(p)
        off = split_offsets(shard.sizes)[rank()]
        full = getattr(ref.experts, name).grad[off : off + shard.sizes[rank()]]
        errs[name] = float("inf") if p.grad is None else _rel(p.grad, full)
    return errs


CASES = [  # (num_experts, rows, force_rank0)
    (6, 7, False),
    (5, 9, False),  # uneven expert blocks for R = 2, 3, 4
    (6, 3, False),  # fewer tokens than ranks for R = 4: a rank with an empty token block
    (6, 8, True),  # every token to rank 0's experts: the other ranks receive nothing
]


def _check_replicated(mode, num_experts, rows, force):
    ref, block = _block(num_experts, force), _block(num_experts, force)
    shard_experts(block.experts, world_group(), mode=mode, tokens="replicated")
    x, c = _tokens(1, rows, force), _tokens(2, rows)
    ref_out, ref_gx = _run(ref, x, c)
    out, gx = _run(block, x, c)
    errs = _errors(ref, block, out, ref_out, gx, ref_gx, block.gate.weight.grad)
    assert all_true(max(errs.values()) <= RTOL), errs


@pytest.mark.world(2, timeout=WALL)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mode", ["dispatch", "local"])
def test_replicated_r2(mode, case):
    _check_replicated(mode, *case)


@pytest.mark.world(3, timeout=WALL)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mode", ["dispatch", "local"])
def test_replicated_r3(mode, case):
    _check_replicated(mode, *case)


@pytest.mark.world(4, timeout=WALL)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mode", ["dispatch", "local"])
def test_replicated_r4(mode, case):
    _check_replicated(mode, *case)


@pytest.mark.world(1, timeout=WALL)
@pytest.mark.parametrize("mode", ["dispatch", "local"])
def test_replicated_r1(mode):
    _check_replicated(mode, 6, 7, False)


@pytest.mark.world(4, timeout=WALL)
@pytest.mark.parametrize("num_experts", [6, 5])
@pytest.mark.parametrize("force", [False, True])
def test_sharded_tokens_r4(num_experts, force):
    _check_sharded(num_experts, force)


@pytest.mark.world(3, timeout=WALL)
def test_sharded_tokens_r3():
    _check_sharded(5, False)


def _check_sharded(num_experts, force):
    """Each rank routes its own tokens (rows 4, 0, 5, 2): the reference runs them all at once."""
    R, me = world_size(), rank()
    rows = [[4, 0, 5, 2][r] for r in range(R)]
    xs = [_tokens(10 + r, rows[r], force) for r in range(R)]
    cs = [_tokens(20 + r, rows[r]) for r in range(R)]
    ref, block = _block(num_experts, force), _block(num_experts, force)
    shard_experts(block.experts, world_group(), tokens="sharded")
    ref_out, ref_gx = _run(ref, torch.cat(xs, 1), torch.cat(cs, 1))
    out, gx = _run(block, xs[me], cs[me])
    lo, n = split_offsets(rows)[me], rows[me]
    # The router is replicated: its per-rank gradients are partial sums (data parallel).
    router = all_reduce_forward(block.gate.weight.grad, world_group())
    errs = _errors(ref, block, out, ref_out[:, lo : lo + n], gx, ref_gx[:, lo : lo + n], router)
    if n == 0:
        errs.update(out=0.0 if out.numel() == 0 else 1.0, **{"x.grad": 0.0 if gx.numel() == 0 else 1.0})
    assert all_true(max(errs.values()) <= RTOL), errs


@pytest.mark.world(2, timeout=WALL)
def test_whole_model_r2():
    """Qwen3MoeForCausalLM, 2 layers, every experts module sharded: logits and all gradients."""
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    ref = Qwen3MoeForCausalLM(_config(6, layers=2)).double()
    model = copy.deepcopy(ref)
    for layer in model.model.layers:
        shard_experts(layer.mlp.experts, world_group())
    ids = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(3))
    outs = []
    for m in (ref, model):
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        outs.append(out.logits.detach())
    errs = {"logits": _rel(outs[1], outs[0])}
    full = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        g = full[name].grad
        shard = expert_shard(p)
        if shard is not None:
            off = split_offsets(shard.sizes)[rank()]
            g = g[off : off + shard.sizes[rank()]]
        errs[name] = _rel(p.grad, g)
    assert all_true(max(errs.values()) <= RTOL), errs


@pytest.mark.world(3, timeout=WALL)
@pytest.mark.parametrize("mode,tokens", [("dispatch", "replicated"), ("dispatch", "sharded"), ("local", "replicated")])
def test_ledger(mode, tokens):
    block = _block(6)
    shard_experts(block.experts, world_group(), mode=mode, tokens=tokens)
    x = _tokens(1, 7).requires_grad_(True)
    with CommLedger() as fwd:
        out = block(x)
    with CommLedger() as bwd:
        out.sum().backward()
    if mode == "local":
        assert (fwd.count(), fwd.count(api="all_reduce_forward")) == (1, 1)
        assert (bwd.count(), bwd.count(api="all_reduce_backward")) == (1, 1)
        return
    for api in ("dispatch_plan", "token_dispatch", "token_combine"):
        assert fwd.count(api=api, op="all_to_all_single") == 1
    assert bwd.count(api="token_dispatch") == bwd.count(api="token_combine") == 1
    gathers = 1 if tokens == "replicated" else 0  # 7 rows over 3 ranks: uneven gather
    assert fwd.count(api="gather_forward_split_backward") == gathers and fwd.count() == 3 + gathers
    assert bwd.count(api="split_forward_gather_backward") == gathers and bwd.count() == 2 + gathers


@pytest.mark.world(2, timeout=WALL)
def test_sharding_metadata_and_errors():
    block = _block(5)
    full = block.experts.down_proj.detach().clone()
    p = shard_expert_param(block.experts, "down_proj", world_group())
    sizes = balanced_split_sizes(5, 2)
    off = split_offsets(sizes)[rank()]
    assert torch.equal(p, full[off : off + sizes[rank()]]) and block.experts.num_experts == sizes[rank()]
    assert expert_shard(p).sizes == (3, 2) and expert_shard(p).dim == 0 and expert_shard(p).num_experts == 5
    shard_experts(block.experts, world_group())  # shards the remaining gate_up_proj only
    assert block.experts.gate_up_proj.shape[0] == sizes[rank()] and block.experts.down_proj is p
    with pytest.raises(ShardkitError):
        shard_experts(_block(6).experts, world_group(), mode="local", tokens="sharded")
    with pytest.raises(ShardkitError):
        shard_experts(_block(6).experts, world_group(), mode="all_to_all")
    with pytest.raises(ShardkitError):
        shard_experts(_block(6).experts, world_group(), expert_sizes=[6, 1])


class _ToyTPExperts(nn.Module):
    """A TP-summed experts stand-in: one dense expert (column/row split) plus an identity expert."""

    def __init__(self, inner=6):
        super().__init__()
        torch.manual_seed(4)
        self.up = nn.Linear(H, inner, bias=False).double()
        self.down = nn.Linear(inner, H, bias=False).double()
        self.identity_expert = nn.Identity()

    def forward(self, x):
        return self.down(torch.tanh(self.up(x))) + self.identity_expert(x)


@pytest.mark.world(3, timeout=WALL)
def test_identity_expert_under_summed_output():
    ref, toy = _ToyTPExperts(), _ToyTPExperts()
    g, sizes = world_group(), balanced_split_sizes(6, world_size())
    lo, n = split_offsets(sizes)[rank()], sizes[rank()]
    with torch.no_grad():  # tensor-parallel dense expert: rank r keeps block r of the inner dim
        toy.up.weight = nn.Parameter(ref.up.weight[lo : lo + n].clone())
        toy.down.weight = nn.Parameter(ref.down.weight[:, lo : lo + n].clone())
    identity_expert_parallel(toy.identity_expert, g)
    x, c = _tokens(5, 4), _tokens(6, 4)
    ref_out, ref_gx = _run(ref, x, c)
    xs = x.clone().requires_grad_(True)
    out = all_reduce_forward(toy(all_reduce_backward(xs, g)), g)
    (out * c).sum().backward()
    errs = [
        _rel(out.detach(), ref_out),
        _rel(xs.grad, ref_gx),
        _rel(toy.up.weight.grad, ref.up.weight.grad[lo : lo + n]),
    ]
    assert all_true(max(errs) <= RTOL), errs
