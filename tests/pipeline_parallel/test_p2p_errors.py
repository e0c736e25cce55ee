"""Bad pipeline transfers: a clear ShardkitError on every rank involved within 2 s, and the
group (and its P2P channels) still works after."""

import time

import pytest
import torch
import torch.distributed as dist

from harness.helpers import rank, world_group, world_size
from harness.limits import patient
from shardkit.comm import CommLedger, checks
from shardkit.errors import RankMismatchError, ShardkitError, ShardkitTypeError
from shardkit.pipeline_parallel import recv_backward, recv_forward, send_backward, send_forward

G = world_group


def _raises(expected, fragment, fn):
    """Run ``fn`` expecting ``expected`` (with ``fragment``) within 2 s; return the message."""
    start = time.monotonic()
    with pytest.raises(expected, match=fragment) as info:
        fn()
    assert time.monotonic() - start < patient(2.0)  # 2 s when quiet, stretched by the machine's load
    assert isinstance(info.value, ShardkitError)
    return str(info.value)


def _assert_usable():
    """The group all-reduces, and a forward and a backward transfer along the whole pipeline
    arrive intact (nothing stale is left in any channel)."""
    t = torch.ones(1)
    dist.all_reduce(t, group=G())
    assert t.item() == world_size()
    s, P = rank(), world_size()
    if s > 0:
        assert torch.equal(recv_forward(G()), torch.full((2, 2), float(s - 1)))
    if s < P - 1:
        send_forward(torch.full((2, 2), float(s)), G())
        assert torch.equal(recv_backward(G()), torch.full((3,), -1.0 - s - 1))
    if s > 0:
        send_backward(torch.full((3,), -1.0 - s), G())


def _pairs():
    """Even stage s sends to odd stage s + 1: every rank takes part in one transfer (pp = 2, 4)."""
    return rank() % 2 == 0


def _same_in_pair(msg: str) -> None:
    """Check mode: both ends of a transfer raised the very same text."""
    texts = [None] * world_size()
    dist.all_gather_object(texts, msg, group=G())
    assert texts[rank() ^ 1] == msg, (msg, texts[rank() ^ 1])


@pytest.mark.world(2, timeout=20)
@pytest.mark.parametrize("batched", [False, True], ids=["ordered", "batched"])
def test_static_tensor_not_matching_the_declaration_raises_on_both_ends(batched):
    decl = dict(shape=(2, 3), dtype=torch.float32, batched=batched)
    with checks(True):
        if _pairs():
            msg = _raises(
                ShardkitError,
                r"the sender's tensor \(\[2, 4\] torch.float32\) does not match its own declared",
                lambda: send_forward(torch.zeros(2, 4), G(), **decl),
            )
        else:
            msg = _raises(ShardkitError, "does not match its own declared", lambda: recv_forward(G(), **decl))
    assert "stage 0 (send_forward) to stage 1 (recv_forward)" in msg and "nothing was transferred" in msg
    _same_in_pair(msg)
    _assert_usable()


@pytest.mark.world(4, timeout=20)
@pytest.mark.parametrize("what", ["shape", "dtype"])
def test_declarations_that_differ_raise_on_both_ends_pp4(what):
    """Sender and receiver each declare consistently with themselves but differently from each
    other: both ends judge the two hellos alike and raise the same text; no payload moves."""
    s = rank()
    mine = dict(shape=(2, 4), dtype=torch.float64)
    theirs = dict(shape=(2, 3), dtype=torch.float64) if what == "shape" else dict(shape=(2, 4), dtype=torch.float32)
    sender = s if _pairs() else s - 1
    pattern = (
        rf"the forward message of stage {sender} \(send_forward\) to stage {sender + 1} \(recv_forward\) .*: "
        r"the receiver declared .* but the sender sent \[2, 4\] torch.float64; nothing was transferred"
    )
    with checks(True):
        if _pairs():
            msg = _raises(
                RankMismatchError, pattern, lambda: send_forward(torch.zeros(2, 4, dtype=torch.float64), G(), **mine)
            )
        else:
            msg = _raises(RankMismatchError, pattern, lambda: recv_forward(G(), **theirs))
    _same_in_pair(msg)
    _assert_usable()


