"""The planner's collectives equal the composed trainer's CommLedger, rank by rank.

Each case trains one step of :mod:`shardkit.train.run` (the code ``shardkit train`` runs) in a
persistent gloo world, records every rank's ledger, and compares it with
:func:`shardkit.plan.step_collectives` for that rank's pipeline stage: the same calls (op, api,
phase, group size), counts and bytes sent and received, exactly. Expert-parallel token
exchanges receive what the router sends, so for them the bytes each rank receives are checked
in sum over the ranks (every row sent is received once) and the rest exactly.
"""

import email
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from harness.helpers import SMALL_CORPUS, world_size
from harness.tiers import tiered
from shardkit import CommLedger
from shardkit.plan import ModelShape, StepOptions
from shardkit.plan.collectives import ledger_table, merged, step_collectives
from shardkit.plan.options import rank_stage
from shardkit.train.config import TrainConfig, parallel_dims, validate_config
from shardkit.train.model import hf_config
from shardkit.train.run import build_parallel_model, build_task, build_train_model, run_training
from shardkit.train.specs import model_spec

# one 90 KB file, not the 31 MB default corpus rank 0 would read and broadcast in every case
# (docs/design.md, Testing); the packed cases need a folder (a packed window is the files it
# spans): the 36 files (70 KB) of the standard library's email/mime. (Their one step's windows
# hold one document each, as they did on the default corpus: checked with the sampler's seed.)
CORPUS = SMALL_CORPUS
DOCUMENTS = str(Path(email.__file__).parent / "mime")
SMALL = dict(steps=1, seq_len=16, batch_size=4, dtype="float32", verify=False, layers=2, lr=1e-3)
ROUTED = ("token_dispatch", "token_combine")


def _ledgers(cfg: TrainConfig) -> list[list]:
    """Every rank's ledger of one training step (FSDP2's calls included), on every rank."""
    dims = parallel_dims(cfg)
    mesh = dims.build_mesh("cpu")
    device = torch.device("cpu")
    task = build_task(cfg, device)
    pm, loss_scale = build_parallel_model(build_train_model(cfg), mesh, cfg, task, device)
    with CommLedger() as ledger:
        run_training(pm, task, cfg, loss_scale)
    everyone: list = [None] * world_size()
    dist.all_gather_object(everyone, ledger.records)
    return everyone


def _routed_split(table: dict) -> tuple[dict, int]:
    """The table with the router-dependent bytes set aside, and their sum."""
    exact, dependent = {}, 0
    for key, (count, sent, received) in table.items():
        if key[1] not in ROUTED:
            exact[key] = (count, sent, received)
        elif (key[1] == "token_dispatch") == (key[2] == "forward"):  # receives the routed rows
            exact[key], dependent = (count, sent, 0), dependent + received
        else:  # sends them back
            exact[key], dependent = (count, 0, received), dependent + sent
    return exact, dependent


def check(overrides: dict) -> None:
    data = {"data": DOCUMENTS if overrides.get("packed") else CORPUS}
    cfg = validate_config(TrainConfig(**{**SMALL, **data, **overrides}), world_size=world_size())
    dims = parallel_dims(cfg)
    shape = ModelShape.from_config(hf_config(cfg, model_spec(cfg.model).family)[1])
    opts = StepOptions(
        cfg.seq_len,
        cfg.batch_size,
        cfg.microbatches,
        cfg.dtype,
        cfg.sequence_parallel,
        cfg.loss_parallel,
        cfg.schedule,
        virtual_stages=cfg.virtual_stages,
        zero=cfg.zero,
    )
    got_routed = want_routed = 0
    ledgers = _ledgers(cfg)
    for rank, records in enumerate(ledgers):
        stage, tp_rank = rank_stage(dims, rank)
        want, got = merged(step_collectives(shape, dims, opts, stage, tp_rank)), ledger_table(records)
        if dims.ep > 1:
            (want, w), (got, g) = _routed_split(want), _routed_split(got)
            want_routed, got_routed = want_routed + w, got_routed + g
        diff = {k: (got.get(k), want.get(k)) for k in set(got) | set(want) if got.get(k) != want.get(k)}
        assert not diff, f"rank {rank} (stage {stage}) of {dims.describe()}: (ledger, plan) differ at {diff}"
        assert got, "an empty ledger proves nothing"
    assert got_routed == want_routed, (got_routed, want_routed)


