"""The agreements of :func:`~.loss.vocab_parallel_cross_entropy`: what every rank must share, carried
in the loss's first all-reduce (MAX), and the checks every rank runs alike on its result.

A rank whose labels or arguments differ from its peers' cannot see it locally; raising alone
would leave the peers in the next collective with another size or dtype (gloo aborts the
process). So each rank puts its own verdict on its labels in its own slot, and the values that
must be equal (the labels' fingerprint, the compute dtype, ``ignore_index``, ``label_smoothing``)
as ``+x`` and ``-x``: after a MAX, ``max == -max(-x)`` iff every rank passed the same ``x``.
"""

from __future__ import annotations

import math

import torch

from ..errors import RankMismatchError, ShardkitError, ShardkitTypeError

__all__ = [
    "LABELS_OK",
    "check_labels",
    "check_layout",
    "check_shared",
    "dtype_code",
    "fingerprint",
    "labels_verdict",
]

_OP = "vocab_parallel_cross_entropy"
_PRIME = 2**31 - 1  # labels fingerprint modulus: exact in float64, no int64 overflow below 2**32 tokens
LABELS_OK, LABELS_SHAPE, LABELS_TYPE = 0, 1, 2  # a rank's verdict on its labels, MAX-reduced per rank
_SHARED = ("labels", "the logits' compute dtype (float32 for 16-bit logits)", "ignore_index", "label_smoothing")


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Position-weighted sum of the labels modulo a prime: equal on every rank iff (up to a
    collision) the labels are, which the loss assumes but cannot see locally."""
    pos = torch.arange(1, t.numel() + 1, device=t.device)
    return ((t % _PRIME) * pos % _PRIME).sum() % _PRIME


def labels_verdict(labels, logits_local: torch.Tensor) -> int:
    """This rank's verdict on its own labels (a local fact its peers cannot see)."""
    if (
        not isinstance(labels, torch.Tensor)
        or labels.is_floating_point()
        or labels.is_complex()
        or labels.dtype == torch.bool
    ):
        return LABELS_TYPE
    return LABELS_OK if tuple(labels.shape) == tuple(logits_local.shape[:-1]) else LABELS_SHAPE


def check_labels(verdicts, logits_shape, g) -> None:
    """Checks on the all-reduced labels' verdicts: every rank sees the same values and raises alike."""
    # The logits' leading dims only: their vocabulary dim is each rank's own, the text must not be.
    for code, rule, noun in (
        (LABELS_TYPE, "be an integer tensor", "type"),
        (LABELS_SHAPE, f"have the logits' leading dims {tuple(logits_shape[:-1])}", "shape"),
    ):
        bad = [r for r in range(g.size) if verdicts[r] == code]
        if not bad:
            continue
        text = f"{_OP}: labels must {rule} on every rank of the group of {g.size}; ranks {bad} pass another {noun}"
        if code == LABELS_TYPE:
            raise ShardkitTypeError(text)
        raise (ShardkitError if len(bad) == g.size else RankMismatchError)(text)


def dtype_code(dtype: torch.dtype) -> int:
    """A number naming a floating dtype (bits x 100 + mantissa bits): equal on two ranks iff their
    SUM buffers have the same size and element type."""
    info = torch.finfo(dtype)
    return info.bits * 100 + round(-math.log2(info.eps))


def _dtype_name(code: float) -> str:
    known = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
    return next((str(d) for d in known if dtype_code(d) == code), f"dtype code {int(code)}")


def check_shared(top: list[float], low: list[float], g) -> None:
    """Max and min over the ranks of each value of ``_SHARED``: every rank sees the same values
    and raises alike.

    Raises:
        RankMismatchError: the ranks passed different labels, logits whose compute dtypes
            differ, or another ``ignore_index`` or ``label_smoothing``.
    """
    differ = [i for i in range(len(_SHARED)) if top[i] != low[i]]
    if not differ:
        return
    i = differ[0]
    if i == 0:
        raise RankMismatchError(
            f"{_OP}: labels differ across the {g.size} ranks of the group; they must be replicated "
            "(every tensor-parallel rank needs the same targets)"
        )
    seen = [_dtype_name(v) if i == 1 else f"{v:g}" for v in (low[i], top[i])]
    raise RankMismatchError(
        f"{_OP}: {_SHARED[i]} must be the same on the {g.size} ranks of the group; they pass {seen[0]} and {seen[1]}"
    )


def check_layout(widths, vocab_sizes, g) -> None:
    """Checks on the all-reduced layout: every rank sees the same values and raises alike."""
    if vocab_sizes is not None and list(vocab_sizes) != widths:
        bad = [r for r in range(g.size) if widths[r] != vocab_sizes[r]]
        raise ShardkitError(
            f"{_OP}: vocab_sizes={list(vocab_sizes)} but the ranks of the group of {g.size} hold logits of "
            f"widths {widths} (offending ranks {bad})"
        )
    if sum(widths) == 0:
        raise ShardkitError(f"{_OP}: the vocabulary is empty on all {g.size} ranks")
