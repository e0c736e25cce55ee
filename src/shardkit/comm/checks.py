"""Opt-in cross-rank checks: agree on collective metadata before communicating.

A collective whose ranks disagree on dtype or shape does not fail cleanly: it hangs, crashes the
backend or silently returns garbage. Checks that only one rank can see (its own local shape)
therefore cannot simply raise on that rank, or the others wait in the next collective forever.
With checks on, every shardkit collective first all-gathers a small int64 metadata row from each
rank (dtype, shape, arguments, this rank's local size and the size the op expects of it); every
rank then inspects the same table and raises the same :class:`RankMismatchError`. Inside a
tensor-parallel model's forward, one agreement on the forward's inputs covers the ops over tp
(:func:`covered`; shardkit.tensor_parallel._forward_checks).

Enable with ``shardkit.comm.checks(True)`` (also usable as ``with checks(True): ...``) or by
setting ``SHARDKIT_CHECKS=1`` before import. Cost: one metadata all-gather of
``R x 39`` int64 per forward op (measured by ``shardkit bench --cases checks``).

The row holds the op's identity, so two different ops never agree. Without explicit sizes an
op's local sizes may differ across ranks (uneven shards are learned, not assumed): then the
agreed table *is* the size metadata, and the op needs no second collective for it. A local
check that failed on one rank only (its own tensors) is flagged in the row and raised on every
rank, with one more all-gather of its message. Whether to check is a process setting read at
each call: every rank must set it alike (nothing here caches "already checked" per rank).
"""

from __future__ import annotations

import functools
import hashlib
import os

import torch

from ..errors import GroupMembershipError, RankMismatchError, ShardkitError, ShardkitTypeError
from . import ledger
from ._compat import all_gather_single
from ._group import GroupInfo
from .agree import gather_padded

__all__ = ["checks", "checks_enabled", "agree", "covered", "cover"]


class _CheckMode:
    """The check mode's whole state, in one object.

    It is process-wide on purpose: the documented switch is ``shardkit.checks(True)`` (or
    ``SHARDKIT_CHECKS=1``) for the whole program, every rank of a job sets it alike, and the
    ops it governs also run in backward, on autograd's worker threads, which a context variable
    or thread-local would not reach (the ledger is process-wide for the same reason).
    """

    def __init__(self) -> None:
        self.enabled = os.environ.get("SHARDKIT_CHECKS", "0") not in ("", "0", "false", "False")
        # Process groups whose ops are covered by an agreement already made for a whole region
        # (a tensor-parallel model's forward: see shardkit.tensor_parallel._forward_checks), by
        # id, with a nesting depth. Entered and left at the same program points on every rank
        # of the group, right after a collective agreement, so every rank decides alike
        # whether an op inside is checked.
        self.covered: dict[int, int] = {}


_MODE = _CheckMode()

# Stable dtype codes for the metadata row (index + 1; 0 means "unknown dtype").
_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
]
_MAX_DIMS = 16
_MAX_ARGS = 12
_OP_WORDS = 5  # the op's name, up to 40 ASCII bytes, as 5 int64 (so every rank can print every name)
# op name, dtype, ndim, 16 shape entries, 12 argument ints, error type, error length, local size, expected size
_ROW = _OP_WORDS + 2 + _MAX_DIMS + _MAX_ARGS + 4
_ERRORS = (ShardkitError, ShardkitTypeError, RankMismatchError, GroupMembershipError)  # code = index + 1
_AGREED = "; the check mode raised it on every rank)"


@functools.lru_cache(maxsize=256)
def _op_words(op: str) -> tuple[int, ...]:
    """The op's identity as ints, so that two ops that happen to take the same shapes
    (``all_reduce_forward`` on one rank, ``all_reduce_backward`` on another) still disagree."""
    raw = op.encode()[: 8 * _OP_WORDS].ljust(8 * _OP_WORDS, b"\0")
    return tuple(int.from_bytes(raw[i : i + 8], "little", signed=True) for i in range(0, len(raw), 8))


def _op_name(words: list[int]) -> str:
    return b"".join(w.to_bytes(8, "little", signed=True) for w in words).rstrip(b"\0").decode(errors="replace")


def _arg_ints(args) -> list[int]:
    """At most ``_MAX_ARGS`` ints: the arguments themselves, or when longer (a whole
    ``cu_seqlens``, per-rank sizes of a large group) the first ones and a digest of all.

    The digest is 64 bits of BLAKE2b over every value, so lists that differ anywhere (an interior
    ``cu_seqlens`` entry) disagree but for a 2**-64 chance; a CRC-32 would leave 2**-32."""
    args = [int(a) for a in args]
    if len(args) <= _MAX_ARGS:
        return args + [-2] * (_MAX_ARGS - len(args))
    digest = hashlib.blake2b(repr(args).encode(), digest_size=8).digest()
    return args[: _MAX_ARGS - 1] + [int.from_bytes(digest, "little", signed=True)]


class checks:
    """Turn the cross-rank check mode on or off; as a context manager, restore it on exit."""

    def __init__(self, enabled: bool = True) -> None:
        self._previous = _MODE.enabled
        _MODE.enabled = bool(enabled)

    def __enter__(self) -> checks:
        return self

    def __exit__(self, *exc) -> None:
        _MODE.enabled = self._previous


def checks_enabled() -> bool:
    """Whether the cross-rank check mode is on."""
    return _MODE.enabled


def covered(pg) -> bool:
    """Whether ops over ``pg`` are inside a region whose agreement covers them."""
    return _MODE.covered.get(id(pg), 0) > 0


