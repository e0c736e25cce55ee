"""``parallelize(..., mixed_precision="bf16")``: float64 parity within a derived bf16 bound, fp32 reductions.

Each rank builds the tiny decoder in float32 (the masters), parallelizes it with bf16 compute on a
4-rank layout (the Qwen3 MoE too, with ep), runs one global batch (the trainer's loss convention) and, after
``pm.grads.reduce()``, one SGD step of lr 1: the full parameters moved by minus the gradient. The
loss and that gradient are compared with the float64 one-process run from the same weights.

**The bound.** bfloat16 keeps 8 significand bits: each rounding has relative error at most
``u = 2^-8``; modelled as independent and uniform on ``[-u, u]`` (standard deviation
``u / sqrt(3)``), ``n`` roundings along a gradient's path give a relative error of about
``u * sqrt(n / 3)``. A gradient's path crosses every block twice (forward and backward), about 12
bf16 roundings each way per block (the weight casts, q/k/v, attention, o, two norms, gate, up, the
activation, down, two residual adds), plus about 6 for the embedding, final norm and ``lm_head``:
``n = 24 L + 6``. The test allows twice the model, ``2 u sqrt((24 L + 6) / 3)`` = 0.033 for the
tiny decoders (``L = 2``), for the whole gradient (every parameter's, concatenated) and for the
loss; measured: gradient 0.0056 to 0.0059 (Llama), 0.0083 (the MoE), loss 4e-7 to 3e-5. One
parameter alone can exceed the model where its gradient is a sum over tokens that cancels (the
Qwen3 MoE's per-head q/k norm weights: 0.032; Llama's worst: 0.011), so each parameter is held to
a bug bar of 0.1 instead: a dropped or doubled reduction errs by 0.5 to 1. A run that silently
computed in float32 stays under ``u / 8`` (float32 rounding: about 1e-6), so the lower side can
fail too.

The ledger of the same step: every parameter-gradient reduction (FSDP2's reduce-scatter and
HSDP all-reduce, ``GradientSync`` over ``dp_cp`` and ``edp``, tp's ``sum_grad_over`` hooks) is
float32; every other collective that moves floating-point data (forward, and the activations'
gradients in backward, ep's token all-to-alls included) is bfloat16.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness.helpers import all_true, rank
from harness.tiny_lm import SIZES, loss_sum, predicted_tokens, tiny_decoder, token_ids
from shardkit.comm.ledger import CommLedger
from shardkit.errors import ShardkitError
from shardkit.parallelize import gather_full_parameters, parallelize
from shardkit.sharding import ParallelDims

BATCH = 4
U = 2.0**-8  # bfloat16's unit roundoff
FLOATS = ("float64", "float32", "bfloat16", "float16")
BUG_BAR = 0.1  # per parameter: a dropped or doubled reduction errs by 0.5 to 1


def bf16_bound(layers: int) -> float:
    """Twice the random-rounding model's relative error ``u sqrt(n / 3)``, ``n = 24 L + 6``."""
    return 2 * U * math.sqrt((24 * layers + 6) / 3)


LAYOUTS = {
    "tp=2 x dp_shard=2 (FSDP2)": ("llama", dict(tp=2, dp_shard=2), False),
    "tp=2 x dp_replicate=2, sequence parallel": ("llama", dict(tp=2, dp_replicate=2), True),
    "dp_shard=2 x dp_replicate=2 (HSDP)": ("llama", dict(dp_shard=2, dp_replicate=2), False),
    "cp_ulysses=2 x tp=2": ("llama", dict(cp_ulysses=2, tp=2), False),
    "moe: ep=2 from tp=2, x dp_replicate=2": ("moe", dict(tp=2, dp_replicate=2, ep=2), False),
}
# ledger apis of the parameter-gradient reductions (FSDP2's are its backward reduce-scatter / all-reduce)
REDUCTIONS = {"dp_cp_grads", "expert_grads", "sum_grad_over", "tp_replicated_heads", "sum_tied_embedding_grads"}


def _reference(model_name: str) -> tuple[float, dict[str, torch.Tensor]]:
    """float64, one process: the mean loss over the whole batch and its gradients."""
    model = tiny_decoder(model_name)
    ids = token_ids(BATCH)
    loss = loss_sum(model(input_ids=ids).logits, ids) / predicted_tokens(ids)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _is_reduction(r) -> bool:
    return r.api in REDUCTIONS or (r.api == "fully_shard" and r.op in ("reduce_scatter_single", "all_reduce"))


