"""Cross entropy over vocab-sharded logits, without ever gathering the full vocabulary.

Rank ``r`` of the tensor-parallel group holds the contiguous vocabulary block
``[offset_r, offset_r + V_r)`` of the logits (the output of a vocab-parallel LM head). The loss
needs only three numbers per token from the whole vocabulary: the maximum (for a stable
log-sum-exp), the sum of ``exp(z - max)``, and the target logit (plus the sum of all logits for
label smoothing). Those are combined with two all-reduces of ``O(tokens)`` elements, so memory and
traffic stay ``O(tokens x V / R)`` instead of the ``O(tokens x V)`` of gathering the logits.

Collectives, forward only (the backward is local): one all-reduce MAX of a float64
``[N + 2R + 2]`` buffer (row maxima, each rank's vocabulary width, each rank's verdict on its
labels' type and shape, a fingerprint of the labels) and one all-reduce SUM of a
``[N, 2 or 3] + 1`` buffer (sum of exponentials, target logit, sum of logits when smoothing,
out-of-range-label flag). Carrying the widths in the MAX all-reduce means
the vocabulary layout never has to be passed in: any contiguous rank-ordered split works
(``torch.chunk``'s, with empty trailing shards, or the balanced one), at no extra collective.
Carrying the labels' verdicts there too makes labels of the wrong shape on one rank one error on
every rank, in the default mode as in the check mode: a rank that raised alone would leave its
peers in the all-reduce, and its next collective would meet theirs with another size (gloo
aborts the process).

Source: Megatron-LM ``vocab_parallel_cross_entropy`` (Shoeybi et al., 2019, "Megatron-LM"),
with label smoothing over the *global* vocabulary as ``torch.nn.functional.cross_entropy`` does
it (Megatron-LM issue #737 divided by the local vocabulary size).
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .._shapes import check_split_sizes, split_offsets
from ..comm import ledger
from ..comm._validate import enter, expected_size, maybe_agree
from ..errors import RankMismatchError, ShardkitError, ShardkitTypeError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._types import Group

__all__ = ["vocab_parallel_cross_entropy"]

_OP = "vocab_parallel_cross_entropy"
_REDUCTIONS = ("mean", "sum", "none")
_PRIME = 2**31 - 1  # labels fingerprint modulus: exact in float64, no int64 overflow below 2**32 tokens
_LABELS_OK, _LABELS_SHAPE, _LABELS_TYPE = 0, 1, 2  # a rank's verdict on its labels, MAX-reduced per rank


def _all_reduce_(buf: torch.Tensor, g, op) -> None:
    """In-place all-reduce of an already-packed buffer (nothing to do on a size-1 group)."""
    if g.size > 1:
        dist.all_reduce(buf, op=op, group=g.pg)
        ledger.record("all_reduce", _OP, "forward", g.size, buf.nbytes, buf.nbytes, pg=g.pg, dtype=buf.dtype)


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Position-weighted sum of the labels modulo a prime: equal on every rank iff (up to a
    collision) the labels are, which the loss assumes but cannot see locally."""
    pos = torch.arange(1, t.numel() + 1, device=t.device)
    return ((t % _PRIME) * pos % _PRIME).sum() % _PRIME


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # Half-precision exponentials and sums lose the loss; float32 is Megatron's choice too.
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_local, labels, g, ignore_index, smoothing, reduction, vocab_sizes, verdict):
        v_r, n = logits_local.shape[-1], labels.numel()
        cdt = _compute_dtype(logits_local.dtype)
        z = logits_local.reshape(n, v_r)  # explicit n: reshape(-1, 0) is ambiguous for empty shards
        t = labels.reshape(n).to(device=z.device, dtype=torch.int64)

        # 1) MAX: row maxima (detached by construction: the backward below is explicit), this
        #    rank's width in slot rank and its labels' verdict in slot R + rank of the tail (0
        #    elsewhere), and +-fingerprint (max and -min).
        R = g.size
        mx = torch.zeros(n + 2 * R + 2, dtype=torch.float64, device=z.device)
        mx[:n] = z.amax(-1) if v_r else float("-inf")
        mx[n + g.rank], mx[n + R + g.rank] = v_r, verdict
        fp = _fingerprint(t)
        mx[n + 2 * R], mx[n + 2 * R + 1] = fp, -fp
        _all_reduce_(mx, g, dist.ReduceOp.MAX)
        tail = [int(v) for v in mx[n:].tolist()]  # the one host sync of the layout
        _check_labels(tail[R : 2 * R], logits_local.shape, g)
        widths, fp_max, fp_min = tail[:R], tail[2 * R], -tail[2 * R + 1]
        _check_layout(widths, vocab_sizes, fp_max, fp_min, g)
        vocab, offset = sum(widths), split_offsets(widths)[g.rank]

        # 2) SUM: per token [sum exp(z - m), z_target - m (owner only), sum (z - m) if smoothing]
        #    and, last, whether any label is out of range (decided on every rank alike).
        valid = t != ignore_index
        bad = valid & ((t < 0) | (t >= vocab))
        owned = valid & (t >= offset) & (t < offset + v_r)
        idx = torch.where(owned, t - offset, 0)
        k = 3 if smoothing > 0 else 2
        sm = torch.zeros(n * k + 1, dtype=cdt, device=z.device)
        cols = sm[: n * k].view(n, k)
        e = z.to(cdt) - mx[:n].to(cdt)[:, None]  # the global max is one of the inputs: exact in cdt
        if v_r:
            cols[:, 1] = torch.where(owned, e.gather(1, idx[:, None]).squeeze(1), 0)
            if k == 3:
                cols[:, 2] = e.sum(-1)
            cols[:, 0] = e.exp_().sum(-1)
        sm[-1] = bad.any()
        _all_reduce_(sm, g, dist.ReduceOp.SUM)
        if sm[-1].item() > 0:
            raise ShardkitError(
                f"{_OP}: labels must be in [0, {vocab}) or ignore_index={ignore_index} (group of {g.size}); "
                f"got {t[bad][:8].tolist()} at flat positions {bad.nonzero().flatten()[:8].tolist()}"
            )

        # Per token: lse - (1 - eps) z_t - eps/V sum_j z_j, written relative to the max m.
        s = cols[:, 0]
        per = s.log() - (1 - smoothing) * cols[:, 1]
        if k == 3:
            per = per - (smoothing / vocab) * cols[:, 2]
        per = torch.where(valid, per, 0)
        count = int(valid.sum())
        ctx.save_for_backward(e, s, idx, owned, valid)
        ctx.meta = (logits_local.shape, logits_local.dtype, smoothing, vocab, reduction, count)
        if reduction == "none":
            return per.view(labels.shape)
        total = per.sum()
        return total / count if reduction == "mean" else total  # mean over nothing: nan, as torch

    @staticmethod
    def backward(ctx, grad):
        if not ctx.needs_input_grad[0]:
            return (None,) * 8
        e, s, idx, owned, valid = ctx.saved_tensors
        shape, dtype, smoothing, vocab, reduction, count = ctx.meta
        n, v_r = e.shape
        if reduction == "none":
            coef = grad.reshape(n).to(e.dtype)
        else:
            coef = (grad.to(e.dtype) / (max(count, 1) if reduction == "mean" else 1)).expand(n)
        coef = torch.where(valid, coef, 0)  # ignored tokens get exactly zero, as in torch
        # d loss / d z_j = softmax_j - (1 - eps) [j == t] - eps / V, softmax_j = e_j / s.
        gz = e * (coef / s)[:, None]
        if smoothing > 0:
            gz.sub_((smoothing / vocab) * coef[:, None])
        if v_r:
            gz.scatter_add_(1, idx[:, None], torch.where(owned, -(1 - smoothing) * coef, 0)[:, None])
        return gz.to(dtype).view(shape), None, None, None, None, None, None, None


