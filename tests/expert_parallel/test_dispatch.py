"""Token dispatch / combine: routing by coordinates (bitwise), adjoints, exact gradients, ledger.

Every rank regenerates every rank's routing from a per-rank seed, so each rank can compute the
single-process reference for the whole group locally.
"""

import pytest
import torch

from harness.checks import adjoint_error, coords, cotangent
from harness.helpers import all_true, rank, world_group, world_size
from shardkit import ShardkitError, balanced_split_sizes
from shardkit._shapes import split_offsets
from shardkit.comm import CommLedger
from shardkit.expert_parallel import dispatch_plan, token_combine, token_dispatch

H = 3
CASES = ("random", "to_rank0", "few_experts", "no_tokens", "one_sender")


def _setup(case, R):
    """(num_experts, expert_sizes) for a case."""
    if case == "few_experts":  # E < R for R = 3, 4: some ranks own no expert
        return 2, balanced_split_sizes(2, R)
    return 6, balanced_split_sizes(6, R)


def _routing(case, r, k, R):
    """Rank r's ``topk_index [T_r, k]``, deterministic in (case, r, k, R)."""
    E, sizes = _setup(case, R)
    gen = torch.Generator().manual_seed(100 * r + 7 * k + R)
    T = [5, 0, 3, 4][r % 4] if case != "one_sender" else (6 if r == 0 else 0)
    if case == "no_tokens":
        T = 0
    hi = sizes[0] if case == "to_rank0" else E  # to_rank0: only rank 0's experts are hit
    return torch.randint(0, hi, (T, k), generator=gen)


def _hidden(r, T):
    return coords((T, H), offset=1000.0 * r + 1.0)


def _weights(r, T, k):
    return torch.rand(T, k, generator=torch.Generator().manual_seed(5 + r), dtype=torch.float64)


def _expected_input(case, k, R, me):
    """Rows rank ``me`` must receive: local expert major, then source rank, then (token, slot)."""
    E, sizes = _setup(case, R)
    off = split_offsets(sizes)[me]
    blocks, counts = [], []
    for lid in range(sizes[me]):
        n = 0
        for src in range(R):
            idx = _routing(case, src, k, R)
            hidden = _hidden(src, idx.shape[0])
            for t, _j in zip(*torch.where(idx == off + lid)):
                blocks.append(hidden[t])
                n += 1
        counts.append(n)
    return (torch.stack(blocks) if blocks else torch.zeros(0, H, dtype=torch.float64)), counts


@pytest.mark.world(1)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("k", [1, 2])
def test_dispatch_r1(case, k):
    _check_routing(case, k)


@pytest.mark.world(2)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("k", [1, 2])
def test_dispatch_r2(case, k):
    _check_routing(case, k)


@pytest.mark.world(3)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("k", [1, 2])
def test_dispatch_r3(case, k):
    _check_routing(case, k)


@pytest.mark.world(4)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("k", [1, 2])
def test_dispatch_r4(case, k):
    _check_routing(case, k)


def _check_routing(case, k):
    R, me = world_size(), rank()
    E, sizes = _setup(case, R)
    idx = _routing(case, me, k, R)
    hidden = _hidden(me, idx.shape[0])
    plan = dispatch_plan(idx, E, world_group())
    x, counts = token_dispatch(hidden, plan)
    want, want_counts = _expected_input(case, k, R, me)
    assert counts == want_counts and torch.equal(x, want)
    assert torch.equal(
        plan.local_expert_ids(),
        torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts, dtype=torch.long)),
    )

    # Combine with expert "(global id + 1) * x", unweighted: integers, so exact.
    gid = plan.local_expert_ids() + plan.expert_offset
    out = token_combine(x * (gid + 1).to(x.dtype)[:, None], plan)
    ref = ((idx + 1).sum(1).to(hidden.dtype))[:, None] * hidden
    assert torch.equal(out, ref)

    # Adjoints (float64): dispatch in hidden, combine in expert_output and in the weights.
    w = _weights(me, idx.shape[0], k)
    y = cotangent(x.shape)
    errs = [
        adjoint_error(lambda h: token_dispatch(h, plan)[0], hidden),
        adjoint_error(lambda v: token_combine(v, plan, w), y),
        adjoint_error(lambda v: token_combine(y, plan, v), w),
    ]
    assert max(errs) <= 1e-12, errs


@pytest.mark.world(4)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("k", [1, 2])
def test_gradients_exact_r4(case, k):
    _check_gradients(case, k)


@pytest.mark.world(3)
@pytest.mark.parametrize("case", ["random", "few_experts", "one_sender"])
def test_gradients_exact_r3(case):
    _check_gradients(case, 2)


