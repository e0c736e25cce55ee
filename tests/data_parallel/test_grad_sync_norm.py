"""``GradientSync``'s global gradient norm counts every parameter element once, without the CLI.

A tiny float64 Hugging Face decoder, parallelized on 4 ranks; each data rank back-propagates its
rows of one global batch (loss / global token count), ``pm.grads.reduce()`` sums over the data
ranks (``grad_reduce="sum"``), and ``pm.grads.global_norm()`` must equal the 2-norm of the
one-process gradient of the mean loss over the whole batch:

* GQA with ``tp`` > KV heads (4 query heads, 1 KV head, tp = 2): both tp ranks hold the one KV
  head; it counts once.
* ``edp`` experts (Qwen3-MoE, ep = 2 of the 4 ranks): every expert is held by the 2 ranks of its
  expert-data-parallel group; it counts once. With ``dp_shard`` FSDP2 shards it over those 2
  ranks instead: each shard counts, once.

With ``grad_reduce="mean"`` (the default) and each rank's own token mean as its loss, the norm
is the same: dense and expert gradients alike are divided by the data ranks once (FSDP2's own
divide factor for the parameters it reduces, :class:`GradientSync` for the rest).

Each claim can fail: the same run with the duplicate masking (or the ``edp`` replica rule)
switched off gives a different norm (checked below).
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from harness.helpers import all_true, rank
from harness.tiny_lm import loss_sum, predicted_tokens, tiny_decoder, token_ids
from shardkit.data_parallel import grads as grads_module
from shardkit.parallelize import parallelize
from shardkit.sharding import ParallelDims

BATCH = 4
GQA = dict(model="llama", kv_heads=1)  # 4 query heads, 1 KV head
MOE = dict(model="moe", experts=4)


def _one_process_norm(model_kw: dict) -> float:
    model = tiny_decoder(**model_kw)
    ids = token_ids(BATCH)
    (loss_sum(model(input_ids=ids).logits, ids) / predicted_tokens(ids)).backward()
    return torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters() if p.grad is not None)).item()


def _parallel_norm(layout: dict, model_kw: dict, grad_reduce: str = "sum") -> tuple[float, object]:
    """The global norm after one backward and ``reduce`` on ``layout``; and the ParallelModel.
    The loss is this rank's token losses over the global count (``"sum"``) or its own (``"mean"``)."""
    mesh = ParallelDims(**layout).build_mesh("cpu")
    pm = parallelize(tiny_decoder(**model_kw), mesh, grad_reduce=grad_reduce)
    ids = token_ids(BATCH)
    rows = BATCH // mesh.size("dp")
    mine = ids[mesh.local_rank("dp") * rows : (mesh.local_rank("dp") + 1) * rows]
    count = predicted_tokens(ids if grad_reduce == "sum" else mine)
    (loss_sum(pm.module(input_ids=mine).logits, mine) / count).backward()
    pm.grads.reduce()
    return pm.grads.global_norm().item(), pm


def _matches(norm: float, model_kw: dict) -> bool:
    """Whether ``norm`` is the one-process norm (float64 rounding), the same verdict on every rank."""
    ref = torch.tensor([_one_process_norm(model_kw) if rank() == 0 else 0.0], dtype=torch.float64)
    torch.distributed.broadcast(ref, src=0)
    return abs(norm - ref.item()) <= 1e-11 * ref.item()


GQA_LAYOUTS = {"tp=2 x dp_replicate=2": dict(tp=2, dp_replicate=2), "tp=2 x dp_shard=2": dict(tp=2, dp_shard=2)}


@pytest.mark.world(4, timeout=180)
@pytest.mark.parametrize("layout", list(GQA_LAYOUTS.values()), ids=list(GQA_LAYOUTS))
def test_global_norm_counts_replicated_kv_heads_once(layout):
    norm, pm = _parallel_norm(layout, GQA)
    k_spec = pm.layouts["model.layers.0.self_attn.k_proj.weight"].spec
    assert k_spec is not None and k_spec.overlapping  # the case under test: the KV head on both tp ranks
    assert all_true(_matches(norm, GQA)), f"rank {rank()}: norm {norm}"


@pytest.mark.world(4, timeout=180)
@pytest.mark.parametrize("layout", list(GQA_LAYOUTS.values()), ids=list(GQA_LAYOUTS))
def test_the_kv_check_fails_when_copies_are_counted_twice(layout):
    with mock.patch.object(grads_module, "_owned_mask", return_value=None):
        norm, _ = _parallel_norm(layout, GQA)
    assert all_true(not _matches(norm, GQA))


MOE_LAYOUTS = {
    "moe tp=2 x dp_replicate=2, ep=2": dict(tp=2, dp_replicate=2, ep=2),
    "moe dp_shard=4, ep=2": dict(dp_shard=4, ep=2),
}


@pytest.mark.world(4, timeout=180)
@pytest.mark.parametrize("layout", list(MOE_LAYOUTS.values()), ids=list(MOE_LAYOUTS))
def test_global_norm_counts_edp_experts_once(layout):
    norm, pm = _parallel_norm(layout, MOE)
    assert pm.mesh.size("edp") == 2  # each expert on 2 ranks
    assert any(lay.expert for lay in pm.layouts.values())
    assert all_true(_matches(norm, MOE)), f"rank {rank()}: norm {norm}"


@pytest.mark.world(4, timeout=180)
def test_the_edp_check_fails_when_expert_replicas_all_count():
    def every_expert_replica(self, lay):
        return True if lay.expert else real(self, lay)

    real = grads_module.GradientSync._counts_here
    with mock.patch.object(grads_module.GradientSync, "_counts_here", every_expert_replica):
        norm, _ = _parallel_norm(dict(tp=2, dp_replicate=2, ep=2), MOE)
    assert all_true(not _matches(norm, MOE))


@pytest.mark.world(4, timeout=180)
def test_the_edp_check_fails_when_one_fsdp2_shard_counts_for_the_expert():
    def replica_rule(self, lay):  # the rule for replicated experts, wrong for FSDP2 shards
        return self.mesh.local_rank("edp") == 0 if lay.expert else real(self, lay)

    real = grads_module.GradientSync._counts_here
    layout = MOE_LAYOUTS["moe dp_shard=4, ep=2"]
    norm, pm = _parallel_norm(layout, MOE)
    assert all(lay.fsdp for lay in pm.layouts.values() if lay.expert)  # experts FSDP2-sharded over edp
    assert all_true(_matches(norm, MOE))
    with mock.patch.object(grads_module.GradientSync, "_counts_here", replica_rule):
        norm, _ = _parallel_norm(layout, MOE)
    assert all_true(not _matches(norm, MOE))


# ep = 4 over tp x dp_shard leaves edp = 1: the expert gradients are divided without a reduction
MEAN_LAYOUTS = {**GQA_LAYOUTS, **MOE_LAYOUTS, "moe tp=2 x dp_shard=2, ep=4": dict(tp=2, dp_shard=2, ep=4)}


@pytest.mark.world(4, timeout=180)
@pytest.mark.parametrize("layout", list(MEAN_LAYOUTS.values()), ids=list(MEAN_LAYOUTS))
def test_global_norm_of_the_mean_over_data_ranks(layout):
    model_kw = MOE if "ep" in layout else GQA
    norm, pm = _parallel_norm(layout, model_kw, grad_reduce="mean")
    assert layout.get("ep") != 4 or pm.mesh.size("edp") == 1
    assert all_true(_matches(norm, model_kw)), f"rank {rank()}: norm {norm}"
