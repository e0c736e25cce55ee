"""Expert capacity and token dropping (Megatron-LM's ``moe_expert_capacity_factor``).

1. The keep mask against a plain-Python statement of the rule (per expert, sort its pairs by
   weight then token, or by token; keep the first ``ceil(T k / E f)``), ties included.
2. Our own port of what Megatron-LM's ``test_token_dispatcher`` capacity cases check, on gloo
   worlds of 2 and 4 ranks (every rank routes its own 16 tokens over 8 experts, top-2, factor
   0.5): no local expert receives more than ``C * R`` rows; with identity experts and weights
   ``1 / k`` the combined output is ``hidden * kept / k`` and so is the input gradient under the
   cotangent ``hidden``; with ``pad_to_capacity`` every local expert receives exactly ``C * R``
   rows and the output and gradient equal the unpadded run.
3. Parity: a Qwen3-MoE block with expert parallelism and capacity against the one-process block
   whose experts get the reference rule's dropped weights zeroed (HF's own expert loop), float64:
   output, input, router and expert gradients to rtol 1e-9.
"""

import math

import pytest
import torch

from harness.helpers import all_true, rank, world_group, world_size
from shardkit import ShardkitError
from shardkit._shapes import split_offsets
from shardkit.comm import CommLedger
from shardkit.expert_parallel import (
    dispatch_plan,
    ep_experts_forward,
    expert_shard,
    shard_experts,
    token_combine,
    token_dispatch,
)
from shardkit.expert_parallel.capacity import apply_capacity, expert_capacity

RTOL = 1e-9
H = 16
WALL = 180  # the first test of a fresh world imports transformers in every rank


def _block(num_experts):
    """A float64 Qwen3MoeSparseMoeBlock (top-2, normalized weights) with O(1) weights, seed 0."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(
        hidden_size=H, moe_intermediate_size=8, num_experts=num_experts, num_experts_per_tok=2,
        experts_implementation="eager", norm_topk_prob=True,
    )  # fmt: skip
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(config).double()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, dtype=p.dtype) * 0.5)
    return block


def _tokens(seed, rows):
    return torch.randn(1, rows, H, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _run(block, x, c):
    x = x.clone().requires_grad_(True)
    out = block(x)
    (out * c).sum().backward()
    return out.detach(), x.grad


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item() if b.norm() > 0 else (a - b).norm().item()


def _errors(ref, sharded, out, ref_out, gx, ref_gx, router_grad):
    """Relative errors of the output, input and router gradients, and this rank's expert gradients."""
    errs = {"out": _rel(out, ref_out), "x.grad": _rel(gx, ref_gx), "router": _rel(router_grad, ref.gate.weight.grad)}
    for name, p in sharded.experts.named_parameters():
        shard = expert_shard(p)
        off = split_offsets(shard.sizes)[rank()]
        full = getattr(ref.experts, name).grad[off : off + shard.sizes[rank()]]
        errs[name] = float("inf") if p.grad is None else _rel(p.grad, full)
    return errs


def _ref_keep(idx, w, num_experts, factor, policy):
    """The rule, stated directly: per expert, its routed pairs in priority order, the first C kept."""
    T, k = idx.shape
    cap = math.ceil(T * k / num_experts * factor)
    keep = torch.zeros(T, k, dtype=torch.bool)
    for e in range(num_experts):
        pairs = [(t, j) for t in range(T) for j in range(k) if int(idx[t, j]) == e]
        if policy == "probs":
            pairs.sort(key=lambda p: (-float(w[p]), p[0]))
        for t, j in pairs[:cap]:
            keep[t, j] = True
    return keep


def _routing(seed, T, k, E, ties=False):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(T, E, generator=gen, dtype=torch.float64)
    w, idx = scores.softmax(-1).topk(k, dim=1)
    if ties:  # equal weights everywhere: "probs" falls back to token order
        w = torch.full_like(w, 1.0 / k)
    return idx, w


def test_capacity_formula():
    assert expert_capacity(16, 2, 8, 0.5) == 2  # Megatron's get_capacity(16 * 2, 8, 0.5)
    assert expert_capacity(10, 2, 8, 1.0) == 3 and expert_capacity(7, 1, 4, 1.25) == 3
    assert expert_capacity(0, 2, 8, 1.0) == 0


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("T,k,E,f,ties", [(16, 2, 8, 0.5, False), (13, 3, 5, 1.0, False), (9, 2, 4, 0.3, True),
                                          (6, 2, 4, 8.0, False), (0, 2, 4, 1.0, False)])  # fmt: skip