LAYOUTS_4 = {
    "llama: tp=4 (SP)": dict(tp=4, kv_heads=4),
    "llama: tp=2 x dp_replicate=2, no SP": dict(tp=2, sequence_parallel=False),
    "qwen3: tp=4 (SP), loss parallel": dict(model="qwen3", tp=4, loss_parallel=True, kv_heads=4),
    "qwen2: tp=2 x dp=2, loss parallel, no SP": dict(model="qwen2", tp=2, loss_parallel=True, sequence_parallel=False),
    "llama: cp_ulysses=4": dict(tp=1, cp_ulysses=4, kv_heads=4),
    "llama: cp_ring=4 (zigzag)": dict(tp=1, cp_ring=4, seq_len=32),
    "llama: USP cp_ring=2 x cp_ulysses=2": dict(tp=1, cp_ring=2, cp_ulysses=2, seq_len=32),
    "llama: cp_ring=2 x tp=2 (SP)": dict(cp_ring=2, tp=2, seq_len=32),
    "llama: cp_ulysses=2 x dp_shard=2 (FSDP2)": dict(tp=1, cp_ulysses=2, dp_shard=2),
    "llama: pp=2 x dp=2, 1f1b": dict(tp=1, pp=2, microbatches=2),
    "llama: pp=2 x tp=2 (SP), 4 microbatches": dict(pp=2, tp=2, microbatches=4, batch_size=8),
    # the tp rows assume blocks of T / tp (uneven blocks gather through all_to_all_single):
    # tests/parallelize/test_sp_boundary.py counts the P2P bytes of uneven blocks
    "llama: pp=2 x tp=2 (SP), interleaved-1f1b v2 (sequence blocks cross every chunk boundary)": dict(
        pp=2, tp=2, microbatches=2, schedule="interleaved-1f1b", virtual_stages=2, layers=4
    ),
    "llama: pp=2 x tp=2 (SP), zbv (blocks cross; the V's turn is local)": dict(
        pp=2, tp=2, microbatches=2, schedule="zbv", virtual_stages=2, layers=4
    ),
    "llama: dp_replicate=4, 2 accumulated microbatches": dict(tp=1, microbatches=2, batch_size=8),
    "qwen3: dp_shard=2 x tp=2 (SP)": dict(model="qwen3", dp_shard=2),
    "llama: HSDP dp_replicate=2 x dp_shard=2": dict(tp=1, dp_shard=2),
    "llama: dp_shard=2 x tp=2 (SP)": dict(dp_shard=2),
    "llama: HSDP dp_replicate=2 x dp_shard=2, 2 accumulated microbatches": dict(
        tp=1, dp_shard=2, microbatches=2, batch_size=8
    ),
    "llama: pp=2 x dp_shard=2 (FSDP2), 1f1b": dict(tp=1, pp=2, dp_shard=2, microbatches=2),
    "moe: ep=4 over dp_shard=4": dict(model="moe", tp=1, ep=4, dp_shard=4),
    "moe: ep=4 over cp_ulysses=4 (expert grads over edp=1)": dict(model="moe", tp=1, ep=4, cp_ulysses=4, kv_heads=4),
    "moe: ep=2 over cp_ulysses=2 x dp_replicate=2 (edp=2)": dict(model="moe", tp=1, ep=2, cp_ulysses=2),
    "moe: ep=2 borrowed from tp=2 x dp=2": dict(model="moe", ep=2),
    "mla: tp=2 x dp=2, ep=2, loss parallel": dict(model="mla", ep=2, loss_parallel=True),
    "moe: tp=2 (tensor-parallel experts) x dp=2": dict(model="moe", tp=2),
    "mla: tp=2 (tensor-parallel experts, shared experts) x dp=2": dict(model="mla", tp=2),
    "llama: packed documents, USP cp_ring=2 x cp_ulysses=2": dict(
        tp=1, cp_ring=2, cp_ulysses=2, packed=True, batch_size=1, seq_len=64
    ),
    "llama: packed documents, dp=2 x tp=2 (SP)": dict(packed=True, seq_len=64),
    "qwen3: bfloat16, cp_ring=2 x tp=2 (SP), loss parallel": dict(
        model="qwen3", cp_ring=2, tp=2, seq_len=32, dtype="bfloat16", loss_parallel=True
    ),
    "moe: tp=4 (SP), tensor-parallel experts": dict(model="moe", tp=4, kv_heads=4, sequence_parallel=True),
    "mla: tp=2 (SP) x dp=2, tensor-parallel and shared experts": dict(model="mla", sequence_parallel=True),
    "moe: tp=2 (SP) x dp=2, ep=2 on the local sequence block": dict(model="moe", ep=2, sequence_parallel=True),
    "mla: tp=2 (SP) x dp=2, ep=2, shared experts gather": dict(model="mla", ep=2, sequence_parallel=True),
    "moe: dp_shard=2 x tp=2 (SP), ep=2": dict(model="moe", dp_shard=2, ep=2, sequence_parallel=True),
    "moe: dp_shard=4, ep=2 (experts FSDP2 over edp=2)": dict(model="moe", tp=1, dp_shard=4, ep=2),
    "moe: HSDP dp_replicate=2 x dp_shard=2, ep=2, 2 accumulated microbatches (experts over edp)": dict(
        model="moe", tp=1, dp_shard=2, ep=2, microbatches=2, batch_size=8
    ),
    "mla: cp_ulysses=2 x dp=2": dict(model="mla", tp=1, cp_ulysses=2),
    "mla: cp_ring=2 x dp=2": dict(model="mla", tp=1, cp_ring=2, seq_len=32),
    "mla: USP cp_ring=2 x cp_ulysses=2": dict(model="mla", tp=1, cp_ring=2, cp_ulysses=2, seq_len=32),
    "mla: cp_ring=2 x tp=2": dict(model="mla", cp_ring=2, tp=2, seq_len=32),
    "llama: pp_tp=2,1,1 (leader send, broadcast back)": dict(pp_tp="2,1,1", layers=3, microbatches=2),
    "llama: pp_tp=1,2,1, 3 microbatches (broadcast both ways)": dict(
        pp_tp="1,2,1", layers=3, microbatches=3, batch_size=6
    ),
    "mla: pp_tp=2,1,1, tensor-parallel experts on the tp=2 stage": dict(
        model="mla", pp_tp="2,1,1", layers=3, microbatches=2
    ),
    "llama: pp_tp=1,1 x dp_replicate=2": dict(pp_tp="1,1", dp_replicate=2, microbatches=2),
    "llama: dp_replicate=4, zero 1": dict(tp=1, zero=1),
    "llama: dp_replicate=4, zero 2, 2 accumulated microbatches": dict(tp=1, zero=2, microbatches=2, batch_size=8),
    "llama: tp=2 (SP) x dp=2, zero 2": dict(zero=2),
    "llama: dp=4, zero 2, 24858 parameters (bucket padded to 24860)": dict(
        tp=1, zero=2, hidden_size=18, heads=3, kv_heads=1
    ),
    "llama: pp=2 x dp=2, zero 1, 1f1b": dict(tp=1, pp=2, microbatches=2, zero=1),
    "llama: cp_ring=2 x dp=2, zero 2": dict(tp=1, cp_ring=2, seq_len=32, zero=2),
    "moe: ep=2 borrowed from tp=2 x dp=2, zero 2 (experts over edp)": dict(model="moe", ep=2, zero=2),
    "moe: ep=4 over dp_replicate=4 (experts over replicas, no edp)": dict(model="moe", tp=1, ep=4),
    "moe: ep=2 over dp_replicate=4 (edp=2), zero 1": dict(model="moe", tp=1, ep=2, zero=1),
    "moe: ep=4 over tp=2 x dp_replicate=2, zero 1": dict(model="moe", tp=2, ep=4, zero=1),
    "llama: pp=2 x dp_shard=2 (FSDP2), gpipe, 3 microbatches": dict(
        tp=1, pp=2, dp_shard=2, microbatches=3, batch_size=6, schedule="gpipe"
    ),
    "llama: pp=2 x dp=2, interleaved-1f1b on 2 chunks per rank": dict(
        tp=1, pp=2, microbatches=2, schedule="interleaved-1f1b", virtual_stages=2, layers=4
    ),
    "llama: pp=2 x dp=2, zbv (the V's turn on the last rank is local)": dict(
        tp=1, pp=2, microbatches=2, schedule="zbv", virtual_stages=2, layers=4
    ),
    "llama: pp=2 x dp=2, looped-bfs on 2 chunks per rank": dict(
        tp=1, pp=2, microbatches=2, schedule="looped-bfs", virtual_stages=2, layers=4
    ),
    "llama: pp=2 x dp=2, zb-h1": dict(tp=1, pp=2, microbatches=2, schedule="zb-h1"),
    "llama: pp=2 x dp_shard=2 (FSDP2), dualpipev, 4 microbatches": dict(
        tp=1, pp=2, dp_shard=2, microbatches=4, batch_size=8, schedule="dualpipev", virtual_stages=2, layers=4
    ),
    "llama: pp=2 x dp_shard=2 (FSDP2), zbv": dict(
        tp=1, pp=2, dp_shard=2, microbatches=2, schedule="zbv", virtual_stages=2, layers=4
    ),
    "llama: pp=2 x dp_shard=2 (FSDP2), interleaved-1f1b, 4 microbatches": dict(
        tp=1, pp=2, dp_shard=2, microbatches=4, batch_size=8, schedule="interleaved-1f1b", virtual_stages=2, layers=4
    ),
    "llama: pp=4, zbv (middle stages: both chunks talk)": dict(
        tp=1, pp=4, microbatches=4, batch_size=8, schedule="zbv", virtual_stages=2, layers=8
    ),
}


