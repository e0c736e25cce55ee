"""Wire format of pipeline P2P messages: the shape/dtype header, and the hellos of the check mode.

A transfer with dynamic shapes is a fixed-size int64 *header* followed by the payload::

    [MAGIC, status, dtype code, ndim, d0, d1, ..., d15]      (HEADER_LEN = 20 int64 = 160 bytes)

The receiver allocates the payload buffer from it, so shapes (any ndim up to 16) and dtypes can
change from one microbatch to the next. ``status`` lets a sender that found a problem with its
own tensor tell the receiver instead of leaving it waiting: any status other than ``OK`` means
no payload follows.

With checks on, both ends of a transfer first exchange a *hello* (``HELLO_LEN`` int64): a header
(the sender's tensor, or the receiver's declaration with status ``OK``) followed by the author's
role (send or receive), message phase (forward or backward), group rank and api name. Each end
then knows both sides' intent and decides alike, before any payload moves: two senders, two
receivers, a forward message meeting a backward receive, a receiver declaring another shape or
dtype than the sender's tensor, or a sender's bad tensor are one error, the same text on both
ends, and no payload follows. A call addressed past the pipeline's end (no ``loop``) has no peer
there: it says its hello, with status ``PAST_END``, to the stage on its other side, the only one
that can be facing it (e.g. waiting for it in a transfer the program meant the other way round).

Codes are part of the protocol: append to ``_DTYPES``, never reorder.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm.checks import _op_name, _op_words
from ..errors import ShardkitError

__all__ = [
    "HEADER_LEN",
    "HELLO_LEN",
    "MAX_DIMS",
    "OK",
    "BAD_DECLARATION",
    "UNENCODABLE",
    "BAD_ARGUMENTS",
    "MISUSE",
    "PAST_END",
    "Meta",
    "Hello",
    "encode",
    "decode",
    "encode_hello",
    "decode_hello",
    "unencodable",
    "describe",
]

MAGIC = 0x534B5032  # "SKP2": catches a receiver reading a payload as a header (mode mismatch)
MAX_DIMS = 16
HEADER_LEN = 4 + MAX_DIMS

OK = 0
BAD_DECLARATION = 1  # sender: its tensor does not match its own declared static shape / dtype
UNENCODABLE = 2  # sender: ndim > MAX_DIMS or a dtype without a wire code
BAD_ARGUMENTS = 3  # hello only (checks on): this end's call raised an argument error; nothing follows
MISUSE = 4  # local only (never sent): the hellos showed a misuse or a mismatch, no payload follows
PAST_END = 5  # hello only (checks on): this end's call, in the hello's role and phase, addresses a stage past
#               the pipeline's end (no loop); said to the stage on its other side; nothing follows

SEND, RECV = 0, 1
PHASES = ("forward", "backward")
_API_WORDS = 5
HELLO_LEN = HEADER_LEN + 3 + _API_WORDS

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
_DTYPES += [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]


@dataclass(frozen=True)
class Meta:
    """A decoded header (or the header part of a hello). ``dtype``/``shape`` are None when not stated."""

    status: int
    dtype: torch.dtype | None
    shape: tuple[int, ...] | None


def unencodable(dtype: torch.dtype, shape) -> str | None:
    """Why a tensor of this dtype and shape cannot be described by a header, or None."""
    if dtype not in _DTYPES:
        return f"dtype {dtype} has no wire code"
    if len(shape) > MAX_DIMS:
        return f"ndim {len(shape)} exceeds the header's {MAX_DIMS} dims"
    return None


def encode(status: int, dtype: torch.dtype | None, shape, device: torch.device) -> torch.Tensor:
    """Header tensor. A dtype or shape that cannot be encoded is sent as unknown."""
    code = _DTYPES.index(dtype) + 1 if dtype in _DTYPES else 0
    dims = list(shape) if shape is not None and len(shape) <= MAX_DIMS else None
    row = [MAGIC, status, code, -1 if dims is None else len(dims)]
    row += ((dims or []) + [0] * MAX_DIMS)[:MAX_DIMS]
    return torch.tensor(row, dtype=torch.int64, device=device)


def decode(buf: torch.Tensor, op: str, source: str) -> Meta:
    """Parse a received header.

    Raises:
        ShardkitError: the message is not a shardkit header: the two ends disagree on the
            protocol (one declared static shapes with checks off, the other did not).
    """
    row = buf.tolist()
    if row[0] != MAGIC or not 0 <= row[2] <= len(_DTYPES) or not -1 <= row[3] <= MAX_DIMS:
        raise ShardkitError(
            f"{op}: expected a shardkit P2P header from {source} but got other data; both ends of a transfer "
            "must agree on static (shape=..., dtype=...) vs dynamic shapes when checks are off"
        )
    dtype = _DTYPES[row[2] - 1] if row[2] > 0 else None
    shape = None if row[3] < 0 else tuple(row[4 : 4 + row[3]])
    return Meta(row[1], dtype, shape)


def describe(shape, dtype) -> str:
    """``[2, 3] torch.float32``-style text for messages; ``*`` for what is not stated."""
    s = "[*]" if shape is None else str(list(shape))
    return f"{s} {'*' if dtype is None else dtype}"


@dataclass(frozen=True)
class Hello:
    """A decoded hello: the header part, and who wrote it with which intent."""

    meta: Meta
    send: bool
    phase: str
    rank: int
    api: str


def encode_hello(send: bool, phase: str, rank: int, api: str, status: int, dtype, shape, device) -> torch.Tensor:
    """The hello of one end of a transfer (checks on); see the module docstring."""
    tail = torch.tensor(
        [SEND if send else RECV, PHASES.index(phase), rank, *_op_words(api)][: 3 + _API_WORDS],
        dtype=torch.int64,
        device=device,
    )
    return torch.cat([encode(status, dtype, shape, device), tail])


def decode_hello(buf: torch.Tensor, api: str, source: str) -> Hello:
    """Parse a received hello.

    Raises:
        ShardkitError: not a hello (the other end runs with checks off, or sent data).
    """
    row = buf.tolist()
    if row[0] != MAGIC or row[HEADER_LEN] not in (SEND, RECV) or row[HEADER_LEN + 1] not in (0, 1):
        raise ShardkitError(
            f"{api}: expected a shardkit P2P hello from {source} but got other data; both ends of a "
            "transfer must run with the same check mode"
        )
    return Hello(
        decode(buf[:HEADER_LEN], api, source),
        row[HEADER_LEN] == SEND,
        PHASES[row[HEADER_LEN + 1]],
        row[HEADER_LEN + 2],
        _op_name(row[HEADER_LEN + 3 :]),
    )
