"""The fixed P2P posting order never deadlocks and pairs every message with the right one.

Pure simulation, no process group. Every rank's messages of one exchange are laid out as the
engine posts them: ordered mode transfer by transfer in :func:`posting_order` (header and
payload each a batch of one; with checks, the two hellos of the handshake, out and in, in
:func:`posting_order`, then the payload), batched mode one batch per phase in :func:`posting_order`. A batch
completes when each of its messages pairs with the FIFO-matching message in the peer's current
batch, the rendezvous semantics of NCCL (a send does not complete before its receive is posted;
messages inside one ``batch_isend_irecv`` progress together). Messages between two ranks pair
in FIFO order, without tags. Every combination of active links (each forward link s -> s + 1
and each backward link s + 1 -> s, on or off) for 2-5 stages, with and without ``loop``: a
deadlock, or a forward message paired with a backward one, fails.
"""

import itertools
from collections import defaultdict

import pytest

from shardkit.pipeline_parallel._transfer import order_key, posting_order

KINDS = {"dynamic": ("header", "payload"), "static": ("payload",), "checks": ("hello", "payload")}


def _links(n, loop):
    last = n if loop else n - 1
    return [(kind, s) for kind in ("fwd", "bwd") for s in range(last)]


def _transfers(n, active):
    """Per rank: (is_send, towards, peer, label) of every active link."""
    per_rank = {r: [] for r in range(n)}
    for kind, s in active:
        t = (s + 1) % n
        if kind == "fwd":  # s sends an activation to its next stage t
            per_rank[s].append((True, "next", t, (kind, s)))
            per_rank[t].append((False, "prev", s, (kind, s)))
        else:  # t sends a gradient to its previous stage s
            per_rank[t].append((True, "prev", s, (kind, s)))
            per_rank[s].append((False, "next", t, (kind, s)))
    return per_rank


def _batches(rank, transfers, kinds, batched, order):
    """The rank's batches of (is_send, peer, label), in posting order. A ``"hello"`` is two
    messages on the transfer's link: this rank's hello out and the peer's hello in."""
    items = [(0, rank, send, towards) for send, towards, _, _ in transfers]

    def msgs(i, kind):  # [(is_send, item for the posting order, message)] of transfer i
        send, towards, peer, label = transfers[i]
        phase = "forward" if label[0] == "fwd" else "backward"
        if kind != "hello":
            return [((*items[i], phase), (send, peer, (kind, label)))]
        return [((0, rank, out, towards, phase), (out, peer, (kind, label))) for out in (True, False)]

    def in_order(pairs):  # posting order, forward before backward (message_order)
        keys = [p[0] for p in pairs]
        by_slot = order([k[:4] for k in keys])
        first = {}  # position of each distinct slot in ``order``; equal slots tie-break by phase
        for n, j in enumerate(by_slot):
            first.setdefault(keys[j][:4], n)
        return [pairs[j][1] for j in sorted(by_slot, key=lambda j: (first[keys[j][:4]], keys[j][4] != "forward"))]

    if not batched:
        return [[m] for i in order(items) for kind in kinds for m in in_order(msgs(i, kind))]
    batches = [in_order([m for i in range(len(items)) for m in msgs(i, kind)]) for kind in kinds]
    return [b for b in batches if b]


def _simulate(n, active, kinds, batched, order=posting_order):
    per_rank = _transfers(n, active)
    batches = {r: _batches(r, per_rank[r], kinds, batched, order) for r in range(n)}
    stuck = _run(batches, f"n={n} links={active}")
    assert not stuck, f"deadlock: n={n} links={active} kinds={kinds} batched={batched}: stuck at {stuck}"


