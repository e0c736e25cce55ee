"""Pipeline schedules as pure tables: GPipe and 1F1B with one chunk per rank.

A schedule is a tuple with one entry per stage (``P`` stages), each an ordered tuple of
:class:`Action` ``("F" | "B", microbatch)`` over ``M`` microbatches. Communication is implied
by the actions, not listed:

* ``F(m)`` on stage ``s > 0`` first receives microbatch ``m``'s activation from ``s - 1``;
  on ``s < P - 1`` it then sends its output to ``s + 1``.
* ``B(m)`` on the last stage starts from the loss; on ``s < P - 1`` it first receives the
  gradient of its output from ``s + 1``; on ``s > 0`` it then sends its input gradient to
  ``s - 1``.

These are one-chunk ``F``/``B`` tables; the runner lifts them to :class:`~.steps.Step` tables
(:func:`.steps.lift`), which :mod:`.tables` builds for every schedule and :mod:`.simulate`
checks.

Sources: GPipe (Huang et al., 2019: all forwards, then all backwards); 1F1B / PipeDream-Flush
(Narayanan et al., 2021; Megatron-LM ``forward_backward_pipelining_without_interleaving``:
``min(P - s - 1, M)`` warm-up forwards, alternating steady state, cool-down backwards).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from ..errors import ShardkitError

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "Action",
    "gpipe_schedule",
    "one_f_one_b_schedule",
    "validate_schedule",
    "bubble_fraction",
]


class Action(NamedTuple):
    """One compute step of a stage: ``kind`` is ``"F"`` (forward) or ``"B"`` (backward)."""

    kind: str
    microbatch: int


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


def bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """The analytic bubble of GPipe and 1F1B with uniform stage times: ``(P - 1) / (M + P - 1)``."""
    _check_sizes("bubble_fraction", num_stages, num_microbatches)
    return (num_stages - 1) / (num_microbatches + num_stages - 1)
