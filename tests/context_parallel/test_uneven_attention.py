"""Attention over uneven sequence shards without ``seq_len=``: S is learned, never assumed.

S = 37 over 3 ranks (and 4), Ulysses with any contiguous split (zero-size blocks included), ring
with the zigzag and contiguous layouts, USP on a 2x2 mesh: float64 parity of the output and of
dq, dk, dv with full single-process attention (rtol 1e-9), in the default and the check mode;
one metadata collective per call without ``seq_len`` (USP: one per mesh dim), none with it. A
split that does not fit the layout is one ShardkitError on every rank, the group usable after.
"""

import pytest
import torch
import torch.distributed as dist

from harness.attention import reference_attention
from harness.helpers import get_mesh, rank, world_group, world_size
from shardkit import ShardkitError, balanced_split_sizes
from shardkit._shapes import split_offsets
from shardkit.comm import CommLedger, checks
from shardkit.context_parallel import ring_attention, ulysses_attention, usp_attention, usp_indices, zigzag_positions

MODES = [False, True]


def _problem(S, n=4, n_kv=2, D=4, dtype=torch.float64):
    gen = torch.Generator().manual_seed(5)  # identical on every rank: the full problem
    return [
        torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype)
        for s in ((1, S, n, D), (1, S, n_kv, D), (1, S, n_kv, D), (1, S, n, D))
    ]


def _parity(fn, pos, S, causal=True):
    """Run ``fn(q, k, v)`` on this rank's tokens ``pos``; compare output and grads to the reference."""
    q, k, v, w = _problem(S)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref = reference_attention(*ref, causal)
    (out_ref * w).sum().backward()
    loc = [t[:, pos].clone().requires_grad_() for t in (q, k, v)]
    with CommLedger() as ledger:
        out = fn(*loc)
        (out * w[:, pos]).sum().backward()
    for name, got, want in zip(
        ("out", "dq", "dk", "dv"), [out] + [t.grad for t in loc], [out_ref] + [t.grad for t in ref]
    ):
        torch.testing.assert_close(got, want[:, pos], rtol=1e-9, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")
    return ledger


def _block(sizes):
    off = split_offsets(sizes)[rank()]
    return torch.arange(off, off + sizes[rank()])


ULYSSES_SPLITS = {3: [[13, 12, 12], [0, 30, 7], [37, 0, 0]], 4: [[10, 9, 9, 9], [0, 0, 1, 36]]}


def _ulysses(check):
    g = world_group()
    for sizes in ULYSSES_SPLITS[world_size()]:
        with checks(check):
            ledger = _parity(lambda q, k, v: ulysses_attention(q, k, v, g, causal=True), _block(sizes), 37)
        assert ledger.count(op="metadata_all_gather") == 1
    balanced = balanced_split_sizes(37, world_size())
    ledger = _parity(lambda q, k, v: ulysses_attention(q, k, v, g, causal=True, seq_len=37), _block(balanced), 37)
    assert ledger.count(op="metadata_all_gather") == 0


@pytest.mark.world(3)
@pytest.mark.parametrize("check", MODES)
def test_ulysses_uneven_without_seq_len_r3(check):
    _ulysses(check)


@pytest.mark.world(4)
@pytest.mark.parametrize("check", MODES)
def test_ulysses_uneven_without_seq_len_r4(check):
    _ulysses(check)


def _ring(check):
    g, R = world_group(), world_size()
    for S in (37, 2):  # S = 2 < 2R: zero-size zigzag chunks and empty ranks
        for layout, pos in (
            ("zigzag", zigzag_positions(S, R, rank())),
            ("contiguous", _block(balanced_split_sizes(S, R))),
        ):
            with checks(check):
                ledger = _parity(lambda q, k, v: ring_attention(q, k, v, g, causal=True, layout=layout), pos, S)
            assert ledger.count(op="metadata_all_gather") == 1, (layout, S)
            ledger = _parity(lambda q, k, v: ring_attention(q, k, v, g, causal=True, layout=layout, seq_len=S), pos, S)
            assert ledger.count(op="metadata_all_gather") == 0


@pytest.mark.world(3)
@pytest.mark.parametrize("check", MODES)
def test_ring_uneven_without_seq_len_r3(check):
    _ring(check)


@pytest.mark.world(4)
@pytest.mark.parametrize("check", MODES)
def test_ring_uneven_without_seq_len_r4(check):
    _ring(check)


@pytest.mark.world(3)
@pytest.mark.parametrize("check", MODES)
def test_ring_split_that_is_not_the_layout_is_one_error_everywhere(check):
    """[37, 0, 0] is no zigzag layout of S = 37: every rank raises the same error, none hangs or aborts."""
    q = torch.zeros(1, [37, 0, 0][rank()], 2, 4)
    with checks(check), pytest.raises(ShardkitError) as info:
        ring_attention(q, q, q, world_group(), causal=True)
    outcomes = [None] * world_size()
    dist.all_gather_object(outcomes, str(info.value), group=world_group())
    assert all(o == outcomes[0] for o in outcomes) and "offending ranks [0, 1, 2]" in outcomes[0], outcomes
    t = torch.ones(1)
    dist.all_reduce(t, group=world_group())  # the group is still usable
    assert t.item() == world_size()


@pytest.mark.world(4)
@pytest.mark.parametrize("check", MODES)
def test_usp_uneven_without_seq_len_2x2(check):
    mesh = get_mesh((2, 2), ("cp_ring", "cp_ulysses"))
    i, j = mesh["cp_ring"].get_local_rank(), mesh["cp_ulysses"].get_local_rank()
    for S in (37, 3):
        pos = usp_indices([0, S], 2, 2, i, j)
        with checks(check):
            ledger = _parity(lambda q, k, v: usp_attention(q, k, v, mesh, causal=True), pos, S)
        # one per mesh dim (the check mode's agreements carry the Ulysses one)
        assert ledger.count(op="metadata_all_gather", phase="metadata") == (1 if check else 2)
        ledger = _parity(lambda q, k, v: usp_attention(q, k, v, mesh, causal=True, seq_len=S), pos, S)
        assert ledger.count(op="metadata_all_gather") == 0