# Quick tier (issue 32, item 4): one layout per rule family of the planner (tp with SP and loss
# parallel, Ulysses x ring, packed documents, HSDP with accumulation, FSDP2 under a pipeline,
# experts over edp, MLA's shared experts, uneven pp_tp stages, SP blocks crossing chunked stages,
# a V schedule, pp=4's middle stages); the other 42 compose the same rules (about 0.9 s each at load 40).
LEDGER_QUICK = (
    "qwen3: bfloat16, cp_ring=2 x tp=2 (SP), loss parallel",
    "llama: USP cp_ring=2 x cp_ulysses=2",
    "llama: packed documents, dp=2 x tp=2 (SP)",
    "llama: HSDP dp_replicate=2 x dp_shard=2, 2 accumulated microbatches",
    "llama: pp=2 x dp_shard=2 (FSDP2), 1f1b",
    "moe: HSDP dp_replicate=2 x dp_shard=2, ep=2, 2 accumulated microbatches (experts over edp)",
    "mla: tp=2 (SP) x dp=2, ep=2, shared experts gather",
    "llama: pp_tp=1,2,1, 3 microbatches (broadcast both ways)",
    "llama: pp=2 x tp=2 (SP), interleaved-1f1b v2 (sequence blocks cross every chunk boundary)",
    "llama: pp=2 x dp_shard=2 (FSDP2), dualpipev, 4 microbatches",
    "llama: dp=4, zero 2, 24858 parameters (bucket padded to 24860)",
    "moe: ep=2 borrowed from tp=2 x dp=2, zero 2 (experts over edp)",
    "llama: pp=4, zbv (middle stages: both chunks talk)",
)