def _labels_verdict(labels, logits_local: torch.Tensor) -> int:
    """This rank's verdict on its own labels (a local fact its peers cannot see)."""
    if (
        not isinstance(labels, torch.Tensor)
        or labels.is_floating_point()
        or labels.is_complex()
        or labels.dtype == torch.bool
    ):
        return _LABELS_TYPE
    return _LABELS_OK if tuple(labels.shape) == tuple(logits_local.shape[:-1]) else _LABELS_SHAPE


def _check_labels(verdicts, logits_shape, g) -> None:
    """Checks on the all-reduced labels' verdicts: every rank sees the same values and raises alike."""
    # The logits' leading dims only: their vocabulary dim is each rank's own, the text must not be.
    for code, rule, noun in (
        (_LABELS_TYPE, "be an integer tensor", "type"),
        (_LABELS_SHAPE, f"have the logits' leading dims {tuple(logits_shape[:-1])}", "shape"),
    ):
        bad = [r for r in range(g.size) if verdicts[r] == code]
        if not bad:
            continue
        text = f"{_OP}: labels must {rule} on every rank of the group of {g.size}; ranks {bad} pass another {noun}"
        if code == _LABELS_TYPE:
            raise ShardkitTypeError(text)
        raise (ShardkitError if len(bad) == g.size else RankMismatchError)(text)


def _check_layout(widths, vocab_sizes, fp_max, fp_min, g) -> None:
    """Checks on the all-reduced layout: every rank sees the same values and raises alike."""
    if vocab_sizes is not None and list(vocab_sizes) != widths:
        bad = [r for r in range(g.size) if widths[r] != vocab_sizes[r]]
        raise ShardkitError(
            f"{_OP}: vocab_sizes={list(vocab_sizes)} but the ranks of the group of {g.size} hold logits of "
            f"widths {widths} (offending ranks {bad})"
        )
    if sum(widths) == 0:
        raise ShardkitError(f"{_OP}: the vocabulary is empty on all {g.size} ranks")
    if fp_max != fp_min:
        raise RankMismatchError(
            f"{_OP}: labels differ across the {g.size} ranks of the group; they must be replicated "
            "(every tensor-parallel rank needs the same targets)"
        )


