"""The quick and the slow tier of a layout matrix (docs/design.md, Testing).

A matrix test runs many compositions of the same code path. The quick tier (``-m "not slow"``,
the inner loop) keeps one representative case of each distinct path; the other cases are marked
``slow``, and CI (``python -m pytest -q``, every tier) still runs them all::

    CASES = {"tp=2 x dp=2": dict(tp=2), "tp=4": dict(tp=4), ...}
    QUICK = ("tp=2 x dp=2",)  # why this one stays, in a comment here


    @pytest.mark.parametrize("overrides", tiered(CASES, QUICK))
    def test_layout(overrides): ...
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

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