@pytest.mark.world(4, timeout=120)
@pytest.mark.parametrize("overrides", tiered(LAYOUTS_4, LEDGER_QUICK))
def test_plan_equals_ledger(overrides):
    check(overrides)


LAYOUTS_8 = {
    "llama: dp=2 x pp=2 x tp=2 (SP)": dict(pp=2, tp=2, microbatches=2, batch_size=8),
    "qwen2: pp=2 x cp_ring=2 x tp=2": dict(model="qwen2", pp=2, cp_ring=2, tp=2, microbatches=2, seq_len=32),
    "llama: pp=4 x dp_shard=2 (FSDP2), zbv (middle stages: both chunks talk, no root group)": dict(
        tp=1, pp=4, dp_shard=2, microbatches=4, batch_size=8, schedule="zbv", virtual_stages=2, layers=8
    ),
}


# Slow tier only: an 8-rank world costs its worker about 10 core-s to start, for its one or two
# quick cases (issue 32: the quick tier under 3 minutes). The quick tier takes the middle stages
# of pp=4 on 4 ranks ("llama: pp=4, zbv" above); rank_stage past rank 3 and the compositions of
# pp, tp, ring and dp below are the slow tier's.
@pytest.mark.slow
@pytest.mark.world(8, timeout=240)
@pytest.mark.parametrize("overrides", list(LAYOUTS_8.values()), ids=list(LAYOUTS_8))
def test_plan_equals_ledger_8_ranks(overrides):
    check(overrides)