def vocab_parallel_cross_entropy(
    logits_local: torch.Tensor,
    labels: torch.Tensor,
    group: Group,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    vocab_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Cross entropy of vocab-sharded logits; two small all-reduces in forward, none in backward.

    Equal to ``F.cross_entropy(logits_full.flatten(0, -2), labels.flatten(), ...)`` (same
    ``ignore_index``, ``label_smoothing`` over the global vocabulary ``V`` and reduction), where
    ``logits_full`` is the concatenation of every rank's ``logits_local`` along the last dim,
    which is never built. The gradient w.r.t. ``logits_local`` is this rank's block of the full
    gradient: ``softmax - (1 - eps) onehot - eps / V`` scaled by the incoming gradient.

    Args:
        logits_local: ``[..., V_r]`` (e.g. ``[B, S, V_r]``), this rank's contiguous block of the
            vocabulary; blocks are in rank order, ``V_r = 0`` allowed. Floating point;
            float16/bfloat16 are computed in float32.
        labels: ``[...]`` integer global vocabulary ids, the leading shape of ``logits_local``,
            identical on every rank (checked).
        group: a ``ProcessGroup`` or 1-D ``DeviceMesh`` of ``R`` ranks (the vocab-parallel group).
        ignore_index: label whose tokens contribute nothing and leave the mean's denominator.
        label_smoothing: ``eps`` in ``[0, 1]``; the target distribution is
            ``(1 - eps) onehot + eps / V``.
        reduction: ``"mean"`` (over non-ignored tokens; nan if there are none, as torch),
            ``"sum"`` or ``"none"`` (``[...]`` per-token losses, 0 for ignored tokens).
        vocab_sizes: optional ``V_r`` of every rank (R ints), checked against the widths the
            ranks actually hold. Not needed: the widths travel in the first all-reduce.

    Returns:
        The loss, identical on every rank, in float32 for half-precision logits and in the
        logits' dtype otherwise: a scalar, or ``[...]`` for ``reduction="none"``.

    Raises:
        ShardkitTypeError: ``logits_local`` not a floating tensor, ``labels`` not an integer
            tensor on some rank, ``label_smoothing`` not a real number, bad ``group`` or
            ``vocab_sizes`` type.
        ShardkitError: unknown ``reduction``; ``label_smoothing`` outside [0, 1]; ``labels``
            shape not the logits' leading shape on every rank; ``vocab_sizes`` of the wrong
            length or not the widths the ranks hold; an empty vocabulary; a label outside
            ``[0, V)`` that is not ``ignore_index``. Raised on every rank alike (the labels' type
            and shape, the last three after the collectives that make them known everywhere).
        RankMismatchError: the labels differ across ranks, or have the wrong shape on some
            ranks only (raised on every rank after the first all-reduce, in either mode);
            (check mode) ranks disagree on the logits' dtype, leading shape or arguments.
    """
    if reduction not in _REDUCTIONS:
        raise ShardkitError(f"{_OP}: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, numbers.Real):
        raise ShardkitTypeError(f"{_OP}: label_smoothing must be a real number, got {label_smoothing!r}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ShardkitError(f"{_OP}: label_smoothing must be in [0, 1], got {label_smoothing}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ShardkitTypeError(f"{_OP}: ignore_index must be an int, got {ignore_index!r}")
    g = enter(logits_local, group, _OP)
    v_r = logits_local.shape[-1] if logits_local.dim() else 0
    expected = expected_size(vocab_sizes, g.rank)
    maybe_agree(
        g,
        _OP,
        logits_local,
        (_REDUCTIONS.index(reduction), ignore_index, round(label_smoothing * 2**30), vocab_sizes),
        local_dim=-1,
        expected_local=v_r if expected is None else expected,
    )
    if not logits_local.is_floating_point():
        raise ShardkitTypeError(f"{_OP}: logits_local must be floating point, got {logits_local.dtype}")
    if logits_local.dim() < 1:
        raise ShardkitError(f"{_OP}: logits_local must have a vocabulary dim, got a 0-d tensor")
    if vocab_sizes is not None:
        vocab_sizes = tuple(check_split_sizes(vocab_sizes, g.size, None, _OP))
    verdict = _labels_verdict(labels, logits_local)
    if verdict != _LABELS_OK:
        # A rank whose labels are wrong still takes part in the first all-reduce (sized by the
        # logits, which the peers share), with a stand-in and its verdict: every rank raises there.
        labels = torch.zeros(logits_local.shape[:-1], dtype=torch.int64, device=logits_local.device)
    return _VocabParallelCrossEntropy.apply(
        logits_local, labels, g, ignore_index, float(label_smoothing), reduction, vocab_sizes, verdict
    )
