"""Pure size arithmetic: no process group."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardkit import ShardkitError, ShardkitTypeError, balanced_split_sizes
from shardkit._shapes import check_split_sizes, normalize_dim, split_offsets


def test_balanced_examples():
    assert balanced_split_sizes(10, 4) == [3, 3, 2, 2]
    assert balanced_split_sizes(2, 4) == [1, 1, 0, 0]
    assert balanced_split_sizes(0, 3) == [0, 0, 0]
    assert balanced_split_sizes(15, 1) == [15]


@given(n=st.integers(0, 10_000), r=st.integers(1, 64))
def test_balanced_properties(n, r):
    sizes = balanced_split_sizes(n, r)
    assert len(sizes) == r and sum(sizes) == n
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the extra elements go to the first ranks


@given(sizes=st.lists(st.integers(0, 50), min_size=1, max_size=10))
def test_offsets_are_exclusive_prefix_sums(sizes):
    offs = split_offsets(sizes)
    assert offs[0] == 0 and all(offs[i + 1] - offs[i] == sizes[i] for i in range(len(sizes) - 1))


@pytest.mark.parametrize("n,r", [(-1, 2), (4, 0)])
def test_balanced_rejects_bad_input(n, r):
    with pytest.raises(ShardkitError):
        balanced_split_sizes(n, r)


def test_check_split_sizes():
    assert check_split_sizes(None, 3, 7, "op") == [3, 2, 2]
    assert check_split_sizes((0, 7, 0), 3, 7, "op") == [0, 7, 0]
    with pytest.raises(ShardkitError, match="entries"):
        check_split_sizes([1, 2], 3, 3, "op")
    with pytest.raises(ShardkitError, match="sum to"):
        check_split_sizes([1, 2, 3], 3, 7, "op")
    with pytest.raises(ShardkitTypeError):
        check_split_sizes("abc", 3, 7, "op")


def test_normalize_dim():
    assert normalize_dim(-1, 4, "op") == 3
    with pytest.raises(ShardkitError, match="out of range"):
        normalize_dim(4, 4, "op")
    with pytest.raises(ShardkitTypeError):
        normalize_dim(1.0, 4, "op")
