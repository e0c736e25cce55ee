"""vocab_parallel_cross_entropy against F.cross_entropy on the full (never gathered) logits.

Parity (docs/design.md, Testing): loss and the gradient of this rank's logit block against the
matching slice of the full-logits gradient, float64 rtol 1e-9, float32 1e-5; even, uneven and
torch.chunk layouts with empty shards; every reduction, ignore_index, label smoothing over the
global vocabulary; exact ledger counts; errors raised on every rank; a vocab-parallel head.
"""

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness.helpers import rank, world_group, world_size
from harness.limits import patient
from shardkit import CommLedger, RankMismatchError, ShardkitError, ShardkitTypeError, all_reduce_backward
from shardkit._shapes import split_offsets
from shardkit.comm import checks
from shardkit.tensor_parallel.loss import vocab_parallel_cross_entropy

OP = "vocab_parallel_cross_entropy"


def _chunk_sizes(vocab, R):
    """torch.chunk's layout: ceil(V / R) per rank, trailing ranks short or empty."""
    sizes = [c.numel() for c in torch.arange(vocab).chunk(R)]
    return sizes + [0] * (R - len(sizes))


LAYOUTS = {  # name -> (V, sizes(R), pass vocab_sizes explicitly)
    "even": lambda R: (3 * R, [3] * R, False),
    "chunk_uneven": lambda R: (3 * R + 2, _chunk_sizes(3 * R + 2, R), False),
    "chunk_v5": lambda R: (5, _chunk_sizes(5, R), False),  # R=4: 2,2,1,0
    "chunk_v3": lambda R: (3, _chunk_sizes(3, R), False),  # R=4: 1,1,1,0
    "explicit_ragged": lambda R: (sum((2 * r + 3) % 5 for r in range(R)), [(2 * r + 3) % 5 for r in range(R)], True),
}
IGNORES = {"none": (-100, False), "default": (-100, True), "in_vocab": (1, True)}


def _problem(lead, vocab, dtype=torch.float64, ignore_index=-100, with_ignored=True, seed=0):
    """Replicated full logits and labels (fixed generator: identical on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    full = (torch.randn(*lead, vocab, generator=gen, dtype=torch.float64) * 3).to(dtype)
    labels = torch.randint(0, vocab, lead, generator=gen)
    if with_ignored:
        labels.view(-1)[::3] = ignore_index
    return full, labels


def _block(full, sizes):
    return full.narrow(-1, split_offsets(sizes)[rank()], sizes[rank()])


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item() if b.norm() > 0 else (a - b).norm().item()


def _same_on_all_ranks(t):
    v = t.detach().double().reshape(-1)
    lo, hi = v.clone(), v.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return torch.equal(lo.nan_to_num(1.5), hi.nan_to_num(1.5)) and torch.equal(lo.isnan(), v.isnan())


def _check_parity(layout, reduction, smoothing, ignore, lead=(2, 3, 4), dtype=torch.float64, rtol=1e-9):
    vocab, sizes, explicit = LAYOUTS[layout](world_size())
    ignore_index, with_ignored = IGNORES[ignore]
    full, labels = _problem(lead, vocab, dtype, ignore_index, with_ignored)
    full = full.requires_grad_()
    ref = F.cross_entropy(
        full.reshape(-1, vocab),
        labels.reshape(-1),
        ignore_index=ignore_index,
        label_smoothing=smoothing,
        reduction=reduction,
    )
    if reduction == "none":
        ref = ref.view(lead)
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=ref.dtype)  # replicated
    ref.backward(w)
    local = _block(full.detach(), sizes).clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(
        local,
        labels,
        world_group(),
        ignore_index=ignore_index,
        label_smoothing=smoothing,
        reduction=reduction,
        vocab_sizes=sizes if explicit else None,
    )
    loss.backward(w)
    assert loss.shape == ref.shape and loss.dtype == ref.dtype
    assert _rel(loss.detach(), ref.detach()) <= rtol, (loss, ref)
    assert local.grad.shape == local.shape
    assert _rel(local.grad, _block(full.grad, sizes)) <= rtol
    assert _same_on_all_ranks(loss)


@pytest.mark.world(1)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_parity_r1(reduction, smoothing):
    _check_parity("chunk_uneven", reduction, smoothing, "default")


@pytest.mark.world(2)
@pytest.mark.parametrize("layout", ["even", "chunk_uneven", "explicit_ragged"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_parity_r2(layout, reduction, smoothing):
    _check_parity(layout, reduction, smoothing, "default")


@pytest.mark.world(3)
@pytest.mark.parametrize("layout", ["even", "chunk_uneven", "explicit_ragged"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore", sorted(IGNORES))
def test_parity_r3(layout, reduction, ignore):
    _check_parity(layout, reduction, 0.1, ignore)


@pytest.mark.world(4)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_parity_r4(layout, reduction, smoothing):
    _check_parity(layout, reduction, smoothing, "default")


@pytest.mark.world(4)
@pytest.mark.parametrize("lead", [(), (7,), (2, 3), (2, 2, 3)])
def test_parity_lead_shapes_r4(lead):
    _check_parity("chunk_v5", "none", 0.1, "none", lead=lead)
    _check_parity("chunk_uneven", "mean", 0.1, "none" if lead == () else "default", lead=lead)


@pytest.mark.world(3)
def test_float32_parity_r3():
    _check_parity("chunk_uneven", "mean", 0.1, "default", dtype=torch.float32, rtol=1e-5)
    _check_parity("explicit_ragged", "none", 0.0, "in_vocab", dtype=torch.float32, rtol=1e-5)


@pytest.mark.world(4)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_r4(dtype):
    """Computed in float32: the loss is float32 and within float32 rounding of the float64 loss
    of the same (rounded) logits; the gradient comes back in the logits' dtype."""
    vocab, sizes, _ = LAYOUTS["chunk_uneven"](world_size())
    full, labels = _problem((4, 8), vocab, torch.float64)
    full = full.to(dtype).double().requires_grad_()  # the reference sees the rounded logits
    ref = F.cross_entropy(full.reshape(-1, vocab), labels.reshape(-1), label_smoothing=0.1)
    ref.backward()
    local = _block(full.detach(), sizes).to(dtype).requires_grad_()
    loss = vocab_parallel_cross_entropy(local, labels, world_group(), label_smoothing=0.1)
    loss.backward()
    assert loss.dtype == torch.float32 and local.grad.dtype == dtype
    assert _rel(loss.detach().double(), ref.detach()) <= 1e-5
    assert _rel(local.grad.double(), _block(full.grad, sizes)) <= 1e-2  # half rounding of the gradient
    assert _same_on_all_ranks(loss)