def _check_gradients(case, k):
    """Full path dispatch -> experts (x * scale[e]) -> weighted combine against a local
    reference of the whole group: hidden, routing-weight and expert-parameter gradients."""
    R, me = world_size(), rank()
    E, sizes = _setup(case, R)
    scale_full = torch.linspace(0.5, 2.0, E, dtype=torch.float64)
    off = split_offsets(sizes)[me]
    scale = scale_full[off : off + sizes[me]].clone().requires_grad_(True)
    idx = _routing(case, me, k, R)
    hidden = _hidden(me, idx.shape[0]).requires_grad_(True)
    w = _weights(me, idx.shape[0], k).requires_grad_(True)
    plan = dispatch_plan(idx, E, world_group())
    x, counts = token_dispatch(hidden, plan)
    out = token_combine(x * scale[plan.local_expert_ids()][:, None], plan, w)
    (out * cotangent(out.shape)).sum().backward()

    ref_scale = scale_full.clone().requires_grad_(True)
    loss, leaves = 0.0, []
    for src in range(R):  # the same cotangents: reseed as cotangent() does on rank src
        i = _routing(case, src, k, R)
        h = _hidden(src, i.shape[0]).requires_grad_(True)
        ws = _weights(src, i.shape[0], k).requires_grad_(True)
        o = (h[:, None, :] * ref_scale[i][..., None] * ws[..., None]).sum(1)
        c = torch.randn(*o.shape, generator=torch.Generator().manual_seed(1234 + 7919 * (src + 1)), dtype=torch.float64)
        loss = loss + (o * c).sum()
        leaves.append((h, ws))
    loss.backward()
    h_ref, w_ref = leaves[me]
    ok = (
        torch.allclose(
            out.detach(),
            (hidden[:, None, :] * scale_full[idx][..., None] * w[..., None]).sum(1).detach(),
            rtol=1e-12,
            atol=0,
        )
        and torch.allclose(hidden.grad, h_ref.grad, rtol=1e-12, atol=1e-300)
        and torch.allclose(w.grad, w_ref.grad, rtol=1e-12, atol=1e-300)
    )
    full_scale_grad = ref_scale.grad[off : off + sizes[me]]
    ok = ok and scale.grad is not None and torch.allclose(scale.grad, full_scale_grad, rtol=1e-12, atol=1e-300)
    assert all_true(ok)


@pytest.mark.world(1)
def test_ledger_r1():
    _check_ledger(0)


@pytest.mark.world(3)
def test_ledger_r3():
    _check_ledger(1)


@pytest.mark.world(4)
def test_ledger_r4_zero_tokens():
    _check_ledger(1, case="one_sender")


def _check_ledger(per_op, case="random"):
    R, me = world_size(), rank()
    E, _ = _setup(case, R)
    idx = _routing(case, me, 2, R)
    hidden = _hidden(me, idx.shape[0]).requires_grad_(True)
    param = torch.ones((), dtype=torch.float64, requires_grad=True)
    with CommLedger() as fwd:
        plan = dispatch_plan(idx, E, world_group())
        x, _ = token_dispatch(hidden, plan)
        out = token_combine(x * param, plan, _weights(me, idx.shape[0], 2))
    with CommLedger() as bwd:
        out.sum().backward()
    assert fwd.count(api="dispatch_plan") == per_op
    assert fwd.count(api="token_dispatch") == per_op and fwd.count(api="token_combine") == per_op
    assert fwd.count() == 3 * per_op == fwd.count(op="all_to_all_single")
    assert bwd.count(api="token_dispatch", phase="backward") == per_op
    assert bwd.count(api="token_combine", phase="backward") == per_op
    assert bwd.count() == 2 * per_op


@pytest.mark.world(3)
def test_bad_expert_id_raises_on_every_rank():
    idx = torch.zeros(2, 2, dtype=torch.long)
    if rank() == 1:
        idx[1, 0] = 6  # out of range on one rank only
    with pytest.raises(ShardkitError, match=r"ranks \[1\]"):
        dispatch_plan(idx, 6, world_group())


@pytest.mark.world(2)
def test_argument_errors():
    g = world_group()
    with pytest.raises(ShardkitError):
        dispatch_plan(torch.zeros(3, dtype=torch.long), 4, g)  # not [T, k]
    with pytest.raises(ShardkitError):
        dispatch_plan(torch.zeros(3, 1), 4, g)  # float ids
    with pytest.raises(ShardkitError):
        dispatch_plan(torch.zeros(3, 1, dtype=torch.long), 4, g, expert_sizes=[3, 3])  # sums to 6
    plan = dispatch_plan(torch.zeros(3, 1, dtype=torch.long), 4, g, expert_sizes=[1, 3])
    with pytest.raises(ShardkitError):
        token_dispatch(torch.zeros(2, H), plan)  # wrong T (same on every rank here)