def _run(batches, what=""):
    """Complete the ranks' batches under rendezvous semantics; return {rank: stuck batch}."""
    # FIFO pairing: the k-th send a -> b meets the k-th receive at b from a.
    sends, recvs = defaultdict(list), defaultdict(list)
    for r, rank_batches in batches.items():
        for bi, batch in enumerate(rank_batches):
            for is_send, peer, label in batch:
                (sends[(r, peer)] if is_send else recvs[(peer, r)]).append((r, bi, label))
    assert {k: len(v) for k, v in sends.items()} == {k: len(v) for k, v in recvs.items()}
    pairs = []
    for key in sends:
        for (a, ba, la), (b, bb, lb) in zip(sends[key], recvs[key]):
            assert la == lb, f"{what}: {la} from {a} paired with {lb} at {b}"
            pairs.append(((a, ba), (b, bb)))
    current = dict.fromkeys(batches, 0)
    left = defaultdict(int)  # unmatched messages per (rank, batch)
    for x, y in pairs:
        left[x] += 1
        left[y] += 1
    todo = set(range(len(pairs)))
    progress = True
    while progress:
        progress = False
        for i in list(todo):
            (a, ba), (b, bb) = pairs[i]
            if current[a] == ba and current[b] == bb:  # both ends are posted
                todo.discard(i)
                left[(a, ba)] -= 1
                left[(b, bb)] -= 1
                progress = True
        for r in batches:
            while current[r] < len(batches[r]) and left[(r, current[r])] == 0:
                current[r] += 1
                progress = True
    return {r: batches[r][current[r]] for r in batches if current[r] < len(batches[r])}


@pytest.mark.combinations  # the FIFO pairing of one exchange depends on its pair of sides and sizes (ms a case)
@pytest.mark.parametrize("batched", [False, True], ids=["ordered", "batched"])
@pytest.mark.parametrize("mode", sorted(KINDS))
@pytest.mark.parametrize("loop", [False, True], ids=["", "loop"])
@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_every_exchange_completes_in_fifo_order(n, loop, mode, batched):
    links = _links(n, loop)
    for mask in itertools.product([False, True], repeat=len(links)):
        _simulate(n, [link for link, on in zip(links, mask) if on], KINDS[mode], batched)


def _sends_first(items):
    return sorted(range(len(items)), key=lambda i: not items[i][2])


def _swapped_on_even_stages(items):
    """The right alternation of sends and receives, but even stages treat prev as next."""
    flip = {"next": "prev", "prev": "next"}
    return sorted(
        range(len(items)),
        key=lambda i: order_key(items[i][1], items[i][2], flip[items[i][3]] if items[i][1] % 2 == 0 else items[i][3]),
    )


def test_simulator_catches_bad_orders():
    """The simulator is strict enough: every stage sending first deadlocks (pp=2), and posting
    backward traffic first on one side pairs a gradient with an activation (pp=2, loop)."""
    with pytest.raises(AssertionError, match="deadlock"):
        _simulate(2, [("fwd", 0), ("fwd", 1)], KINDS["static"], False, order=_sends_first)
    every = [("fwd", 0), ("fwd", 1), ("bwd", 0), ("bwd", 1)]
    for batched in (False, True):
        with pytest.raises(AssertionError, match="paired with"):
            _simulate(2, every, KINDS["static"], batched, order=_swapped_on_even_stages)


def test_batched_dynamic_combined_calls_need_a_mirror_call():
    """Documented limit of batched mode: a combined call against the two single calls on its
    peer deadlocks with dynamic shapes (the header batch waits for the peer's second call);
    ordered mode completes it, and so does batched mode against the mirror combined call."""

    def batches(batched, mirror):
        dyn = KINDS["dynamic"]
        # Stage 0: send_forward_recv_backward (one exchange).
        b0 = _batches(0, [(True, "next", 1, "f"), (False, "next", 1, "b")], dyn, batched, posting_order)
        if mirror:  # stage 1: send_backward_recv_forward
            b1 = _batches(1, [(False, "prev", 0, "f"), (True, "prev", 0, "b")], dyn, batched, posting_order)
        else:  # stage 1: recv_forward, then send_backward
            b1 = _batches(1, [(False, "prev", 0, "f")], dyn, batched, posting_order)
            b1 += _batches(1, [(True, "prev", 0, "b")], dyn, batched, posting_order)
        return {0: b0, 1: b1}

    assert not _run(batches(False, mirror=False))
    assert not _run(batches(True, mirror=True))
    assert _run(batches(True, mirror=False))