@pytest.mark.world(2, timeout=20)
def test_async_sender_raises_at_the_call():
    # check mode: a send returns only after the handshake, so the mismatch is known at the call
    with checks(True):
        if _pairs():
            msg = _raises(
                RankMismatchError, "declared", lambda: send_forward(torch.zeros(5), G(), shape=(5,), async_op=True)
            )
        else:
            msg = _raises(RankMismatchError, "declared", lambda: recv_forward(G(), shape=(6,), dtype=torch.float32))
    _same_in_pair(msg)
    _assert_usable()


@pytest.mark.world(2, timeout=20)
@pytest.mark.parametrize("bad", ["sender", "receiver"])
def test_refused_arguments_reach_the_peer_in_check_mode(bad):
    """A call whose own arguments are refused still says hello (checks on): its peer raises the
    same error instead of waiting, and the refusing rank keeps its own message as the cause."""
    with checks(True):
        if _pairs():
            x = [1.0, 2.0] if bad == "sender" else torch.zeros(2, 3)
            msg = _raises(
                ShardkitError,
                "stage 0 \\(send_forward\\) raised an argument error"
                if bad == "sender"
                else "stage 1 \\(recv_forward\\) raised an argument error",
                lambda: send_forward(x, G()),
            )
        else:
            kw = dict(shape=(2, 3)) if bad == "receiver" else {}  # a static receive without dtype=
            msg = _raises(ShardkitError, "raised an argument error", lambda: recv_forward(G(), **kw))
        refusing = rank() == (0 if bad == "sender" else 1)
        if refusing:  # the rank's own message survives as the cause
            with pytest.raises(ShardkitError) as info:
                send_forward([1.0], G()) if bad == "sender" else recv_forward(G(), shape=(2, 3))
            assert isinstance(info.value.__cause__, ShardkitTypeError), info.value.__cause__
        else:
            with pytest.raises(ShardkitError, match="raised an argument error") as info:
                recv_forward(G()) if bad == "sender" else send_forward(torch.zeros(2, 3), G())
            assert info.value.__cause__ is None
    _same_in_pair(msg)
    _assert_usable()


@pytest.mark.world(2, timeout=20)
def test_dynamic_receiver_dtype_declaration_is_checked_without_checks():
    if _pairs():
        send_backward(torch.ones(3), G(), loop=True)
    else:
        _raises(
            RankMismatchError,
            "declared .* torch.int64 but stage 0 of 2 sent \\[3\\] torch.float32",
            lambda: recv_backward(G(), dtype=torch.int64, loop=True),
        )
    _assert_usable()


@pytest.mark.world(2, timeout=20)
def test_more_than_16_dims_raise_on_both_ends():
    if _pairs():
        _raises(ShardkitError, "ndim 17 exceeds", lambda: send_forward(torch.zeros([1] * 17), G()))
    else:
        _raises(ShardkitError, "cannot be described by a header", lambda: recv_forward(G()))
    _assert_usable()


@pytest.mark.world(2, timeout=20)
def test_static_mismatch_with_checks_off_raises_on_the_sender_before_sending():
    """Without a header nothing can tell the receiver, so the sender sends nothing (its receiver
    would wait; this test's receiver posts nothing) and no message is recorded."""
    if _pairs():
        with CommLedger() as ledger:
            _raises(ShardkitError, "declared", lambda: send_forward(torch.zeros(3), G(), shape=(4,)))
        assert ledger.count() == 0
    _assert_usable()


@pytest.mark.world(2, timeout=20)
def test_static_sender_against_dynamic_receiver_is_a_clear_protocol_error():
    if _pairs():
        send_forward(torch.zeros(20, dtype=torch.int64), G(), shape=(20,))  # 160 bytes, like a header
    else:
        _raises(ShardkitError, "expected a shardkit P2P header", lambda: recv_forward(G()))
    _assert_usable()


@pytest.mark.world(4, timeout=20)
@pytest.mark.parametrize("call", ["recv_forward_on_first", "send_backward_on_first"])
def test_calls_past_the_ends_of_the_pipeline(call):
    """First stage: nothing before it; last stage: nothing after it (without loop). Raised
    locally before any message; the middle stages are not involved."""
    s, P = rank(), world_size()
    first = {
        "recv_forward_on_first": lambda: recv_forward(G()),
        "send_backward_on_first": lambda: send_backward(torch.ones(1), G()),
    }
    last = {
        "recv_forward_on_first": lambda: send_forward(torch.ones(1), G()),
        "send_backward_on_first": lambda: recv_backward(G()),
    }
    with CommLedger() as ledger:
        if s == 0:
            _raises(ShardkitError, "stage 0 is the first of 4 pipeline stages and has no previous stage", first[call])
        elif s == P - 1:
            _raises(ShardkitError, "stage 3 is the last of 4 pipeline stages and has no next stage", last[call])
    assert ledger.count() == 0
    _assert_usable()


