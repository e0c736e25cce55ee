"""Pipeline schedules as pure tables, their communication plan and a blocking-P2P simulator.

A schedule is a tuple with one entry per stage (``P`` stages), each an ordered tuple of
:class:`Action` ``("F" | "B", microbatch)`` over ``M`` microbatches. Communication is implied
by the actions, not listed:

* ``F(m)`` on stage ``s > 0`` first receives microbatch ``m``'s activation from ``s - 1``;
  on ``s < P - 1`` it then sends its output to ``s + 1``.
* ``B(m)`` on the last stage starts from the loss; on ``s < P - 1`` it first receives the
  gradient of its output from ``s + 1``; on ``s > 0`` it then sends its input gradient to
  ``s - 1``.

:func:`comm_plan` turns one stage's actions into the exact sequence of P2P calls a runner makes
(pairing a send with the next action's receive, as Megatron-LM's 1F1B steady state does), and
:func:`simulate` executes all stages' plans with blocking (rendezvous) P2P semantics, the worst
case of NCCL: it reports a deadlock or a message matched out of order, and the time line.

These are the runner's one-chunk ``F``/``B`` tables. Tables with virtual stages and the
zero-bubble ``I``/``W`` split are :mod:`.tables` (checked by :mod:`.simulate`).

Sources: GPipe (Huang et al., 2019: all forwards, then all backwards); 1F1B / PipeDream-Flush
(Narayanan et al., 2021; Megatron-LM ``forward_backward_pipelining_without_interleaving``:
``min(P - s - 1, M)`` warm-up forwards, alternating steady state, cool-down backwards).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, NamedTuple

from ..errors import ShardkitError
from ._transfer import order_key

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "Action",
    "CommCall",
    "SimResult",
    "gpipe_schedule",
    "one_f_one_b_schedule",
    "validate_schedule",
    "comm_plan",
    "simulate",
    "check_deadlock_free",
    "bubble_fraction",
]


class Action(NamedTuple):
    """One compute step of a stage: ``kind`` is ``"F"`` (forward) or ``"B"`` (backward)."""

    kind: str
    microbatch: int


class CommCall(NamedTuple):
    """One step of a stage's plan.

    ``api`` is ``"compute"`` (``action`` set, no messages) or the name of a
    :mod:`shardkit.pipeline_parallel.p2p` function; ``sends``/``recvs`` list
    ``(towards, direction, microbatch)`` with ``towards`` in ``{"next", "prev"}`` and
    ``direction`` in ``{"F", "B"}``.
    """

    api: str
    action: Action | None = None
    sends: tuple = ()
    recvs: tuple = ()


def _check_sizes(op: str, num_stages, num_microbatches) -> None:
    for name, v in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise ShardkitError(f"{op}: {name} must be an int, got {v!r}")
        if v < 1:
            raise ShardkitError(f"{op}: {name} must be >= 1, got {v}")


def gpipe_schedule(num_stages: int, num_microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """GPipe: every stage runs ``F(0..M-1)`` then ``B(0..M-1)``.

    Peak stored activations per stage: ``M``. Bubble fraction ``(P - 1) / (M + P - 1)``.

    Raises:
        ShardkitError: ``num_stages`` or ``num_microbatches`` not an int >= 1.
    """
    _check_sizes("gpipe_schedule", num_stages, num_microbatches)
    stage = tuple(Action("F", m) for m in range(num_microbatches)) + tuple(
        Action("B", m) for m in range(num_microbatches)
    )
    return tuple(stage for _ in range(num_stages))


def one_f_one_b_schedule(num_stages: int, num_microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """1F1B (PipeDream-Flush): stage ``s`` runs ``w = min(P - s - 1, M)`` warm-up forwards,
    then alternates ``F(w + i), B(i)``, then the remaining backwards.

    Peak stored activations on stage ``s``: ``min(P - s, M)``. Same bubble as GPipe.

    Raises:
        ShardkitError: ``num_stages`` or ``num_microbatches`` not an int >= 1.
    """
    _check_sizes("one_f_one_b_schedule", num_stages, num_microbatches)
    P, M = num_stages, num_microbatches
    table = []
    for s in range(P):
        w = min(P - s - 1, M)
        acts = [Action("F", m) for m in range(w)]
        for i in range(M - w):
            acts += [Action("F", w + i), Action("B", i)]
        acts += [Action("B", m) for m in range(M - w, M)]
        table.append(tuple(acts))
    return tuple(table)


def validate_schedule(
    schedule: Sequence[Sequence[Action]], num_stages: int, op: str = "validate_schedule", *, forward_only: bool = False
) -> int:
    """Check a table's structure; return ``M``, the number of microbatches.

    Every stage must run ``F(m)`` and ``B(m)`` (``forward_only``: ``F(m)`` alone) exactly once for
    ``m`` in ``0..M-1`` (the same ``M`` on every stage), ``F(m)`` before ``B(m)``. Pure.

    Raises:
        ShardkitError: wrong number of stages, unknown action, a microbatch missing, repeated
            or backwarded before its forward.
    """
    if not isinstance(schedule, (list, tuple)) or len(schedule) != num_stages:
        n = len(schedule) if isinstance(schedule, (list, tuple)) else type(schedule).__name__
        raise ShardkitError(f"{op}: the schedule must have one action list per stage ({num_stages}), got {n}")
    sizes = set()
    for s, acts in enumerate(schedule):
        seen_f: set[int] = set()
        seen_b: set[int] = set()
        for a in acts:
            if not isinstance(a, tuple) or len(a) != 2 or a[0] not in ("F", "B") or not isinstance(a[1], int):
                raise ShardkitError(f"{op}: stage {s}: bad action {a!r}; expected Action('F'|'B', microbatch)")
            kind, m = a
            seen = seen_f if kind == "F" else seen_b
            if m in seen:
                raise ShardkitError(f"{op}: stage {s} runs {kind}({m}) twice")
            if kind == "B" and m not in seen_f:
                raise ShardkitError(f"{op}: stage {s} runs B({m}) before F({m})")
            seen.add(m)
        M = len(seen_f)
        if seen_f != set(range(M)) or seen_b != (set() if forward_only else seen_f):
            what = "F" if forward_only else "F and B"
            raise ShardkitError(
                f"{op}: stage {s} must run {what} of microbatches 0..{M - 1} exactly once, "
                f"got F{sorted(seen_f)} B{sorted(seen_b)}"
            )
        sizes.add(M)
    if len(sizes) != 1 or 0 in sizes:
        raise ShardkitError(f"{op}: every stage must run the same number (>= 1) of microbatches, got {sorted(sizes)}")
    return sizes.pop()


def comm_plan(actions, stage: int, num_stages: int) -> tuple[CommCall, ...]:
    """The P2P calls and computes stage ``stage`` makes to run ``actions``, in order.

    Receives come right before the action that needs them unless an earlier combined call
    brought the tensor already. A send is combined with the next action's receive when they go
    to the same neighbour, as in Megatron-LM's 1F1B steady state: ``F`` followed by ``B``
    gives ``send_forward_recv_backward`` (output to ``s + 1``, gradient from ``s + 1``), ``B``
    followed by ``F`` gives ``send_backward_recv_forward`` (input gradient to ``s - 1``,
    activation from ``s - 1``).
    """
    first, last = stage == 0, stage == num_stages - 1
    acts = list(actions)
    plan, have = [], set()  # have: (direction, microbatch) already received
    for i, (kind, m) in enumerate(acts):
        nxt = acts[i + 1] if i + 1 < len(acts) else None
        if kind == "F":
            if not first and ("F", m) not in have:
                plan.append(CommCall("recv_forward", recvs=(("prev", "F", m),)))
            plan.append(CommCall("compute", Action("F", m)))
            if not last:
                if nxt is not None and nxt[0] == "B":
                    have.add(("B", nxt[1]))
                    plan.append(
                        CommCall(
                            "send_forward_recv_backward", sends=(("next", "F", m),), recvs=(("next", "B", nxt[1]),)
                        )
                    )
                else:
                    plan.append(CommCall("send_forward", sends=(("next", "F", m),)))
        else:
            if not last and ("B", m) not in have:
                plan.append(CommCall("recv_backward", recvs=(("next", "B", m),)))
            plan.append(CommCall("compute", Action("B", m)))
            if not first:
                if nxt is not None and nxt[0] == "F":
                    have.add(("F", nxt[1]))
                    plan.append(
                        CommCall(
                            "send_backward_recv_forward", sends=(("prev", "B", m),), recvs=(("prev", "F", nxt[1]),)
                        )
                    )
                else:
                    plan.append(CommCall("send_backward", sends=(("prev", "B", m),)))
    return tuple(plan)


@dataclass(frozen=True)
class SimResult:
    """Outcome of :func:`simulate`: ``error`` names a deadlock or mismatched messages (else
    None); ``makespan``, per-stage ``busy`` time and ``peak_activations`` (forwards stored and
    not yet backwarded) describe the run (up to the failure, if any)."""

    makespan: float
    busy: tuple[float, ...]
    peak_activations: tuple[int, ...]
    error: str | None = None

    @property
    def bubble_fraction(self) -> float:
        """Idle time over total time, over all stages: ``1 - sum(busy) / (P * makespan)``."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)


