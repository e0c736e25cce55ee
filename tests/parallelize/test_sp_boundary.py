"""``parallelize_stage`` under sequence parallelism: the stage boundary carries each tp rank's
sequence block (issue 33), Megatron-LM's pipeline x SP.

pp 2 x tp 2, a 15-token sequence (blocks of 8 and 7 tokens): the losses and every gradient equal
one process's (float64, 1e-9), and the bytes each rank sends across the boundary, counted by the
CommLedger, are its block's ``b x S_r x H`` (plus the 160-byte header): half of the replicated
``b x S x H`` that ``sp_boundary="gathered"`` sends, which the same test measures. A chunk
receiving a block cannot know ``S``: without ``seq_len`` in ``stage_kwargs`` every rank raises.
"""

import copy
import sys
from pathlib import Path

import pytest
import torch

from harness.helpers import all_true, rank
from shardkit import CommLedger
from shardkit.errors import ShardkitError
from shardkit.parallelize import parallelize_stage
from shardkit.pipeline_parallel import run_schedule
from shardkit.plan.collectives import HEADER_BYTES
from shardkit.sharding import ParallelDims
from shardkit.tensor_parallel import gather_full_grads

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tensor_parallel"))
from hf_models import VOCAB, build  # noqa: E402

S, B, M = 15, 2, 2  # tokens (blocks 8 + 7 over tp 2), rows per microbatch, microbatches
BLOCKS = (8, 7)


def _loss(logits, ids):
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _stage(full, boundary: str):
    mesh = ParallelDims(pp=2, tp=2, world_size=4).build_mesh("cpu")
    pm = parallelize_stage(copy.deepcopy(full), mesh, _loss, sequence_parallel=True, sp_boundary=boundary)
    return pm, mesh.local_rank("pp"), mesh.local_rank("tp")


def _sent(records, phase: str) -> int:
    """Bytes this rank sent over the pipeline in ``phase`` (P2P; ring attention has none here)."""
    return sum(r.bytes_sent for r in records if r.op == "send" and r.phase == phase)


@pytest.mark.world(4, timeout=240)
def test_the_boundary_carries_each_tp_ranks_sequence_block():
    full = build("llama", num_hidden_layers=4)
    H = full.config.hidden_size
    gen = torch.Generator().manual_seed(3)
    mbs = [torch.randint(0, VOCAB, (B, S), generator=gen) for _ in range(M)]
    ref = [_loss(full(input_ids=x).logits, x) for x in mbs]
    (sum(ref) / M).backward()
    ref_grads = dict(full.named_parameters())
    ok, sent = True, {}
    for boundary in ("shard", "gathered"):
        pm, s, t = _stage(full, boundary)
        with CommLedger() as ledger:
            losses = run_schedule(pm.stage, "1f1b", mbs, mbs, num_microbatches=M, stage_kwargs=[{"seq_len": S}] * M)
        ok &= s == 0 or all(torch.allclose(a, b.detach(), rtol=1e-9, atol=0) for a, b in zip(losses, ref))
        for name, g in gather_full_grads(pm.module).items():
            ok &= torch.allclose(g, ref_grads[name].grad, rtol=1e-9, atol=1e-15)
        # stage 0 sends activations forward, stage 1 their gradients back: the same shapes
        sent[boundary] = _sent(ledger.records, "forward" if s == 0 else "backward")
    elem = 8  # float64
    assert sent["shard"] == M * (B * BLOCKS[t] * H * elem + HEADER_BYTES), sent
    assert sent["gathered"] == M * (B * S * H * elem + HEADER_BYTES), sent
    assert all_true(bool(ok))


@pytest.mark.world(4, timeout=120)
def test_a_block_boundary_without_the_sequence_length_raises_on_every_rank():
    pm, _, _ = _stage(build("llama", num_hidden_layers=2), "shard")
    mbs = [torch.randint(0, VOCAB, (B, S)) for _ in range(M)]
    with pytest.raises(ShardkitError, match="seq_len or position_ids in every microbatch's stage_kwargs"):
        run_schedule(pm.stage, "1f1b", mbs, mbs, num_microbatches=M)
    assert rank() >= 0