def test_keep_mask_against_the_rule(policy, T, k, E, f, ties):
    idx, w = _routing(T + 7 * k, T, k, E, ties)
    got = apply_capacity(idx, w, E, f, drop_policy=policy)
    assert got.capacity == expert_capacity(T, k, E, f)
    assert torch.equal(got.keep, _ref_keep(idx, w, E, f, policy))
    assert got.topk_index is idx and got.topk_weights is w
    padded = apply_capacity(idx, w, E, f, drop_policy=policy, pad_to_capacity=True)
    assert tuple(padded.keep.shape) == (T, E)
    assert padded.keep.sum(0).tolist() == [min(got.capacity, T)] * E  # every expert exactly full
    routed = torch.zeros(T, E, dtype=torch.bool).scatter(1, idx, got.keep)
    assert torch.equal(padded.keep & (padded.topk_weights != 0), routed)  # kept pairs; fillers weigh 0
    assert torch.equal(padded.topk_weights, torch.zeros(T, E, dtype=w.dtype).scatter(1, idx, w * got.keep))


def test_errors():
    idx, w = _routing(1, 4, 2, 4)
    for kwargs, err in [
        (dict(capacity_factor=0.0), "capacity_factor must be > 0"),
        (dict(capacity_factor=1.0, drop_policy="random"), "drop_policy must be one of"),
        (dict(capacity_factor=float("inf")), "finite"),
    ]:
        f = kwargs.pop("capacity_factor")
        with pytest.raises(ShardkitError, match=err):
            apply_capacity(idx, w, 4, f, **kwargs)
    with pytest.raises(ShardkitError, match="bool"):
        apply_capacity(idx, w, 4, 1.0, pad_to_capacity=1)
    with pytest.raises(ShardkitError, match=r"\[T, k\]"):
        apply_capacity(idx, w[:, :1], 4, 1.0)
    with pytest.raises(ShardkitError, match="pad_to_capacity needs a capacity_factor"):
        shard_experts(_block(4).experts, None, pad_to_capacity=True)


E, K, T, F = 8, 2, 16, 0.5


def _dispatch_identity(hidden, idx, w, keep):
    """Megatron's dispatcher test body: dispatch, identity experts, combine; returns output and counts."""
    plan = dispatch_plan(idx, E, world_group(), keep=keep)
    x, counts = token_dispatch(hidden, plan)
    return token_combine(x, plan, w), counts


def _megatron_capacity_case(policy):
    R, me = world_size(), rank()
    hidden = torch.randn(T, 16, generator=torch.Generator().manual_seed(50 + me), dtype=torch.float64)
    idx, probs = _routing(60 + me, T, K, E)
    cap = expert_capacity(T, K, E, F)
    failures = []
    routing = apply_capacity(idx, probs, E, F, drop_policy=policy)
    ones = torch.full_like(probs, 1.0 / K)  # Megatron's test sets the kept probs to 1 / topk
    x = hidden.clone().requires_grad_(True)
    out, counts = _dispatch_identity(x, idx, ones, routing.keep)
    answer = hidden * routing.keep.sum(1, keepdim=True) / K
    if not all(c <= cap * R for c in counts):
        failures.append(f"counts {counts} above C * R = {cap * R}")
    out.backward(hidden)
    if not (torch.equal(out.detach(), answer) and torch.equal(x.grad, answer)):
        failures.append("output or gradient differs from hidden * kept / k")
    # drop and pad (Megatron's drop_and_pad case): the routing weights themselves this time; padding
    # changes nothing but the row counts, exactly C * R per local expert
    x1 = hidden.clone().requires_grad_(True)
    out1, _ = _dispatch_identity(x1, idx, probs, routing.keep)
    out1.backward(hidden)
    padded = apply_capacity(idx, probs, E, F, drop_policy=policy, pad_to_capacity=True)
    x2 = hidden.clone().requires_grad_(True)
    out2, counts2 = _dispatch_identity(x2, padded.topk_index, padded.topk_weights, padded.keep)
    out2.backward(hidden)
    if counts2 != [cap * R] * len(counts2):
        failures.append(f"padded counts {counts2} != C * R = {cap * R}")
    if not (torch.allclose(out2, out1, rtol=1e-15, atol=0) and torch.allclose(x2.grad, x1.grad, rtol=1e-15, atol=0)):
        failures.append("padded output or gradient differs from the unpadded")
    if not bool((~routing.keep).any()):
        failures.append("the case drops nothing")
    assert all_true(not failures), failures


@pytest.mark.world(2, timeout=WALL)
@pytest.mark.parametrize("policy", ["probs", "position"])
def test_megatron_capacity_cases_ep2(policy):
    _megatron_capacity_case(policy)


@pytest.mark.world(4, timeout=WALL)
@pytest.mark.parametrize("policy", ["probs", "position"])
def test_megatron_capacity_cases_ep4(policy):
    _megatron_capacity_case(policy)