_PAST = {
    0: "stage 0 is the first of {P} pipeline stages and has no previous stage",
    -1: "stage {last} is the last of {P} pipeline stages and has no next stage",
}


def _past_end_calls(case, batched):
    """(first stage's call, last stage's call, the past-end texts) of a pipeline of 2 stages, each
    stage facing the other: a call past the pipeline's end meets the call of the stage beside it."""
    kw = dict(batched=batched)
    x = torch.ones(2, 3)
    return {
        "both_receive": (lambda: recv_forward(G(), **kw), lambda: recv_backward(G(), **kw), (0, -1)),
        "last_sends_forward": (lambda: recv_forward(G(), **kw), lambda: send_forward(x, G(), **kw), (0, -1)),
        "wrong_direction": (lambda: send_forward(x, G(), **kw), lambda: recv_backward(G(), **kw), (-1,)),
        "first_sends_backward": (lambda: send_backward(x, G(), **kw), lambda: recv_forward(G(), **kw), (0,)),
    }[case]


@pytest.mark.world(2, timeout=20)
@pytest.mark.parametrize("batched", [False, True], ids=["ordered", "batched"])
@pytest.mark.parametrize("case", ["both_receive", "last_sends_forward", "wrong_direction", "first_sends_backward"])
def test_calls_past_the_ends_are_the_same_error_on_both_ends_in_check_mode(case, batched):
    """Checks on: a call past the pipeline's end says hello to the stage on its other side (the
    one facing it); both raise the same text, naming both calls and the missing stage, within
    2 s; only hellos moved; the stage past the end keeps its own message as the cause."""
    first, last, past = _past_end_calls(case, batched)
    P = world_size()
    with checks(True), CommLedger() as ledger:
        msg = _raises(ShardkitError, "nothing was transferred", first if rank() == 0 else last)
    for end in past:
        assert _PAST[end].format(P=P, last=P - 1) in msg, msg
    assert msg.startswith(f"P2P in a pipeline group of {P}: stage 0 (") and " and stage 1 (" in msg, msg
    assert {r.phase for r in ledger.records} == {"check"}
    with checks(True), pytest.raises(ShardkitError) as info:  # again, both stages: the cause
        (first if rank() == 0 else last)()
    mine = 0 if rank() == 0 else -1
    if mine in past:  # the stage past the end keeps its own (local) message as the cause
        assert _PAST[mine].format(P=P, last=P - 1) in str(info.value.__cause__), info.value.__cause__
    else:
        assert info.value.__cause__ is None
    _same_in_pair(msg)
    _assert_usable()


@pytest.mark.world(4, timeout=20)
def test_calls_past_the_ends_pp4_meet_the_stage_beside_them():
    """pp = 4, checks on: stage 0 receives a forward message (it has no previous stage) while
    stage 1 waits for its activation; stage 3 sends one forward while stage 2 sends it one. Each
    pair raises one text; the group is usable after."""
    s = rank()
    x = torch.ones(2, 3)
    calls = [
        lambda: recv_forward(G()),
        lambda: recv_forward(G()),
        lambda: send_forward(x, G()),
        lambda: send_forward(x, G()),
    ]
    with checks(True):
        msg = _raises(ShardkitError, "nothing was transferred", calls[s])
    if s < 2:
        assert msg.startswith(
            "P2P in a pipeline group of 4: stage 0 (recv_forward: receives forward) and stage 1 "
            "(recv_forward: receives forward): stage 0 is the first of 4 pipeline stages and has no "
            "previous stage"
        ), msg
    else:
        assert "stage 3 is the last of 4 pipeline stages and has no next stage" in msg, msg
    _same_in_pair(msg)
    _assert_usable()