def _messages(call: CommCall, stage: int):
    """A call's messages in the order the ordered P2P mode posts (and completes) them."""
    msgs = [(True, t, d, m) for t, d, m in call.sends] + [(False, t, d, m) for t, d, m in call.recvs]
    return sorted(msgs, key=lambda x: order_key(stage, x[0], x[1]))


def simulate(schedule: Sequence[Sequence[Action]], f_time: float = 1.0, b_time: float = 1.0) -> SimResult:
    """Execute every stage's :func:`comm_plan` with blocking P2P: a send and a receive complete
    together when both are at the head of their stages' programs (rendezvous, zero transfer
    time); messages on a channel ``(src, dst, direction)`` match in FIFO order and must carry
    the same microbatch. Computes take ``f_time``/``b_time``.

    Returns a :class:`SimResult` whose ``error`` names a deadlock or a mismatched message.
    """
    P = len(schedule)
    progs = []
    for s, acts in enumerate(schedule):
        ops: list[tuple[str, Any]] = []  # ("compute", Action) or ("msg", (is_send, towards, dir, mb))
        for call in comm_plan(acts, s, P):
            ops += [("compute", call.action)] if call.api == "compute" else [("msg", x) for x in _messages(call, s)]
        progs.append(ops)
    pc, clock, busy = [0] * P, [0.0] * P, [0.0] * P
    live, peak = [0] * P, [0] * P
    while True:
        progressed = False
        for s in range(P):
            while pc[s] < len(progs[s]):
                kind, x = progs[s][pc[s]]
                if kind == "compute":
                    dt = f_time if x.kind == "F" else b_time
                    clock[s] += dt
                    busy[s] += dt
                    live[s] += 1 if x.kind == "F" else -1
                    peak[s] = max(peak[s], live[s])
                    pc[s] += 1
                    progressed = True
                    continue
                is_send, towards, direction, m = x
                peer = s + (1 if towards == "next" else -1)
                if pc[peer] >= len(progs[peer]) or progs[peer][pc[peer]][0] != "msg":
                    break
                p_send, p_towards, p_dir, p_m = progs[peer][pc[peer]][1]
                if p_send == is_send or p_dir != direction or peer + (1 if p_towards == "next" else -1) != s:
                    break
                if p_m != m:
                    why = f"stages {s} and {peer} matched {direction} messages of microbatches {m} and {p_m}"
                    return SimResult(max(clock), tuple(busy), tuple(peak), why)
                clock[s] = clock[peer] = max(clock[s], clock[peer])
                pc[s] += 1
                pc[peer] += 1
                progressed = True
        if all(pc[s] == len(progs[s]) for s in range(P)):
            return SimResult(max(clock), tuple(busy), tuple(peak))
        if not progressed:
            stuck = {s: progs[s][pc[s]] for s in range(P) if pc[s] < len(progs[s])}
            why = f"deadlock: blocked stages and their next step: {stuck}"
            return SimResult(max(clock), tuple(busy), tuple(peak), why)


@lru_cache(maxsize=64)
def _checked(schedule) -> SimResult:
    return simulate(schedule)


def check_deadlock_free(schedule, op: str) -> None:
    """Raise ShardkitError if :func:`simulate` finds a deadlock or out-of-order messages
    (cached per table; pure, so every rank raises the same error)."""
    key = tuple(tuple(Action(*a) for a in acts) for acts in schedule)
    result = _checked(key)
    if result.error is not None:
        raise ShardkitError(f"{op}: the schedule cannot run with blocking P2P: {result.error}")


def bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """The analytic bubble of GPipe and 1F1B with uniform stage times: ``(P - 1) / (M + P - 1)``."""
    _check_sizes("bubble_fraction", num_stages, num_microbatches)
    return (num_stages - 1) / (num_microbatches + num_stages - 1)