@pytest.mark.world(4)
def test_smoothing_uses_global_vocab_r4():
    """With eps / V_r (Megatron-LM issue #737) the loss would differ by far more than rtol."""
    vocab, sizes, _ = LAYOUTS["chunk_v5"](world_size())  # 2, 2, 1, 0
    full, labels = _problem((6,), vocab, with_ignored=False)
    full = full + 5.0  # the true loss is shift invariant, the local-V one is not
    loss = vocab_parallel_cross_entropy(_block(full, sizes), labels, world_group(), label_smoothing=0.1)
    ref = F.cross_entropy(full, labels, label_smoothing=0.1)
    lse = full.logsumexp(-1)
    z_t = full.gather(1, labels[:, None]).squeeze(1)
    v_local = max(sizes[rank()], 1)
    wrong = (lse - 0.9 * z_t - 0.1 / v_local * full.sum(-1)).mean()
    assert _rel(loss, ref) <= 1e-9
    assert abs(wrong - ref) > 1e-3 * abs(ref)  # the check above has the power to see the bug


@pytest.mark.world(2)
def test_all_ignored_matches_torch_r2():
    vocab, sizes, _ = LAYOUTS["chunk_uneven"](world_size())
    full, _ = _problem((5,), vocab)
    labels = torch.full((5,), -100)
    for reduction in ("mean", "sum", "none"):
        local = _block(full, sizes).clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, labels, world_group(), reduction=reduction, label_smoothing=0.1)
        ref = F.cross_entropy(full, labels, reduction=reduction, label_smoothing=0.1)
        assert torch.equal(loss.isnan(), ref.isnan()) and torch.equal(loss.nan_to_num(), ref.nan_to_num())
        loss.sum().backward()
        assert torch.equal(local.grad, torch.zeros_like(local))


@pytest.mark.world(3)
def test_retain_graph_backward_twice_r3():
    vocab, sizes, _ = LAYOUTS["chunk_uneven"](world_size())
    full, labels = _problem((2, 5), vocab)
    local = _block(full, sizes).clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, labels, world_group(), label_smoothing=0.1)
    loss.backward(retain_graph=True)
    once = local.grad.clone()
    loss.backward()
    assert torch.allclose(local.grad, 2 * once, rtol=1e-12, atol=0)


@pytest.mark.world(1)
def test_ledger_r1():
    _check_ledger()


@pytest.mark.world(3)
def test_ledger_r3():
    _check_ledger()


@pytest.mark.world(4)
def test_ledger_r4():
    _check_ledger()


