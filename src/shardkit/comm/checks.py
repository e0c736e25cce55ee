"""Opt-in cross-rank checks: agree on collective metadata before communicating.

A collective whose ranks disagree on dtype or shape does not fail cleanly: it hangs, crashes the
backend or silently returns garbage. Checks that only one rank can see (its own local shape)
therefore cannot simply raise on that rank, or the others wait in the next collective forever.
With checks on, every shardkit collective first all-gathers a small int64 metadata row from each
rank (dtype, shape, arguments, this rank's local size and the size the op expects of it); every
rank then inspects the same table and raises the same :class:`RankMismatchError`.

Enable with ``shardkit.comm.checks(True)`` (also usable as ``with checks(True): ...``) or by
setting ``SHARDKIT_CHECKS=1`` before import. Cost: one metadata all-gather of
``R x 32`` int64 per forward op.
"""

from __future__ import annotations

import os

import torch

from ..errors import RankMismatchError
from . import ledger
from ._compat import all_gather_single
from ._group import GroupInfo

__all__ = ["checks", "checks_enabled", "agree"]

_state = {"enabled": os.environ.get("SHARDKIT_CHECKS", "0") not in ("", "0", "false", "False")}

# Stable dtype codes for the metadata row (index + 1; 0 means "unknown dtype").
_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
]
_MAX_DIMS = 16
_ROW = 32  # dtype, ndim, 16 shape entries, up to 12 argument ints, local size, expected size


class checks:
    """Turn the cross-rank check mode on or off; as a context manager, restore it on exit."""

    def __init__(self, enabled: bool = True) -> None:
        self._previous = _state["enabled"]
        _state["enabled"] = bool(enabled)

    def __enter__(self) -> "checks":
        return self

    def __exit__(self, *exc) -> None:
        _state["enabled"] = self._previous


def checks_enabled() -> bool:
    """Whether the cross-rank check mode is on."""
    return _state["enabled"]


def _dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) + 1 if dtype in _DTYPES else 0


def agree(
    g: GroupInfo,
    op: str,
    x: torch.Tensor,
    args: tuple[int, ...] = (),
    local_dim: int | None = None,
    expected_local: int | None = None,
) -> None:
    """All-gather metadata and raise :class:`RankMismatchError` on every rank on disagreement.

    Args:
        g: the group.
        op: operation name for messages.
        x: the local input.
        args: integer arguments that must be identical on every rank (dims, sizes, flags).
        local_dim: the dim whose size may legitimately differ across ranks (masked out of the
            shape comparison), or None.
        expected_local: the size this op expects on this rank along ``local_dim``; None means
            "the same on every rank".
    """
    shape = list(x.shape)
    local = -1
    if local_dim is not None and -len(shape) <= local_dim < len(shape):
        local = shape[local_dim]
        shape[local_dim] = -1
    row = [_dtype_code(x.dtype), x.dim(), *(shape + [-2] * _MAX_DIMS)[:_MAX_DIMS]]
    row += (list(args) + [-2] * 12)[:12]
    row += [local, -1 if expected_local is None else expected_local]
    mine = torch.tensor(row, dtype=torch.int64, device=x.device)
    table = mine.new_empty(g.size * _ROW)
    all_gather_single(table, mine, group=g.pg)
    ledger.record("metadata_all_gather", op, "check", g.size, mine.nbytes, table.nbytes)
    rows = table.view(g.size, _ROW).tolist()
    _raise_on_mismatch(op, g, rows)


def _raise_on_mismatch(op: str, g: GroupInfo, rows: list[list[int]]) -> None:
    names = ("dtype", "ndim", "shape", "arguments")
    spans = ((0, 1), (1, 2), (2, 2 + _MAX_DIMS), (2 + _MAX_DIMS, _ROW - 2))
    for name, (lo, hi) in zip(names, spans):
        ref = rows[0][lo:hi]
        bad = [r for r in range(g.size) if rows[r][lo:hi] != ref]
        if bad:
            raise RankMismatchError(
                f"{op}: ranks disagree on {name} in a group of {g.size}: "
                + "; ".join(f"rank {r}: {_describe(name, rows[r][lo:hi])}" for r in [0, *bad])
            )
    locals_ = [row[-2] for row in rows]
    expected = [row[-1] for row in rows]
    if all(e < 0 for e in expected):
        bad = [r for r in range(g.size) if locals_[r] != locals_[0]]
        if bad:
            raise RankMismatchError(
                f"{op}: local sizes of the sharded dim must be equal on all {g.size} ranks "
                f"(no explicit sizes given), got {locals_} (ranks {bad} differ from rank 0)"
            )
    else:
        bad = [r for r in range(g.size) if locals_[r] != expected[r]]
        if bad:
            raise RankMismatchError(
                f"{op}: local sizes of the sharded dim are {locals_} but the op expects {expected} "
                f"in a group of {g.size} (offending ranks {bad})"
            )


def _describe(name: str, values: list[int]) -> str:
    if name == "dtype":
        code = values[0]
        return str(_DTYPES[code - 1]) if code > 0 else "unknown"
    if name == "shape":
        return str(tuple("*" if v == -1 else v for v in values if v != -2))
    return str([v for v in values if v != -2])
