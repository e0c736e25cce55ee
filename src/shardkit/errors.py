"""Exceptions raised by shardkit.

Every error shardkit raises derives from :class:`ShardkitError`, itself a ``ValueError``, so
callers can catch one type. Checks that could fail on a single rank are either pure functions of
arguments every rank agrees on, or are agreed collectively (see :mod:`shardkit.comm.checks`),
so that every rank of a group raises the same error instead of the others hanging in the next
collective.
"""

from __future__ import annotations

__all__ = [
    "ShardkitError",
    "ShardkitTypeError",
    "GroupMembershipError",
    "RankMismatchError",
    "NonFiniteError",
]


class ShardkitError(ValueError):
    """Base class of every shardkit error (a ``ValueError``)."""


class ShardkitTypeError(ShardkitError, TypeError):
    """An argument has the wrong type or dtype (also a ``TypeError``)."""


class GroupMembershipError(ShardkitError):
    """The calling rank is not a member of the process group it passed."""


class RankMismatchError(ShardkitError):
    """Ranks of one group disagree on metadata (dtype, shape, sizes) of a collective.

    Raised identically on every rank of the group by the opt-in cross-rank check mode.
    """


class NonFiniteError(ShardkitError):
    """A training step's global loss or gradient norm is NaN or infinite.

    Raised identically on every rank (both values are all-reduced over the world before the
    optimizer steps), so nothing non-finite was applied to the weights.
    """
