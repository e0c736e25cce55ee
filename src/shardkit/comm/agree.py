"""One cross-rank agreement: every rank raises the same error, or every rank proceeds.

A check that can fail on one rank only (that rank's arguments, its part of a checkpoint) must
not raise there alone: its peers would wait in their next collective forever. Each rank
instead computes a local verdict (``None`` or a message) and, if the site needs it, a payload
(what the ranks must agree on, or what each rank knows that all need); :func:`agree` exchanges
them, and every rank raises one :class:`~shardkit.ShardkitError` (same text, same class)
naming which rank(s) failed and why, or every rank returns every rank's payload.

Nothing is unpickled: verdicts and payloads travel as JSON text in ``uint8`` tensors and are
read back with :func:`json.loads`, which builds only strings, numbers, lists and dicts, so a
peer's bytes can never run code here (``all_gather_object`` would unpickle them).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ShardkitError
from . import ledger
from ._compat import all_gather_single
from ._group import GroupInfo, group_device

__all__ = ["agree", "by_ranks", "gather_padded"]

_HEADLINE = "{n} of {size} ranks rejected their arguments"


def agree(
    g: GroupInfo,
    op: str,
    error: str | None = None,
    payload: Any = None,
    *,
    judge: Callable[[list[Any]], list[str]] | None = None,
    headline: str = _HEADLINE,
    gather: bool = False,
    error_type: type[Exception] = ShardkitError,
    device: torch.device | None = None,
) -> list[Any]:
    """Collective over ``g``: raise the same error on every rank if any rank has one, else
    return every rank's payload.

    Args:
        g: the group (every rank of it calls this at the same program point).
        op: the public function agreeing, first word of the message and the ledger's ``api``.
        error: this rank's verdict: None (fine) or what is wrong, said as ``rank r: error``.
        payload: anything JSON can carry (str, int, float, bool, None, lists, str-keyed dicts;
            tuples come back as lists) that the ranks exchange: what they must agree on (then
            ``judge`` compares it) or what each holds that all need (then ``gather=True``).
        judge: ``judge(payloads) -> problems``, a pure function of every rank's payload in rank
            order (so every rank finds the same problems), e.g. ranks that passed different
            arguments; each problem is appended to the ranks' errors.
        headline: the message after ``op: ``, formatted with ``n`` (the number of problems) and
            ``size`` (the group size), followed by ``: `` and the problems joined by ``; ``
            (an empty headline: ``op: `` and the problems).
        gather: always exchange the payloads (they differ by design). Without it the payloads
            are exchanged only when some rank has an error or the payloads differ; otherwise
            every rank's payload is this rank's.
        error_type: the class raised (a ShardkitError subclass for users; the bench's
            correctness checks raise AssertionError).
        device: where the exchanged tensors live; default the group's device (the CPU on
            gloo, the current accelerator on NCCL, whose collectives take device tensors only).

    Returns:
        Every rank's payload (as JSON reads it back), in group-rank order.

    Raises:
        error_type: on every rank of ``g``, with the same text, when any rank has an ``error``
            or ``judge`` finds a problem.

    Cost: none on a size-1 group. Else one ``all_reduce`` (MAX) of 4 int64 (error flag, a
    64-bit digest of the payload and its negation, the encoded length), recorded in the ledger
    as ``all_reduce`` in phase ``"check"``; when it shows an error, differing payloads or
    ``gather``, one ``all_gather`` of the encoded verdicts padded to the longest (ledger op
    ``metadata_all_gather``, phase ``"check"``). Works on gloo and NCCL alike (no object
    collective, no host-side store traffic).
    """
    mine = json.dumps([error, payload], separators=(",", ":"))
    if g.size == 1:
        seen = [json.loads(mine)]
    else:
        seen = _exchange(g, op, error is not None, payload, mine.encode(), gather, device)
    problems = [f"rank {r}: {e}" for r, (e, _) in enumerate(seen) if e is not None]
    payloads = [p for _, p in seen]
    if judge is not None:
        problems += judge(payloads)
    if problems:
        head = f"{headline.format(n=len(problems), size=g.size)}: " if headline else ""
        raise error_type(f"{op}: {head}" + "; ".join(problems))
    return payloads


def by_ranks(problems: list[list[str]]) -> list[str]:
    """Every rank's problems (rank order) as lines, each problem said once with the ranks that
    had it: ``rank 1: p`` or ``ranks 0, 2: p`` (a judge for payloads that are problem lists)."""
    found: dict[str, list[int]] = {}
    for r, ps in enumerate(problems):
        for p in ps:
            found.setdefault(p, []).append(r)
    return [f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {p}" for p, rs in found.items()]


def _digest(payload: Any) -> int:
    """62 bits of BLAKE2b over the payload's JSON: non-negative, so its negation fits int64 too."""
    text = json.dumps(payload, separators=(",", ":")).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 2


def _exchange(g: GroupInfo, op: str, failed: bool, payload: Any, data: bytes, gather: bool, device) -> list:
    """Every rank's ``[error, payload]``: one MAX all-reduce; the all-gather only when needed."""
    device = group_device(g) if device is None else device
    digest = _digest(payload)
    flags = torch.tensor([int(failed), digest, -digest, len(data)], dtype=torch.int64, device=device)
    ledger.record("all_reduce", op, "check", g.size, flags.nbytes, flags.nbytes, pg=g.pg, shape=(4,))
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=g.pg)
    any_failed, high, minus_low, width = flags.tolist()
    if not (gather or any_failed or high != -minus_low):
        # no error and every payload's digest equal: all are this one (a copy each, none shared)
        return [json.loads(data) for _ in range(g.size)]
    # JSON escapes every control character, so the zero padding never occurs inside a text.
    return [json.loads(row.rstrip(b"\0")) for row in gather_padded(g, op, data, width, device)]


def gather_padded(g: GroupInfo, op: str, data: bytes, width: int, device) -> list[bytes]:
    """Every rank's ``data`` zero-padded to ``width`` bytes (every rank passes the same ``width``,
    at least its own length), in rank order: one ``uint8`` all-gather, recorded in the ledger as
    ``metadata_all_gather`` in phase ``"check"``."""
    buf = torch.zeros(width, dtype=torch.uint8, device=device)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data[:width]), dtype=torch.uint8)
    table = buf.new_empty(g.size * width)
    ledger.record("metadata_all_gather", op, "check", g.size, width, table.nbytes, pg=g.pg, shape=(width,))
    all_gather_single(table, buf, group=g.pg)
    return [bytes(row) for row in table.view(g.size, width).cpu().tolist()]