def _bad_arguments():
    """The same on every rank: raised before any message."""
    f32 = torch.float32
    return {
        "not_a_tensor": (
            ShardkitTypeError,
            "expected a torch.Tensor",
            lambda: send_forward([1.0, 2.0], G(), loop=True),
        ),
        "none_gradient": (ShardkitTypeError, "expected a torch.Tensor", lambda: send_backward(None, G(), loop=True)),
        "static_recv_without_dtype": (
            ShardkitTypeError,
            "also needs dtype",
            lambda: recv_forward(G(), shape=(2,), loop=True),
        ),
        "negative_shape": (ShardkitError, ">= 0", lambda: recv_forward(G(), shape=(2, -1), dtype=f32, loop=True)),
        "shape_not_ints": (
            ShardkitTypeError,
            "sequence of ints",
            lambda: recv_forward(G(), shape=(2.0,), dtype=f32, loop=True),
        ),
        "dtype_not_a_dtype": (
            ShardkitTypeError,
            "torch.dtype",
            lambda: recv_forward(G(), shape=(2,), dtype="float32", loop=True),
        ),
        "unknown_reduce": (ShardkitError, "reduce must be", lambda: recv_forward(G(), reduce="max", loop=True)),
        "group_none": (ShardkitTypeError, "group is required", lambda: recv_forward(None)),
        "empty_group_list": (ShardkitTypeError, "empty list", lambda: send_forward(torch.ones(1), [])),
    }


@pytest.mark.world(2, timeout=20)
@pytest.mark.parametrize(
    "case",
    [
        "not_a_tensor",
        "none_gradient",
        "static_recv_without_dtype",
        "negative_shape",
        "shape_not_ints",
        "dtype_not_a_dtype",
        "unknown_reduce",
        "group_none",
        "empty_group_list",
    ],
)
def test_bad_arguments_raise_on_every_rank(case):
    expected, fragment, fn = _bad_arguments()[case]
    with CommLedger() as ledger:
        msg = _raises(expected, fragment, fn)
    assert ledger.count() == 0
    msgs = [None] * world_size()
    dist.all_gather_object(msgs, msg, group=G())
    assert len(set(msgs)) == 1, msgs  # the same message on every rank
    _assert_usable()


@pytest.mark.world(1, timeout=20)
def test_single_stage_has_no_neighbours():
    _raises(
        ShardkitError, "loop=True needs at least 2 pipeline stages", lambda: send_forward(torch.ones(1), G(), loop=True)
    )
    _raises(ShardkitError, "is the last of 1", lambda: send_forward(torch.ones(1), G()))


# ------------------------------------------------- misuse between two stages (checks on)


def _misuse_calls(case, batched):
    """(even stage's call, odd stage's call) of each misuse between stage pairs (2s, 2s + 1)."""
    kw = dict(batched=batched)
    x = torch.ones(2, 3)
    return {
        "both_send": (lambda: send_forward(x, G(), **kw), lambda: send_backward(x, G(), **kw)),
        "both_receive": (lambda: recv_backward(G(), **kw), lambda: recv_forward(G(), **kw)),
        # loop (pp = 2: the next stage is also the previous one): a forward message meets a
        # receive of gradients
        "wrong_direction": (lambda: send_forward(x, G(), loop=True, **kw), lambda: recv_backward(G(), loop=True, **kw)),
    }[case]


@pytest.mark.world(2, timeout=20)
@pytest.mark.parametrize("batched", [False, True], ids=["ordered", "batched"])
@pytest.mark.parametrize(
    "case, fragment",
    [
        ("both_send", "both send to each other"),
        ("both_receive", "both wait to receive from each other"),
        ("wrong_direction", "disagree on the direction"),
    ],
)
def test_misuse_is_the_same_error_on_both_ends(case, fragment, batched):
    even, odd = _misuse_calls(case, batched)
    with checks(True):
        msg = _raises(RankMismatchError, fragment, even if _pairs() else odd)
    msgs = [None] * world_size()
    dist.all_gather_object(msgs, msg, group=G())
    assert msgs[0] == msgs[1] and "stage 0 (" in msg and "stage 1 (" in msg and "nothing was transferred" in msg
    _assert_usable()


@pytest.mark.world(4, timeout=20)
def test_both_send_pp4_pairs():
    even, odd = _misuse_calls("both_send", False)
    with checks(True):
        msg = _raises(RankMismatchError, "both send to each other", even if _pairs() else odd)
    msgs = [None] * world_size()
    dist.all_gather_object(msgs, msg, group=G())
    assert msgs[0] == msgs[1] and msgs[2] == msgs[3] and "stage 2 (send_forward: sends forward)" in msgs[3]
    _assert_usable()
