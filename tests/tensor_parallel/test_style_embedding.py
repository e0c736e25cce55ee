"""``ColwiseParallel`` / ``RowwiseParallel`` on an ``nn.Embedding``, as PyTorch DTensor's styles.

The embedding cases of PyTorch's ``test/distributed/tensor/parallel/test_tp_style.py``, ported
(shapes and collective counts), with parity to one process added: a ``16 x 16`` table, ids
``arange(8)`` as ``[4, 2]`` (or ``[8]``), 2 ranks.

* ``ColwiseParallel()`` cuts the embedding features (weight dim 1): output ``[4, 2, 16 / R]``,
  this rank's columns of the one-process output, no communication forward or backward.
  (Before, it cut the vocabulary as for a linear layer: every rank but 0 looked up wrong rows.)
* ``ColwiseParallel(output_layouts=Replicate())``: ``[4, 2, 16]``, one all-gather forward.
* ``RowwiseParallel(input_layouts=Replicate())`` (vocab-parallel): ``[4, 2, 16]``, one all-reduce
  forward, none backward. With ``output_layouts=Shard(1)`` on ``[8]`` ids: ``[8, 16 / R]``, one
  reduce-scatter forward, one all-gather backward. (Before, refused.)

Every case checks the output and the weight gradient against one process (float64, exact up to
rounding), with an uneven split (7 features or 15 rows on 2 ranks) too.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from harness.helpers import rank, world_group
from shardkit import CommLedger, ShardkitError
from shardkit.sharding import shard_spec
from shardkit.tensor_parallel import ColwiseParallel, Replicate, RowwiseParallel, Shard

TOL = dict(rtol=1e-12, atol=1e-12)


def _embedding(vocab: int = 16, dim: int = 16) -> nn.Embedding:
    torch.manual_seed(0)
    return nn.Embedding(vocab, dim).double()


def _run(style, ids: torch.Tensor, vocab: int = 16, dim: int = 16):
    """(local output, its upstream gradient's matching block, one-process output, one-process
    weight gradient, the module, forward ledger, backward ledger)."""
    ref = _embedding(vocab, dim)
    mod = style.apply(copy.deepcopy(ref), world_group())
    out_ref = ref(ids)
    grad = torch.randn(out_ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    (out_ref * grad).sum().backward()
    with CommLedger() as fwd:
        out = mod(ids)
    return out, grad, out_ref.detach(), ref.weight.grad, mod, fwd


def _ops(ledger: CommLedger) -> list[str]:
    """The collectives recorded, one name per call (``all_gather_single`` counts as ``all_gather``)."""
    return sorted(op.removesuffix("_single") for (op, _), row in ledger.summary().items() for _ in range(row["count"]))


def _block(full: torch.Tensor, mod: nn.Embedding, dim: int) -> torch.Tensor:
    """This rank's block of ``full`` along ``dim``, from the weight's recorded split."""
    spec = shard_spec(mod.weight)
    ((start, stop),) = spec.ranges[rank()]
    return full.narrow(dim, start, stop - start)


@pytest.mark.world(2)
@pytest.mark.parametrize("dim", [16, 7], ids=["even", "uneven"])
def test_colwise_on_an_embedding_cuts_the_embedding_dim(dim):
    ids = torch.arange(8).reshape(4, 2)
    out, grad, out_ref, wgrad_ref, mod, fwd = _run(ColwiseParallel(), ids, dim=dim)
    local = _block(torch.arange(dim), mod, 0).numel()
    assert out.shape == (4, 2, local) and mod.weight.shape == (16, local) and mod.embedding_dim == local
    assert shard_spec(mod.weight).dim == 1
    assert fwd.count() == 0
    torch.testing.assert_close(out, _block(out_ref, mod, -1), **TOL)
    with CommLedger() as bwd:
        (out * _block(grad, mod, -1)).sum().backward()
    assert bwd.count() == 0
    torch.testing.assert_close(mod.weight.grad, _block(wgrad_ref, mod, 1), **TOL)


@pytest.mark.world(2)
def test_colwise_on_an_embedding_gathers_to_replicate():
    ids = torch.arange(8).reshape(4, 2)
    out, grad, out_ref, wgrad_ref, mod, fwd = _run(ColwiseParallel(output_layouts=Replicate()), ids, dim=7)
    assert out.shape == (4, 2, 7)
    assert _ops(fwd) in (["all_gather"], ["all_to_all"]), fwd.summary()  # gloo: uneven gathers by all-to-all
    torch.testing.assert_close(out, out_ref, **TOL)
    with CommLedger() as bwd:
        (out * grad).sum().backward()
    assert bwd.count() == 0
    torch.testing.assert_close(mod.weight.grad, _block(wgrad_ref, mod, 1), **TOL)


@pytest.mark.world(2)
@pytest.mark.parametrize("vocab", [16, 15], ids=["even", "uneven"])
def test_rowwise_on_an_embedding_is_vocab_parallel(vocab):
    ids = torch.tensor([[0, 15 % vocab], [7, 8], [3, 12], [14, 1]])
    out, grad, out_ref, wgrad_ref, mod, fwd = _run(RowwiseParallel(input_layouts=Replicate()), ids, vocab=vocab)
    assert out.shape == (4, 2, 16) and shard_spec(mod.weight).dim == 0
    assert _ops(fwd) == ["all_reduce"], fwd.summary()
    torch.testing.assert_close(out, out_ref, **TOL)
    with CommLedger() as bwd:
        (out * grad).sum().backward()
    assert bwd.count() == 0
    torch.testing.assert_close(mod.weight.grad, _block(wgrad_ref, mod, 0), **TOL)


@pytest.mark.world(2)
def test_rowwise_on_an_embedding_reduce_scatters_to_shard():
    ids = torch.arange(8)
    style = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    out, grad, out_ref, wgrad_ref, mod, fwd = _run(style, ids)
    assert out.shape == (8, 16 // 2)
    assert _ops(fwd) == ["reduce_scatter"], fwd.summary()
    torch.testing.assert_close(out, out_ref[:, rank() * 8 : (rank() + 1) * 8], **TOL)
    with CommLedger() as bwd:
        (out * grad[:, rank() * 8 : (rank() + 1) * 8]).sum().backward()
    assert _ops(bwd) == ["all_gather"], bwd.summary()
    torch.testing.assert_close(mod.weight.grad, _block(wgrad_ref, mod, 0), **TOL)


@pytest.mark.world(2)
@pytest.mark.parametrize(
    "style,match",
    [
        (RowwiseParallel(), r"nn\.Embedding, whose input ids must be replicated: pass input_layouts=Replicate\(\)"),
        (ColwiseParallel(input_layouts=Shard(1)), r"ColwiseParallel: .* pass input_layouts=Replicate\(\)"),
        (ColwiseParallel(parts=2), "an nn.Embedding has no packed parts"),
    ],
    ids=["rowwise default Shard(-1) ids", "colwise sharded ids", "packed"],
)
def test_embedding_layouts_that_cannot_apply_are_refused_on_every_rank(style, match):
    with pytest.raises(ShardkitError, match=match):
        style.apply(_embedding(), world_group())


@pytest.mark.world(2)
def test_colwise_refuses_an_embedding_with_max_norm_which_rowwise_keeps():
    with pytest.raises(ShardkitError, match=r"max_norm=1\.0 cannot be cut by embedding features"):
        ColwiseParallel().apply(nn.Embedding(16, 16, max_norm=1.0), world_group())
    torch.manual_seed(0)
    ref = nn.Embedding(16, 16, max_norm=1.0).double()
    mod = RowwiseParallel(input_layouts=Replicate()).apply(copy.deepcopy(ref), world_group())
    ids = torch.arange(16).reshape(4, 4)
    torch.testing.assert_close(mod(ids), ref(ids), **TOL)  # whole rows on their owner: the same renorm


class _Shifted(nn.Embedding):
    """An embedding whose forward adds something the vocab-parallel lookup cannot know."""

    def forward(self, ids):
        return super().forward(ids) + 1.0


@pytest.mark.world(2)
def test_rowwise_keeps_a_scaled_embeddings_factor_and_refuses_other_own_forwards():
    # Gemma 2's input embedding: lookup * sqrt(H) in its own forward, which the vocab-parallel
    # lookup replaces (it dropped the factor before); any other subclass forward: refused
    from transformers.models.gemma2.modeling_gemma2 import Gemma2TextScaledWordEmbedding

    torch.manual_seed(0)
    ref = Gemma2TextScaledWordEmbedding(15, 16, padding_idx=0, embed_scale=4.0).double()
    mod = RowwiseParallel(input_layouts=Replicate()).apply(copy.deepcopy(ref), world_group())
    ids = torch.tensor([[0, 14], [7, 8], [3, 12]])
    grad = torch.randn(3, 2, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    out, out_ref = mod(ids), ref(ids)
    torch.testing.assert_close(out, out_ref, **TOL)
    assert not torch.allclose(out_ref, torch.nn.functional.embedding(ids, ref.weight))  # the factor shows
    (out * grad).sum().backward()
    (out_ref * grad).sum().backward()
    torch.testing.assert_close(mod.weight.grad, _block(ref.weight.grad, mod, 0), **TOL)
    with pytest.raises(ShardkitError, match=r"_Shifted: an nn\.Embedding subclass with its own forward cannot be cut"):
        RowwiseParallel(input_layouts=Replicate()).apply(_Shifted(16, 16), world_group())