def _check_ledger():
    R = world_size()
    vocab, sizes, _ = LAYOUTS["chunk_v5"](R)
    full, labels = _problem((2, 3), vocab)
    n = labels.numel()
    for smoothing, k in ((0.0, 2), (0.1, 3)):
        local = _block(full, sizes).clone().float().requires_grad_()
        with checks(False), CommLedger() as fwd:
            loss = vocab_parallel_cross_entropy(local, labels, world_group(), label_smoothing=smoothing)
        with CommLedger() as bwd:
            loss.backward()
        assert bwd.records == []  # no communication in backward
        if R == 1:
            assert fwd.records == []  # size-1 group: no collective at all
            continue
        assert fwd.count() == 2 and fwd.count(op="all_reduce", api=OP, phase="forward", group_size=R) == 2
        max_buf, sum_buf = fwd.records
        # float64 maxima + widths + labels' verdicts + fingerprint
        assert (
            max_buf.bytes_sent == max_buf.bytes_received == 8 * (n + 2 * R + 8)
        )  # + the 4 shared values as max and -min
        assert sum_buf.bytes_sent == sum_buf.bytes_received == 4 * (k * n + 1)  # float32 columns + label flag
    if R > 1:
        with checks(True), CommLedger() as led:
            vocab_parallel_cross_entropy(_block(full, sizes), labels, world_group())
        assert led.count(op="metadata_all_gather", phase="check") == 1 and led.count(op="all_reduce") == 2


def _raises(exc, match, logits, labels, **kw):
    with pytest.raises(exc, match=match):
        vocab_parallel_cross_entropy(logits, labels, world_group(), **kw)


@pytest.mark.world(3)
def test_errors_on_every_rank_r3():
    R = world_size()
    vocab, sizes, _ = LAYOUTS["chunk_uneven"](R)  # 4, 4, 3
    full, labels = _problem((2, 3), vocab)
    local = _block(full, sizes)
    _raises(ShardkitError, "reduction", local, labels, reduction="avg")
    _raises(ShardkitError, r"label_smoothing must be in \[0, 1\]", local, labels, label_smoothing=1.5)
    _raises(ShardkitError, r"label_smoothing must be in \[0, 1\]", local, labels, label_smoothing=-0.1)
    _raises(ShardkitTypeError, "label_smoothing must be a real", local, labels, label_smoothing="0.1")
    _raises(ShardkitError, "leading dims", local, labels[:, :2])
    _raises(ShardkitTypeError, "integer tensor", local, labels.double())
    _raises(ShardkitTypeError, "floating point", local.long(), labels)
    _raises(ShardkitError, "ranks", local, labels, vocab_sizes=sizes[:-1])
    _raises(ShardkitError, "sizes must be >= 0", local, labels, vocab_sizes=[vocab + 1] + [-1] * (R - 1))
    with pytest.raises(ShardkitTypeError, match="group is required"):
        vocab_parallel_cross_entropy(local, labels, None)
    # Mismatches that only some ranks can see locally: agreed through the first all-reduce.
    swapped = list(reversed(sizes))  # [3, 4, 4]: ranks 0 and 2 mismatch, rank 1 does not
    _raises(ShardkitError, r"offending ranks \[0, 2\]", local, labels, vocab_sizes=swapped)
    for bad in (vocab, -1, 10**6):
        wrong = labels.clone()
        wrong[1, 2] = bad  # owned by no rank (out of range): every rank must still raise
        _raises(ShardkitError, rf"labels must be in \[0, {vocab}\).*\[{bad}\]", local, wrong)
    _raises(ShardkitError, "vocabulary is empty", local[..., :0], labels)
    mine = labels.clone()
    mine[0, 0] = rank() % 2  # labels differing across ranks
    _raises(RankMismatchError, "labels differ", local, mine)
    # The group is still in step: a valid call works and matches the reference.
    loss = vocab_parallel_cross_entropy(local, labels, world_group(), vocab_sizes=sizes)
    assert _rel(loss, F.cross_entropy(full.reshape(-1, vocab), labels.reshape(-1))) <= 1e-9


def _one_rank_labels(mode, bad_rank, bad_labels, exc, match):
    """Rank ``bad_rank`` passes ``bad_labels``, the others valid ones: ``exc`` with one text on
    every rank, raised within 2 s, in the default (``mode=False``) and the check mode; the group
    is still in step afterwards (issue 19, row 13: this aborted the process in both modes)."""
    R = world_size()
    vocab, sizes, _ = LAYOUTS["chunk_uneven"](R)  # uneven widths: the text must not name this rank's
    full, labels = _problem((2, 5), vocab)
    local = _block(full, sizes)
    start = time.monotonic()
    with checks(mode), pytest.raises(exc, match=match) as info:
        vocab_parallel_cross_entropy(local, bad_labels if rank() == bad_rank else labels, world_group())
    assert time.monotonic() - start < patient(2.0)  # 2 s when quiet, stretched by the machine's load
    texts = [None] * R
    dist.all_gather_object(texts, (type(info.value).__name__, str(info.value)), group=world_group())
    assert len(set(texts)) == 1, texts
    loss = vocab_parallel_cross_entropy(local, labels, world_group())
    assert _rel(loss, F.cross_entropy(full.reshape(-1, vocab), labels.reshape(-1))) <= 1e-9


