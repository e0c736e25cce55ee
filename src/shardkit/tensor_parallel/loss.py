"""Cross entropy over vocab-sharded logits, without ever gathering the full vocabulary.

Rank ``r`` of the tensor-parallel group holds the contiguous vocabulary block
``[offset_r, offset_r + V_r)`` of the logits (the output of a vocab-parallel LM head). The loss
needs only three numbers per token from the whole vocabulary: the maximum (for a stable
log-sum-exp), the sum of ``exp(z - max)``, and the target logit (plus the sum of all logits for
label smoothing). Those are combined with two all-reduces of ``O(tokens)`` elements, so memory and
traffic stay ``O(tokens x V / R)`` instead of the ``O(tokens x V)`` of gathering the logits.

Collectives, forward only (the backward is local): one all-reduce MAX of a float64
``[N + 2R + 8]`` buffer (row maxima, each rank's vocabulary width, each rank's verdict on its
labels' type and shape, and +-(labels fingerprint, compute dtype, ``ignore_index``,
``label_smoothing``): max and -min, equal iff every rank passed the same) and one all-reduce SUM of a
``[N, 2 or 3] + 1`` buffer (sum of exponentials, target logit, sum of logits when smoothing,
out-of-range-label flag). Carrying the widths in the MAX all-reduce means
the vocabulary layout never has to be passed in: any contiguous rank-ordered split works
(``torch.chunk``'s, with empty trailing shards, or the balanced one), at no extra collective.
Carrying the labels' verdicts there too makes labels of the wrong shape on one rank one error on
every rank, in the default mode as in the check mode: a rank that raised alone would leave its
peers in the all-reduce, and its next collective would meet theirs with another size (gloo
aborts the process). The same holds for the arguments that size or type the SUM buffer (the compute
dtype, smoothing on or off) or decide which tokens count (``ignore_index``): agreed in the MAX
all-reduce, a rank passing another one is one error on every rank, not an abort or a wrong loss.

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
from ..errors import ShardkitError, ShardkitTypeError
from ._loss_checks import LABELS_OK, check_labels, check_layout, check_shared, dtype_code, fingerprint, labels_verdict

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._types import Group

__all__ = ["vocab_parallel_cross_entropy"]

_OP = "vocab_parallel_cross_entropy"
_REDUCTIONS = ("mean", "sum", "none")


def _all_reduce_(buf: torch.Tensor, g, op) -> None:
    """In-place all-reduce of an already-packed buffer (nothing to do on a size-1 group)."""
    if g.size > 1:
        dist.all_reduce(buf, op=op, group=g.pg)
        ledger.record("all_reduce", _OP, "forward", g.size, buf.nbytes, buf.nbytes, pg=g.pg, dtype=buf.dtype)


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
        #    elsewhere), then +-(values every rank must share): max and -min.
        R = g.size
        args = torch.tensor([dtype_code(cdt), ignore_index, smoothing], dtype=torch.float64, device=z.device)
        shared = torch.cat([fingerprint(t).to(torch.float64).reshape(1), args])
        mx = torch.zeros(n + 2 * R + 2 * len(shared), dtype=torch.float64, device=z.device)
        mx[:n] = z.amax(-1) if v_r else float("-inf")
        mx[n + g.rank], mx[n + R + g.rank] = v_r, verdict
        mx[n + 2 * R :] = torch.cat([shared, -shared])
        _all_reduce_(mx, g, dist.ReduceOp.MAX)
        tail = mx[n:].tolist()  # the one host sync of the layout
        check_labels([int(v) for v in tail[R : 2 * R]], logits_local.shape, g)
        widths, top, low = [int(v) for v in tail[:R]], tail[2 * R : 2 * R + 4], [-v for v in tail[2 * R + 4 :]]
        check_layout(widths, vocab_sizes, g)
        check_shared(top, low, g)
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
            ranks only, or ranks pass logits of another compute dtype or another
            ``ignore_index`` or ``label_smoothing`` (raised on every rank after the first
            all-reduce, in either mode);
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
    verdict = labels_verdict(labels, logits_local)
    if verdict != LABELS_OK:
        # A rank whose labels are wrong still takes part in the first all-reduce (sized by the
        # logits, which the peers share), with a stand-in and its verdict: every rank raises there.
        labels = torch.zeros(logits_local.shape[:-1], dtype=torch.int64, device=logits_local.device)
    return _VocabParallelCrossEntropy.apply(
        logits_local, labels, g, ignore_index, float(label_smoothing), reduction, vocab_sizes, verdict
    )
