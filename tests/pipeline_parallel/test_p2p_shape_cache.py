"""Negotiating once per distinct shape (:class:`ShapeCache`): shapes and dtypes change between
transfers (repeat, grow past the one-message limit, shrink to zero size and 0-d, switch dtype,
an error status in the middle) and every received tensor is bitwise the coordinate-encoded one
sent; after every transfer the sender's and the receiver's cached entries for the channel are
equal, so the two ends cannot fall out of step."""

from unittest import mock

import pytest
import torch
import torch.distributed as dist

from harness.helpers import rank, world_group, world_size
from shardkit.comm import CommLedger
from shardkit.errors import ShardkitError
from shardkit.pipeline_parallel import (
    ShapeCache,
    _wire,
    recv_backward,
    recv_forward,
    send_backward,
    send_backward_recv_backward,
    send_forward,
    send_forward_recv_forward,
)
from shardkit.pipeline_parallel._packed import PACK_MAX_BYTES

BIG = (PACK_MAX_BYTES // 4 + 16,)  # float32 payload just over the one-message limit
# (shape, dtype) per transfer: repeats, a change back and forth across the limit, zero size,
# 0-d, another dtype, and repeats after each change.
SEQUENCE = [
    ((2, 3), torch.float32),
    ((2, 3), torch.float32),
    ((4,), torch.float32),
    ((2, 3), torch.float32),
    (BIG, torch.float32),
    (BIG, torch.float32),
    ((1, 2, 0, 3), torch.float32),
    ((1, 2, 0, 3), torch.float32),
    ((), torch.float64),
    ((), torch.float64),
    ((5, 2), torch.int64),
    ((2, 3), torch.float32),
    (BIG, torch.float32),
    ((3,), torch.bfloat16),
    ((3,), torch.bfloat16),
]


def value(shape, dtype, direction, stage, i):
    n = 1
    for d in shape:
        n *= d
    return (torch.arange(n, dtype=torch.float64).reshape(shape) + 1000 * direction + 100 * stage + 10 * i).to(dtype)


def _same(got, want):
    return got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def _entries(cache: ShapeCache) -> dict:
    """This rank's cache as {(src stage, dst stage): (shape, dtype)} of the world group."""
    s, out = rank(), {}
    for (_, is_send, peer), (shape, dtype, *_) in cache._last.items():
        out[(s, peer) if is_send else (peer, s)] = (shape, str(dtype))
    return out


def _assert_caches_equal(cache: ShapeCache) -> None:
    """Both ends of every channel hold the same entry (or both none)."""
    seen = [None] * world_size()
    dist.all_gather_object(seen, _entries(cache), group=world_group())
    for r, mine in enumerate(seen):
        for (src, dst), entry in mine.items():
            other = dst if r == src else src
            assert seen[other].get((src, dst)) == entry, (r, src, dst, entry, seen[other].get((src, dst)))


def _chain_forward_backward(cache):
    g, s, P = world_group(), rank(), world_size()
    for i, (shape, dt) in enumerate(SEQUENCE):
        if s > 0:
            assert _same(recv_forward(g, shape_cache=cache), value(shape, dt, 0, s - 1, i))
        if s < P - 1:
            send_forward(value(shape, dt, 0, s, i), g, shape_cache=cache)
        _assert_caches_equal(cache)
    for i, (shape, dt) in enumerate(reversed(SEQUENCE)):
        if s < P - 1:
            assert _same(recv_backward(g, shape_cache=cache), value(shape, dt, 1, s + 1, i))
        if s > 0:
            send_backward(value(shape, dt, 1, s, i), g, shape_cache=cache)
        _assert_caches_equal(cache)


@pytest.mark.world(2, timeout=30)
def test_changing_shapes_pp2():
    _chain_forward_backward(ShapeCache())


@pytest.mark.world(3, timeout=30)
def test_changing_shapes_pp3():
    _chain_forward_backward(ShapeCache())


@pytest.mark.world(4, timeout=30)
def test_changing_shapes_pp4():
    _chain_forward_backward(ShapeCache())


@pytest.mark.world(2, timeout=30)
def test_loop_pp2_forward_and_backward_share_one_channel():
    """pp=2 with loop: forward and backward traffic of both directions on one pair of ranks."""
    g, s, P, cache = world_group(), rank(), world_size(), ShapeCache()
    for i, (shape, dt) in enumerate(SEQUENCE):
        x = send_forward_recv_forward(value(shape, dt, 0, s, i), g, loop=True, shape_cache=cache)
        assert _same(x, value(shape, dt, 0, (s - 1) % P, i))
        back = SEQUENCE[-1 - i]
        y = send_backward_recv_backward(value(*back, 1, s, i), g, loop=True, shape_cache=cache)
        assert _same(y, value(*back, 1, (s + 1) % P, i))
        _assert_caches_equal(cache)


@pytest.mark.world(2, timeout=30)
def test_a_repeated_small_shape_is_one_message_and_a_change_costs_a_dummy():
    g, s, cache = world_group(), rank(), ShapeCache()
    shapes = [(4, 4), (4, 4), (4, 4), (2,), (2,)]
    counts = []
    for i, shape in enumerate(shapes):
        with CommLedger() as ledger:
            if s == 0:
                send_forward(value(shape, torch.float32, 0, 0, i), g, shape_cache=cache)
            else:
                assert _same(recv_forward(g, shape_cache=cache), value(shape, torch.float32, 0, 0, i))
        counts.append(ledger.count())
    # first: header + payload; repeats: one packed message; a change: packed (dummy) + payload.
    assert counts == [2, 1, 1, 2, 1]


@pytest.mark.world(2, timeout=30)
def test_an_error_status_keeps_both_caches_and_the_next_transfer_works():
    g, s, cache = world_group(), rank(), ShapeCache()
    for i in range(2):
        if s == 0:
            send_forward(value((3,), torch.float32, 0, 0, i), g, shape_cache=cache)
        else:
            recv_forward(g, shape_cache=cache)
    if s == 0:
        with pytest.raises(ShardkitError, match="ndim 17 exceeds"):
            send_forward(torch.zeros([1] * 17), g, shape_cache=cache)
    else:
        with pytest.raises(ShardkitError, match="cannot be described by a header"):
            recv_forward(g, shape_cache=cache)
    _assert_caches_equal(cache)
    assert _entries(cache) == {((0, 1) if s == 0 else (0, 1)): ((3,), "torch.float32")}
    for i, shape in enumerate([(3,), (6,)]):
        if s == 0:
            send_forward(value(shape, torch.float32, 0, 0, i), g, shape_cache=cache)
        else:
            assert _same(recv_forward(g, shape_cache=cache), value(shape, torch.float32, 0, 0, i))
    _assert_caches_equal(cache)


@pytest.mark.world(2, timeout=30)
def test_a_repeated_large_shape_sends_the_stored_header_and_any_change_is_decoded():
    """Over the one-message limit a repeat sends the channel's stored header bytes (no encoding)
    and the receiver accepts it by comparison (no decoding); a change of dtype or shape with the
    same byte count, or an error status, differs in some header byte and is decoded and seen."""
    g, s, cache = world_group(), rank(), ShapeCache()
    n = BIG[0]
    steps = [
        ((n,), torch.float32),
        ((n,), torch.float32),
        ((n,), torch.int32),  # same bytes, another dtype
        ((n // 8, 8), torch.int32),  # same bytes, another shape
        ((n // 8, 8), torch.int32),
    ]
    counts, coded = [], []
    for i, (shape, dt) in enumerate(steps):
        with mock.patch.object(_wire, "encode", wraps=_wire.encode) as enc:
            with mock.patch.object(_wire, "decode", wraps=_wire.decode) as dec:
                with CommLedger() as ledger:
                    if s == 0:
                        send_forward(value(shape, dt, 0, 0, i), g, shape_cache=cache)
                    else:
                        assert _same(recv_forward(g, shape_cache=cache), value(shape, dt, 0, 0, i))
        counts.append(ledger.count())
        coded.append(enc.call_count + dec.call_count)
        _assert_caches_equal(cache)
    # first: header + payload; repeat: stored header + payload; a change: header + dummy + payload.
    assert counts == [2, 2, 3, 3, 2]
    assert coded[1] == 0 and coded[4] == 0, coded  # repeats: no header encoded or decoded
    assert all(c > 0 for c in (coded[0], coded[2], coded[3])), coded
    if s == 0:
        with pytest.raises(ShardkitError, match="ndim 17 exceeds"):
            send_forward(torch.zeros([1] * 17), g, shape_cache=cache)
    else:
        with pytest.raises(ShardkitError, match="cannot be described by a header"):
            recv_forward(g, shape_cache=cache)
    _assert_caches_equal(cache)


@pytest.mark.world(2, timeout=30)
def test_a_packed_send_reuses_its_buffer_only_once_the_last_send_completed():
    g, s, cache = world_group(), rank(), ShapeCache()
    seen = []
    for i in range(3):
        if s == 0:
            send_forward(value((4, 4), torch.float32, 0, 0, i), g, shape_cache=cache)
            if i:  # the first transfer negotiates: a header and the payload, nothing packed
                ((buf, _, _),) = cache._packed.values()
                seen.append(buf)
        else:
            assert _same(recv_forward(g, shape_cache=cache), value((4, 4), torch.float32, 0, 0, i))
    if s == 0:
        assert seen[0] is seen[1]  # a repeat after a completed send: the same buffer, no allocation
        key = next(iter(cache._packed))
        _, _, body = cache._packed[key]
        cache._packed[key] = (seen[1], mock.Mock(is_completed=lambda: False), body)  # c10d may still read it
        send_forward(value((4, 4), torch.float32, 0, 0, 3), g, shape_cache=cache)
        assert cache._packed[key][0] is not seen[1]
    else:
        assert _same(recv_forward(g, shape_cache=cache), value((4, 4), torch.float32, 0, 0, 3))


@pytest.mark.world(2, timeout=30)
def test_same_size_changes_through_the_reused_packed_buffer_arrive_as_sent():
    """Changes of shape or dtype with the same byte count reuse the packed send buffer (whose
    header bytes a repeat leaves in place) with another header: every tensor arrives as sent,
    in the protocol's number of messages."""
    g, s, cache = world_group(), rank(), ShapeCache()
    steps = (
        [((4, 4), torch.float32)] * 2 + [((16,), torch.float32), ((4, 4), torch.int32)] + [((4, 4), torch.float32)] * 2
    )
    counts = []
    for i, (shape, dt) in enumerate(steps):
        with CommLedger() as ledger:
            if s == 0:
                send_forward(value(shape, dt, 0, 0, i), g, shape_cache=cache)
            else:
                assert _same(recv_forward(g, shape_cache=cache), value(shape, dt, 0, 0, i)), i
        counts.append(ledger.count())
    # negotiation: header + payload; repeat: one packed message; a change: packed dummy + payload.
    assert counts == [2, 1, 2, 2, 2, 1]
    _assert_caches_equal(cache)


@pytest.mark.world(2, timeout=30)
def test_a_repeat_that_contradicts_its_declared_dtype_is_refused_on_both_ends():
    """The repeat's fast path skips the sender's own checks only when they cannot fail: a
    declared dtype other than the tensor's still goes through them and the header says so. That
    error header is written into the reused packed buffer, so the next repeat (the cache still
    holds the shape) must write the stored header again, not take the buffer's bytes as it."""
    g, s, cache = world_group(), rank(), ShapeCache()
    for i in range(2):
        if s == 0:
            send_forward(value((4, 4), torch.float32, 0, 0, i), g, shape_cache=cache)
        else:
            recv_forward(g, shape_cache=cache)
    if s == 0:
        with pytest.raises(ShardkitError, match="declared"):
            send_forward(value((4, 4), torch.float32, 0, 0, 2), g, dtype=torch.float16, shape_cache=cache)
    else:
        with pytest.raises(ShardkitError, match="does not match its own declared"):
            recv_forward(g, shape_cache=cache)
    if s == 0:
        send_forward(value((4, 4), torch.float32, 0, 0, 3), g, shape_cache=cache)
    else:
        assert _same(recv_forward(g, shape_cache=cache), value((4, 4), torch.float32, 0, 0, 3))
    _assert_caches_equal(cache)