@pytest.mark.world(2)
@pytest.mark.parametrize(
    "arg, mine, match",
    [
        ("dtype", torch.float32, r"compute dtype .* they pass torch\.float32 and torch\.float64"),
        ("ignore_index", 0, "ignore_index must be the same on the 2 ranks of the group; they pass -100 and 0"),
        ("label_smoothing", 0.1, "label_smoothing must be the same on the 2 ranks of the group; they pass 0 and 0.1"),
    ],
)
def test_an_argument_differing_on_one_rank_is_one_error_r2(arg, mine, match):
    # Default mode (nothing agrees beforehand): another compute dtype or smoothing on one rank gave
    # the SUM all-reduce another size or dtype (gloo aborted); another ignore_index a wrong loss.
    vocab, sizes, _ = LAYOUTS["chunk_uneven"](world_size())
    full, labels = _problem((2, 5), vocab)
    local = _block(full, sizes)
    kw = {arg: mine} if rank() == 1 else {}
    dtype = kw.pop("dtype", torch.float64)
    with pytest.raises(RankMismatchError, match=match) as info:
        vocab_parallel_cross_entropy(local.to(dtype), labels, world_group(), **kw)
    texts = [None, None]
    dist.all_gather_object(texts, str(info.value), group=world_group())
    assert texts[0] == texts[1], texts
    loss = vocab_parallel_cross_entropy(local, labels, world_group())  # the group is still in step
    assert _rel(loss, F.cross_entropy(full.reshape(-1, vocab), labels.reshape(-1))) <= 1e-9


@pytest.mark.world(2)
@pytest.mark.parametrize("mode", [False, True], ids=["default", "checks"])
def test_labels_shape_on_one_rank_r2(mode):
    # The input: labels [2, 4] on one rank for logits [2, 5, V / R].
    _one_rank_labels(
        mode,
        1,
        torch.zeros(2, 4, dtype=torch.long),
        RankMismatchError,
        r"leading dims \(2, 5\) on every rank of the group of 2; ranks \[1\] pass another shape",
    )


@pytest.mark.world(3)
@pytest.mark.parametrize("mode", [False, True], ids=["default", "checks"])
def test_labels_on_one_rank_r3(mode):
    _one_rank_labels(mode, 0, torch.zeros(10, dtype=torch.long), RankMismatchError, r"ranks \[0\] pass another shape")
    _one_rank_labels(mode, 2, torch.zeros(2, 5), ShardkitTypeError, r"integer tensor .*ranks \[2\] pass another type")
    _one_rank_labels(mode, 1, [[0] * 5] * 2, ShardkitTypeError, r"integer tensor .*ranks \[1\] pass another type")


@pytest.mark.world(2)
@pytest.mark.parametrize("layout", ["chunk_uneven", "explicit_ragged"])
def test_vocab_parallel_head_r2(layout):
    _check_head(layout)


@pytest.mark.world(3)
def test_vocab_parallel_head_r3():
    _check_head("chunk_uneven")


@pytest.mark.world(4)
@pytest.mark.parametrize("layout", ["chunk_v5", "chunk_uneven"])
def test_vocab_parallel_head_r4(layout):
    _check_head(layout)


def _check_head(layout, hidden=6):
    """x @ W_local^T then the loss; x's gradient summed over ranks by all_reduce_backward must be
    the full-vocabulary reference gradient, and W_local's the matching rows of W's."""
    vocab, sizes, explicit = LAYOUTS[layout](world_size())
    gen = torch.Generator().manual_seed(3)
    x0 = torch.randn(2, 5, hidden, generator=gen, dtype=torch.float64)
    w0 = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, vocab, (2, 5), generator=gen)
    labels[0, 1] = -100
    x_ref, w_ref = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    ref = F.cross_entropy((x_ref @ w_ref.T).reshape(-1, vocab), labels.reshape(-1), label_smoothing=0.1)
    ref.backward()
    x, w = x0.clone().requires_grad_(), _block(w0.T, sizes).T.clone().requires_grad_()
    logits_local = all_reduce_backward(x, world_group()) @ w.T
    loss = vocab_parallel_cross_entropy(
        logits_local, labels, world_group(), label_smoothing=0.1, vocab_sizes=sizes if explicit else None
    )
    loss.backward()
    assert _rel(loss.detach(), ref.detach()) <= 1e-9
    assert _rel(x.grad, x_ref.grad) <= 1e-9
    assert _rel(w.grad, _block(w_ref.grad.T, sizes).T) <= 1e-9