def _mixed_step(model_name: str, layout: dict, sequence_parallel: bool):
    """One bf16 step: (global loss, {name: -gradient} on rank 0 else None, ledger records)."""
    mesh = ParallelDims(**layout).build_mesh("cpu")
    pm = parallelize(
        tiny_decoder(model_name, dtype="float32"),
        mesh,
        sequence_parallel=sequence_parallel,
        grad_reduce="sum",
        mixed_precision="bf16",
    )
    ids = token_ids(BATCH)
    rows = BATCH // mesh.size("dp")
    mine = ids[mesh.local_rank("dp") * rows : (mesh.local_rank("dp") + 1) * rows]
    with CommLedger() as ledger:
        if pm.cp is None:
            logits = pm.module(input_ids=mine).logits
            loss = loss_sum(logits, mine) / predicted_tokens(ids)
        else:  # this rank's tokens and their (already shifted) targets
            batch = pm.cp.shard_batch(mine, mine)
            logits = pm.module(**batch.inputs).logits
            flat = logits.reshape(-1, logits.shape[-1]).double()
            loss = F.cross_entropy(flat, batch.labels.reshape(-1), reduction="sum") / predicted_tokens(ids)
        loss.backward()
        pm.grads.reduce()
    before = gather_full_parameters(pm)
    before = before and {n: t.clone() for n, t in before.items()}
    torch.optim.SGD(pm.module.parameters(), lr=1.0).step()
    after = gather_full_parameters(pm)
    total = loss.detach().double()
    dist.all_reduce(total, group=mesh["dp_cp"].get_group())
    moved = None if before is None or after is None else {n: before[n] - after[n] for n in before}
    assert ledger.count(dtype="float32") == sum(r.dtype == "float32" for r in ledger.records)  # count by dtype
    return total.item(), moved, ledger.records, logits.dtype


@pytest.mark.world(4, timeout=240)
@pytest.mark.parametrize("model_name,layout,sequence_parallel", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_bf16_step_matches_float64_within_the_bound_and_reduces_in_fp32(model_name, layout, sequence_parallel):
    loss, moved, records, logits_dtype = _mixed_step(model_name, layout, sequence_parallel)
    reductions = [r for r in records if _is_reduction(r)]
    # collectives moving floating-point data (routing counts and metadata are integers)
    moving = [r for r in records if not _is_reduction(r) and r.dtype in FLOATS and r.phase != "check"]
    checks = {
        "logits in bf16": logits_dtype == torch.bfloat16,
        "gradient reductions issued": len(reductions) > 0,
        "every gradient reduction in float32": all(r.dtype == "float32" for r in reductions),
        "forward collectives issued": any(r.phase == "forward" for r in moving),
        "every activation collective in bfloat16": all(r.dtype == "bfloat16" for r in moving),
    }
    ref_loss, grads = _reference(model_name)
    bound = bf16_bound(SIZES["layers"])
    checks["loss within the bound"] = abs(loss - ref_loss) / abs(ref_loss) <= bound
    if rank() == 0:  # the full parameters are gathered on rank 0
        diff = torch.cat([(moved[n].double() - grads[n]).reshape(-1) for n in grads])
        whole = (diff.norm() / torch.cat([g.reshape(-1) for g in grads.values()]).norm()).item()
        worst = max(((moved[n].double() - grads[n]).norm() / grads[n].norm()).item() for n in grads)
    checks["the gradient within the bound"] = rank() != 0 or whole <= bound
    checks["every parameter's gradient within the bug bar"] = rank() != 0 or worst <= BUG_BAR
    checks["really computed in bf16"] = rank() != 0 or whole > U / 8
    for name, ok in checks.items():
        assert all_true(ok), (name, sorted({(r.api, r.op, r.phase, r.dtype) for r in records}))


@pytest.mark.world(1, timeout=60)
def test_mixed_precision_is_refused_on_float64_masters_and_unknown_modes():
    with pytest.raises(ShardkitError, match="float32 master parameters"):
        parallelize(tiny_decoder(), None, mixed_precision="bf16")
    with pytest.raises(ShardkitError, match="mixed precision must be one of none, bf16"):
        parallelize(tiny_decoder(dtype="float32"), None, mixed_precision="fp16")


@pytest.mark.world(1, timeout=60)
def test_masters_and_their_gradients_stay_float32_while_compute_is_bf16():
    pm = parallelize(tiny_decoder(dtype="float32"), None, mixed_precision="bf16", activation_checkpoint="full")
    ids = token_ids(2)
    logits = pm.module(input_ids=ids).logits
    loss_sum(logits, ids).backward()
    assert logits.dtype == torch.bfloat16
    assert {p.dtype for p in pm.module.parameters()} == {torch.float32}
    assert {p.grad.dtype for p in pm.module.parameters()} == {torch.float32}
