"""Uneven shards without their sizes just work: every op learns them with one metadata all-gather.

For each op that takes a sharded input (all_gather, gather_forward_split_backward, all_to_all,
halo_exchange, spatial_conv1d/2d): S = 37 over 3 ranks and other uneven splits with zero-size
shards, no ``sizes=`` / ``gather_size=``; coordinate-encoded forward bitwise equal to the
single-process reference (the conv: float64 parity), adjoint identity in float64, in the default
and the check mode; the ledger holds exactly one metadata collective per call without sizes
(the check mode's agreement table doubles as it) and none with sizes.
"""

import pytest
import torch
import torch.nn.functional as F

from harness.checks import adjoint_error, coords
from harness.helpers import rank, world_group, world_size
from shardkit import all_gather, all_to_all, balanced_split_sizes, gather_forward_split_backward
from shardkit._shapes import split_offsets
from shardkit.comm import CommLedger, checks
from shardkit.spatial import halo_exchange, spatial_conv1d, spatial_output_sizes

SPLITS = {
    3: [[13, 12, 12], [37, 0, 0], [0, 20, 17], [5, 0, 32]],
    4: [[10, 9, 9, 9], [0, 0, 37, 0], [1, 0, 30, 6]],
}
MODES = [False, True]  # default mode, check mode


def _local(full, dim, sizes):
    return full.narrow(dim, split_offsets(sizes)[rank()], sizes[rank()]).clone()


def _metadata_count(ledger):
    """Metadata collectives of the call: the size all-gather, or the check mode's agreement."""
    return ledger.count(op="metadata_all_gather")


def _assert_one_metadata_without_sizes(fn_without, fn_with):
    with CommLedger() as ledger:
        fn_without()
    assert _metadata_count(ledger) == 1, ledger.records
    with CommLedger() as ledger:
        fn_with()
    assert ledger.count(phase="metadata") == 0, ledger.records


def _splits():
    return SPLITS[world_size()]


def _all_gather_case(sizes, check):
    g = world_group()
    full = coords((2, 37, 3))
    local = _local(full, 1, sizes)
    with checks(check):
        assert torch.equal(all_gather(local, g, 1), full)
        assert adjoint_error(lambda t: all_gather(t, g, 1), local) < 1e-12
        _assert_one_metadata_without_sizes(
            lambda: all_gather(local, g, 1), lambda: all_gather(local, g, 1, sizes=sizes)
        )


@pytest.mark.world(3)
@pytest.mark.parametrize("check", MODES)
def test_all_gather_uneven_without_sizes_r3(check):
    for sizes in _splits():
        _all_gather_case(sizes, check)


@pytest.mark.world(4)
@pytest.mark.parametrize("check", MODES)
def test_all_gather_uneven_without_sizes_r4(check):
    for sizes in _splits():
        _all_gather_case(sizes, check)


@pytest.mark.world(3)
@pytest.mark.parametrize("check", MODES)
def test_gather_forward_split_backward_uneven_without_sizes(check):
    g = world_group()
    for sizes in _splits():
        full = coords((37, 2))
        local = _local(full, 0, sizes)
        with checks(check):
            assert torch.equal(gather_forward_split_backward(local, g, 0), full)
            op = lambda t: gather_forward_split_backward(t, g, 0)  # noqa: E731
            # replicated output, replicated downstream gradient: the split is its adjoint
            assert adjoint_error(op, local, replicated_cotangent=True, lhs_once=True) < 1e-12
            _assert_one_metadata_without_sizes(
                lambda: op(local), lambda: gather_forward_split_backward(local, g, 0, sizes=sizes)
            )


def _all_to_all_case(sizes, check):
    g, R = world_group(), world_size()
    full = coords((2, 37, 5, 3))  # [B, S, N, D]: N = 5 heads, uneven over R too
    local = _local(full, 1, sizes)
    heads = balanced_split_sizes(5, R)
    want = full.narrow(2, split_offsets(heads)[rank()], heads[rank()])
    with checks(check):
        assert torch.equal(all_to_all(local, g, scatter_dim=2, gather_dim=1), want)
        # the reverse switch brings the uneven sequence blocks back, still without sizes
        back = all_to_all(want, g, scatter_dim=1, gather_dim=2)
        assert back.shape[1] == balanced_split_sizes(37, R)[rank()]
        assert adjoint_error(lambda t: all_to_all(t, g, 2, 1), local) < 1e-12
        if sizes == balanced_split_sizes(37, R):  # gather_size= states a balanced split
            _assert_one_metadata_without_sizes(
                lambda: all_to_all(local, g, 2, 1), lambda: all_to_all(local, g, 2, 1, gather_size=37)
            )


@pytest.mark.world(3)
@pytest.mark.parametrize("check", MODES)
def test_all_to_all_uneven_without_gather_size_r3(check):
    for sizes in _splits():
        _all_to_all_case(sizes, check)


@pytest.mark.world(4)
@pytest.mark.parametrize("check", MODES)
def test_all_to_all_uneven_without_gather_size_r4(check):
    for sizes in _splits():
        _all_to_all_case(sizes, check)


def _halo_reference(full, start, stop):
    q = torch.arange(start, stop)
    padded = torch.cat([full.new_zeros(full.shape[0], 1), full], 1)
    inside = (q >= 0) & (q < full.shape[1])
    return padded.index_select(1, torch.where(inside, q + 1, torch.zeros_like(q)))


@pytest.mark.world(3)
@pytest.mark.parametrize("check", MODES)
def test_halo_exchange_wider_than_a_shard_without_sizes(check):
    g = world_group()
    for sizes in _splits():
        full = coords((2, 37), offset=1.0)  # no element is 0: zero fill shows
        local = _local(full, 1, sizes)
        off = split_offsets(sizes)[rank()]
        with checks(check):
            out = halo_exchange(local, g, 1, 6, 14)  # wider than several shards
            assert torch.equal(out, _halo_reference(full, off - 6, off + sizes[rank()] + 14))
            assert adjoint_error(lambda t: halo_exchange(t, g, 1, 6, 14), local) < 1e-12
            _assert_one_metadata_without_sizes(
                lambda: halo_exchange(local, g, 1, 6, 14), lambda: halo_exchange(local, g, 1, 6, 14, sizes=sizes)
            )


@pytest.mark.world(3)
@pytest.mark.parametrize("check", MODES)
def test_spatial_conv1d_wide_kernel_without_sizes(check):
    g = world_group()
    gen = torch.Generator().manual_seed(7)
    full = torch.randn(1, 2, 37, generator=gen, dtype=torch.float64)
    weight = torch.randn(3, 2, 9, generator=gen, dtype=torch.float64)  # halo 4 > several shards
    ref = F.conv1d(full, weight, padding=4)
    for sizes in _splits():
        local = _local(full, 2, sizes).requires_grad_()
        out_sizes = spatial_output_sizes(sizes, 9, padding=4)
        with checks(check):
            out = spatial_conv1d(local, weight, None, g, 2, padding=4)
            torch.testing.assert_close(out, _local(ref, 2, out_sizes), rtol=1e-9, atol=1e-12)
            _assert_one_metadata_without_sizes(
                lambda: spatial_conv1d(local, weight, None, g, 2, padding=4),
                lambda: spatial_conv1d(local, weight, None, g, 2, padding=4, sizes=sizes),
            )