def cover(pg, enter: bool) -> None:
    """Enter (``enter=True``) or leave a covered region of ``pg``; see :func:`covered`."""
    depth = _MODE.covered.get(id(pg), 0) + (1 if enter else -1)
    if depth > 0:
        _MODE.covered[id(pg)] = depth
    else:
        _MODE.covered.pop(id(pg), None)


def _dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) + 1 if dtype in _DTYPES else 0


def agree(
    g: GroupInfo,
    op: str,
    x: torch.Tensor,
    args: tuple[int, ...] = (),
    local_dim: int | None = None,
    expected_local: int | None = None,
    error: Exception | None = None,
) -> list[int] | None:
    """All-gather metadata and raise :class:`RankMismatchError` on every rank on disagreement.

    Args:
        g: the group.
        op: operation name for messages.
        x: the local input.
        args: integer arguments that must be identical on every rank (dims, sizes, flags).
        local_dim: the dim whose size may legitimately differ across ranks (masked out of the
            shape comparison), or None.
        expected_local: the size this op expects on this rank along ``local_dim``; None means
            any size (the op learns the sizes).
        error: a ShardkitError this rank's local checks raised (they ran first, so that an
            error seen by one rank only becomes the same error on every rank: the first
            flagged rank's, after one more small all-gather of its message).

    Returns:
        Every rank's size along ``local_dim`` (None without ``local_dim``).
    """
    shape = list(x.shape)
    local = -1
    if local_dim is not None and -len(shape) <= local_dim < len(shape):
        local = shape[local_dim]
        shape[local_dim] = -1
    row = [*_op_words(op), _dtype_code(x.dtype), x.dim(), *(shape + [-2] * _MAX_DIMS)[:_MAX_DIMS]]
    row += _arg_ints(args)
    message = b"" if error is None else _message(error, g).encode()
    row += [_error_code(error), len(message), local, -1 if expected_local is None else expected_local]
    mine = torch.tensor(row, dtype=torch.int64, device=x.device)
    table = mine.new_empty(g.size * _ROW)
    ledger.record("metadata_all_gather", op, "check", g.size, mine.nbytes, table.nbytes, pg=g.pg, shape=(_ROW,))
    all_gather_single(table, mine, group=g.pg)
    rows = table.view(g.size, _ROW).tolist()
    _raise_agreed_error(op, g, rows, message, x.device)
    _raise_on_mismatch(op, g, rows)
    return [row[-2] for row in rows] if local_dim is not None else None


def _raise_on_mismatch(op: str, g: GroupInfo, rows: list[list[int]]) -> None:
    names = ("op", "dtype", "ndim", "shape", "arguments")
    o = _OP_WORDS
    op = _op_name(rows[0][:o])  # rank 0's: the message must be identical on every rank
    spans = ((0, o), (o, o + 1), (o + 1, o + 2), (o + 2, o + 2 + _MAX_DIMS), (o + 2 + _MAX_DIMS, _ROW - 4))
    ref = rows[0][: _ROW - 4]
    agreed = all(row[: _ROW - 4] == ref for row in rows)  # the usual case: no field to search
    for name, (lo, hi) in zip(names, () if agreed else spans):
        ref = rows[0][lo:hi]
        bad = [r for r in range(g.size) if rows[r][lo:hi] != ref]
        if bad:
            raise RankMismatchError(
                f"{op}: ranks disagree on {name} in a group of {g.size}: "
                + "; ".join(f"rank {r}: {_describe(name, rows[r][lo:hi])}" for r in [0, *bad])
            )
    locals_ = [row[-2] for row in rows]
    expected = [row[-1] for row in rows]
    if any(e >= 0 for e in expected):
        bad = [r for r in range(g.size) if locals_[r] != expected[r]]
        if bad:
            raise RankMismatchError(
                f"{op}: local sizes of the sharded dim are {locals_} but the op expects {expected} "
                f"in a group of {g.size} (offending ranks {bad})"
            )


def _error_code(error) -> int:
    if error is None:
        return 0
    for i in reversed(range(len(_ERRORS))):  # most specific first
        if isinstance(error, _ERRORS[i]):
            return i + 1
    return 1


def _message(error, g: GroupInfo) -> str:
    text = str(error)
    if text.endswith(_AGREED):  # already agreed in another group (a 2-D mesh): pass it on as it is
        return text
    return f"{text} (raised on rank {g.rank} of {g.size}{_AGREED}"


def _raise_agreed_error(op: str, g: GroupInfo, rows: list[list[int]], message: bytes, device) -> None:
    """If any rank flagged a local error, raise the first flagged rank's on every rank.

    The decision is a function of the agreed table, so every rank takes the same branch (and
    the one extra all-gather, of the message bytes padded to the longest).
    """
    flagged = [r for r in range(g.size) if rows[r][-4] > 0]
    if not flagged:
        return
    width = max(rows[r][-3] for r in flagged)
    first = flagged[0]
    text = gather_padded(g, op, message, width, device)[first][: rows[first][-3]].decode(errors="replace")
    raise _ERRORS[rows[first][-4] - 1](text)


def _describe(name: str, values: list[int]) -> str:
    if name == "op":
        return _op_name(values)
    if name == "dtype":
        code = values[0]
        return str(_DTYPES[code - 1]) if code > 0 else "unknown"
    if name == "shape":
        return str(tuple("*" if v == -1 else v for v in values if v != -2))
    return str([v for v in values if v != -2])
