"""all_to_all: any pair of dims, aligned or not; bitwise forward, adjoint backward, one call each way."""

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.checks import adjoint_error, coords
from harness.helpers import all_true, rank, world_group, world_size
from shardkit import all_to_all, balanced_split_sizes
from shardkit._shapes import split_offsets
from shardkit.comm import CommLedger


def _block(full, dim, total):
    sizes = balanced_split_sizes(total, world_size())
    return full.narrow(dim, split_offsets(sizes)[rank()], sizes[rank()])


def _check(full_shape, scatter_dim, gather_dim, noncontig=False):
    """The local input is the gather-dim block of a coordinate tensor; the output must be its
    scatter-dim block, bit for bit, and the backward must be the adjoint."""
    full = coords(full_shape, offset=0.25)
    gather_size = full_shape[gather_dim]
    x = _block(full, gather_dim, gather_size)
    if noncontig:
        x = x.movedim(0, -1).contiguous().movedim(-1, 0)
    y = all_to_all(x, world_group(), scatter_dim, gather_dim, gather_size=gather_size)
    expected = _block(full, scatter_dim, full_shape[scatter_dim])
    # Run every collective before asserting, so a failure on one rank cannot strand the others.
    err = adjoint_error(lambda t: all_to_all(t, world_group(), scatter_dim, gather_dim, gather_size), x)
    assert y.shape == expected.shape and torch.equal(y, expected), (full_shape, scatter_dim, gather_dim)
    assert y.is_contiguous()
    assert err <= 1e-12, err


# [B, S, N, D]: 7 sequence positions and 5 heads are aligned with no R in {2, 3, 4}; 2 heads at
# R = 3, 4 gives zero-size parts. D = 8 rows take the uneven row-gather path of the pack/unpack.
SHAPES_4D = [(2, 7, 5, 3), (1, 8, 12, 2), (2, 6, 2, 3), (1, 9, 15, 8)]


@pytest.mark.world(2)
@pytest.mark.parametrize("shape", SHAPES_4D)
@pytest.mark.parametrize("dims", list(itertools.permutations(range(4), 2)))
def test_all_pairs_of_dims_r2(shape, dims):
    _check(shape, *dims)


@pytest.mark.world(3)
@pytest.mark.parametrize("shape", SHAPES_4D)
@pytest.mark.parametrize("dims", list(itertools.permutations(range(4), 2)))
def test_all_pairs_of_dims_r3(shape, dims):
    _check(shape, *dims)


@pytest.mark.world(4)
@pytest.mark.parametrize("shape", SHAPES_4D)
@pytest.mark.parametrize("dims", [(2, 1), (1, 2), (0, 3), (3, 0)])
@pytest.mark.parametrize("noncontig", [False, True])
def test_ulysses_dims_r4(shape, dims, noncontig):
    _check(shape, *dims, noncontig=noncontig)


@pytest.mark.world(3)
@pytest.mark.parametrize(
    "shape,dims", [((4, 5), (0, 1)), ((4, 5), (1, 0)), ((2, 3, 4, 5, 6), (4, 1)), ((2, 3, 4, 5, 6), (1, 4))]
)
def test_other_ndims(shape, dims):
    _check(shape, *dims)


@pytest.mark.world(3)
def test_default_gather_size_is_local_times_r():
    x = coords((2, 4, 6, 3))  # every rank holds 4 sequence positions
    y = all_to_all(x + rank(), world_group(), scatter_dim=2, gather_dim=1)
    assert y.shape == (2, 12, 2, 3)
    for r in range(3):  # block r of the gathered dim came from rank r's heads [2 rank(), 2 rank() + 2)
        assert torch.equal(y[:, 4 * r : 4 * r + 4], x[:, :, 2 * rank() : 2 * rank() + 2] + r)


@pytest.mark.world(2)
@pytest.mark.parametrize("shape", [(1, 7, 5, 3), (2, 6, 16, 4)])
def test_ledger_one_call_each_way(shape):
    full = coords(shape)
    x = _block(full, 1, shape[1]).clone().requires_grad_()
    with CommLedger() as ledger:
        y = all_to_all(x, world_group(), 2, 1, shape[1])
        y.sum().backward()
    assert ledger.count() == 2
    assert ledger.count(op="all_to_all_single", api="all_to_all", phase="forward") == 1
    assert ledger.count(op="all_to_all_single", api="all_to_all", phase="backward") == 1
    assert ledger.bytes_sent(phase="forward") == x.nbytes
    assert ledger.bytes_received(phase="forward") == y.nbytes


@pytest.mark.world(3)
@settings(derandomize=True, database=None, deadline=None, max_examples=25, suppress_health_check=list(HealthCheck))
@given(
    shape=st.lists(st.integers(0, 5), min_size=2, max_size=4),
    data=st.data(),
)
def test_property_any_shape_any_dims(shape, data):
    """Hypothesis draws the same examples on every rank (derandomized); pass/fail is agreed."""
    ndim = len(shape)
    scatter_dim, gather_dim = data.draw(st.permutations(range(ndim)))[:2]
    ok = True
    try:
        _check(tuple(shape), scatter_dim, gather_dim)
    except AssertionError:
        ok = False
    assert all_true(ok), (shape, scatter_dim, gather_dim)


@pytest.mark.world(3)
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("heads", [6, 5])
def test_outputs_never_alias_the_reused_scratch_buffers(batch, heads, monkeypatch):
    """The helpers pack and unpack through per-thread scratch buffers reused by every call
    (`_c10d._Scratch`): an output kept from one call must survive later calls of every size and
    collective bit for bit, and the send buffers of two packing calls are the same memory."""
    import torch.distributed as dist

    from shardkit import all_gather, reduce_scatter

    g = world_group()
    sends = []
    original = dist.all_to_all_single

    def spy(output, input, *args, **kwargs):
        sends.append(input.data_ptr())
        return original(output, input, *args, **kwargs)

    monkeypatch.setattr(dist, "all_to_all_single", spy)
    kept, packed = [], []
    for offset, seq in ((0.25, 12), (0.5, 7), (0.75, 9)):  # the largest first: no regrowth
        full = coords((batch, seq, heads, 8), offset=offset)
        for s, d in ((2, 1), (1, 2)):
            x = _block(full, d, full.shape[d])
            y = all_to_all(x, g, s, d, full.shape[d])
            kept.append((y, y.clone(), _block(full, s, full.shape[s])))
            if s == 2:  # scattering heads of [B, S/R, N, D] always packs
                packed.append(sends[-1])
        local = _block(full, 1, seq)
        gathered = all_gather(local, g, 1, balanced_split_sizes(seq, world_size()))
        kept.append((gathered, gathered.clone(), full))
        summed = reduce_scatter(full, g, 1, balanced_split_sizes(seq, world_size()))
        kept.append((summed, summed.clone(), _block(full, 1, seq) * world_size()))
    assert all(torch.equal(y, copy) and torch.equal(y, expected) for y, copy, expected in kept)
    # The first call may grow the buffer an earlier test left on this thread; then it stays.
    assert len(packed) == 3 and packed[1] == packed[2], packed
