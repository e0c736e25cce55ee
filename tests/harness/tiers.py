"""The quick and the slow tier of a layout matrix (docs/design.md, Testing).

A matrix test runs many compositions of the same code path. The quick tier (``-m "not slow"``,
the inner loop) keeps one representative case of each distinct path; the other cases are marked
``slow``, and CI (``python -m pytest -q``, every tier) still runs them all::

    CASES = {"tp=2 x dp=2": dict(tp=2), "tp=4": dict(tp=4), ...}
    QUICK = ("tp=2 x dp=2",)  # why this one stays, in a comment here


    @pytest.mark.parametrize("overrides", tiered(CASES, QUICK))
    def test_layout(overrides): ...

Every other parametrized test is tiered by rule (:func:`mark_matrix`, run by conftest at
collection): the quick tier keeps the fewest cases in which each value of each argument appears
once (:func:`covering`); the rest of the product is marked ``matrix`` and ``slow``. A test whose
every combination is a path of its own says so with ``@pytest.mark.combinations``; a test of hand-picked
edge cases plus a pseudo-random sample of a grid keeps the edge cases (:func:`edge_and_sample`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import pytest


def tiered(cases: Mapping[str, object], quick: Iterable[str]) -> list:
    """``pytest.param`` per case of ``cases`` (id = its key), marked ``slow`` unless in ``quick``.

    Args:
        cases: id -> parametrize value; a tuple is unpacked over several argument names, as
            pytest does for a plain tuple.
        quick: the ids that stay in the quick tier.

    Returns:
        The list to hand to ``pytest.mark.parametrize``, in the order of ``cases``.

    Raises:
        ValueError: ``quick`` is empty or names an id that ``cases`` lacks (a typo would
            otherwise move every case out of the quick tier unnoticed).
    """
    keep = set(quick)
    unknown = sorted(keep - set(cases))
    if not keep or unknown:
        raise ValueError(f"tiered: the quick cases must be a non-empty subset of the ids; unknown {unknown}")
    return [
        pytest.param(
            *(value if isinstance(value, tuple) else (value,)),
            id=name,
            marks=() if name in keep else pytest.mark.slow,
        )
        for name, value in cases.items()
    ]


def edge_and_sample(edge: Sequence[object], sample: Sequence[object], ids: Sequence[str]) -> list:
    """``pytest.param`` per case of ``edge + sample``: the hand-picked edge cases stay in the quick
    tier, the pseudo-random sample of the same grid is the matrix tier (marked ``matrix`` and
    ``slow``).

    A sampled grid (kernel x stride x padding x ...) explores combinations of paths that its edge
    cases already take one by one; :func:`mark_matrix` cannot tell, since each sampled case is one
    distinct value of a single argument.

    Args:
        edge: the edge cases, each one path the test must take in the quick tier.
        sample: the sampled cases.
        ids: one id per case of ``edge + sample``, in that order.

    Raises:
        ValueError: ``edge`` is empty or ``ids`` has not one id per case.
    """
    if not edge or len(ids) != len(edge) + len(sample):
        raise ValueError(f"edge_and_sample: {len(edge)} edge cases, {len(sample)} sampled, {len(ids)} ids")
    sampled_marks = (pytest.mark.slow, pytest.mark.matrix)
    return [
        pytest.param(case, id=name, marks=() if i < len(edge) else sampled_marks)
        for i, (case, name) in enumerate(zip([*edge, *sample], ids, strict=True))
    ]


# ------------------------------------------------ the matrix tier: pytest.mark.parametrize products

MATRIX = "matrix"
ALL_QUICK = "combinations"  # opt-out: every combination of this test is a distinct path


def _value_key(value: object) -> str:
    # Parametrize values may be unhashable (dicts of overrides) or objects without a stable id;
    # their repr names them as pytest's ids do.
    return f"{type(value).__qualname__}:{value!r}"[:200]


def covering(params: Sequence[Mapping[str, object]]) -> list[int]:
    """Indices of a small subset of ``params`` (one dict of argument -> value per case) in which
    every value of every argument appears at least once: greedy set cover, in case order.

    The cases of a ``pytest.mark.parametrize`` product differ by one argument at a time; each
    value is one path through the code (a dtype, a split kind, a layout), so one case holding it
    proves the path, and the product of independent arguments adds cases, not paths. A 4 x 3 x 2
    product keeps 4 cases.

    Example:
        >>> covering([dict(a=1, b="x"), dict(a=1, b="y"), dict(a=2, b="x"), dict(a=2, b="y")])
        [0, 3]
    """
    pairs = [{(k, _value_key(v)) for k, v in p.items()} for p in params]
    uncovered = set().union(*pairs) if pairs else set()
    kept: list[int] = []
    while uncovered:
        best = max(range(len(pairs)), key=lambda i: (len(pairs[i] & uncovered), -i))
        kept.append(best)
        uncovered -= pairs[best]
    return sorted(kept)


def mark_matrix(items: Sequence[pytest.Item]) -> int:
    """Mark ``matrix`` (and ``slow``: not in the quick tier) the parametrized cases that
    :func:`covering` leaves out, per test function, among its cases not already ``slow`` or
    ``meta``; a function marked ``combinations`` keeps every case. Returns how many were marked.
    CI (``python -m pytest -q``) still runs them; ``-m matrix`` runs only them."""
    by_function: dict[tuple[str, str], list[pytest.Item]] = {}
    for item in items:
        spec = getattr(item, "callspec", None)
        if spec is None or not spec.params or any(item.get_closest_marker(m) for m in ("slow", "meta", ALL_QUICK)):
            continue
        by_function.setdefault((str(item.path), getattr(item, "originalname", item.name)), []).append(item)
    marked = 0
    for cases in by_function.values():
        keep = set(covering([c.callspec.params for c in cases]))
        for i, case in enumerate(cases):
            if i not in keep:
                case.add_marker(pytest.mark.slow)
                case.add_marker(pytest.mark.matrix)
                marked += 1
    return marked