def _reference_block(num_experts, factor, policy, chunks):
    """The unsharded block; its experts see weights zeroed where the rule drops (per token chunk)."""
    ref = _block(num_experts)
    forward = ref.experts.forward
    ref.dropped = 0

    def dropped_forward(hidden, idx, w):
        keeps, off = [], 0
        for n in chunks:
            keeps.append(_ref_keep(idx[off : off + n], w[off : off + n].detach(), num_experts, factor, policy))
            off += n
        keep = torch.cat(keeps)
        ref.dropped += int((~keep).sum())
        return forward(hidden, idx, w * keep.to(w.dtype))

    ref.experts.forward = dropped_forward
    return ref


def _parity(mode, tokens, policy, pad, num_experts=6, factor=0.6):
    R, me = world_size(), rank()
    rows = [7, 0, 5, 9][:R] if tokens == "sharded" else [9]
    xs = [_tokens(10 + r, n) for r, n in enumerate(rows)]
    cs = [_tokens(20 + r, n) for r, n in enumerate(rows)]
    ref = _reference_block(num_experts, factor, policy, rows)
    block = _block(num_experts)
    kwargs = dict(capacity_factor=factor, drop_policy=policy, pad_to_capacity=pad)
    shard_experts(block.experts, world_group(), mode=mode, tokens=tokens, **kwargs)
    ref_out, ref_gx = _run(ref, torch.cat(xs, 1), torch.cat(cs, 1))
    if tokens == "replicated":
        out, gx = _run(block, xs[0], cs[0])
        router = block.gate.weight.grad
    else:
        out, gx = _run(block, xs[me], cs[me])
        lo, n = split_offsets(rows)[me], rows[me]
        ref_out, ref_gx = ref_out[:, lo : lo + n], ref_gx[:, lo : lo + n]
        router = torch.zeros_like(block.gate.weight) if block.gate.weight.grad is None else block.gate.weight.grad
        torch.distributed.all_reduce(router, group=world_group())  # data-parallel router: partial sums
    errs = _errors(ref, block, out, ref_out, gx, ref_gx, router)
    if out.numel() == 0:
        errs.update(out=0.0, **{"x.grad": 0.0})
    errs["nothing dropped"] = float(ref.dropped == 0)  # the case must exercise dropping
    assert all_true(max(errs.values()) <= RTOL), errs


@pytest.mark.world(2, timeout=WALL)
@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("mode", ["dispatch", "local"])
def test_parity_replicated_ep2(mode, policy, pad):
    _parity(mode, "replicated", policy, pad)


@pytest.mark.world(4, timeout=WALL)
@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("tokens", ["replicated", "sharded"])
def test_parity_ep4(tokens, pad):
    _parity("dispatch", tokens, "probs", pad, num_experts=5)


@pytest.mark.world(1, timeout=WALL)
def test_parity_one_process():
    _parity("dispatch", "replicated", "position", False)


@pytest.mark.world(2, timeout=WALL)
@pytest.mark.parametrize("pad", [False, True])
def test_ledger_unchanged_by_capacity(pad):
    """Capacity adds no collective: 3 all-to-alls forward (counts, tokens, results), 2 backward."""
    block = _block(6)
    shard_experts(block.experts, world_group(), tokens="sharded", capacity_factor=0.5, pad_to_capacity=pad)
    x = _tokens(1 + rank(), 7).requires_grad_(True)
    with CommLedger() as fwd:
        out = block(x)
    with CommLedger() as bwd:
        out.sum().backward()
    assert fwd.count() == 3 and fwd.count(op="all_to_all_single") == 3
    assert bwd.count() == 2 and bwd.count(op="all_to_all_single") == 2


@pytest.mark.world(2, timeout=WALL)
@pytest.mark.parametrize("pad", [False, True])
def test_bad_expert_id_raises_on_every_rank(pad):
    """A bad id on rank 1 only: the dispatcher's count exchange reports it on both ranks (no hang)."""
    block = _block(4)
    shard_experts(block.experts, world_group(), tokens="sharded", capacity_factor=1.0, pad_to_capacity=pad)
    hidden = _tokens(3, 5)[0]
    idx = torch.tensor([[0, 1], [2, 3], [1, 2], [0, 3], [3, 1]])
    if rank() == 1:
        idx[2, 1] = 99
    w = torch.full((5, 2), 0.5, dtype=torch.float64)
    with pytest.raises(ShardkitError, match=r"expert ids outside \[0, 4\).*ranks \[1\]"):
        ep_experts_forward(block.experts, hidden, idx, w, world_group(), tokens="sharded", capacity_factor=1.0,
                           pad_to_capacity=pad)  # fmt: skip
