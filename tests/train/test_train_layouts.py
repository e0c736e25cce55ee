"""The composed trainer: every layout it accepts matches one-process training (``--verify``).

Each case runs :func:`shardkit.train.run.train` (the same code ``shardkit train`` runs on every
rank) inside a persistent gloo world, in float64, and checks on rank 0 that every step's loss,
every step's global gradient norm (the one clipping uses) and every final parameter equal those of
the same trainer with every degree 1 (float64: relative 1e-9; the measured differences are
~1e-15). The cases cover every pair of axes, several triples, every model family, packed
documents, FSDP2 and HSDP, expert parallelism independent of tp, and conv-ae spatial x dp and
H x W tiles. Each run's ledger names a mesh axis for every collective, and only axes the layout has.

The quick tier (``-m "not slow"``) keeps one case of each distinct path (the ``QUICK`` tuples,
each with its reason); the rest of each matrix is marked ``slow`` and runs in CI.
"""

import time
from pathlib import Path

import pytest
import torch

from harness.helpers import SMALL_CORPUS, rank, world_size
from harness.tiers import tiered
from shardkit.sharding import AXES, FLAT_VIEWS
from shardkit.train.config import TrainConfig, validate_config
from shardkit.train.run import train

# One 90 KB file of text, not the default corpus (the stdlib: 31 MB read by rank 0 and broadcast
# to every rank, a third of a small run's CPU); the packed cases keep the stdlib's documents.
CORPUS = SMALL_CORPUS
SMALL = dict(steps=2, seq_len=16, batch_size=4, dtype="float64", verify=True, layers=2, lr=1e-3, data=CORPUS)


def _train(**overrides) -> dict | None:
    cfg = validate_config(TrainConfig(**{**SMALL, **overrides}), world_size=world_size())
    return train(cfg, "gloo", torch.device("cpu"), time.perf_counter(), progress=False)


def _check(result: dict | None) -> None:
    if rank() != 0:
        assert result is None
        return
    parity = result["parity"]
    assert parity["passed"], parity
    assert parity["tolerance"] == 1e-9 and parity["max_param_rel_diff"] <= 1e-9
    assert len(result["losses"]) == SMALL["steps"] and len(result["grad_norms"]) == SMALL["steps"]
    # the global gradient norm clipping sees is the single-process norm (float64: rounding level)
    for a, b in zip(result["grad_norms"], result["reference_grad_norms"]):
        assert abs(a - b) <= 1e-12 * b
    # the ledger by axis: every collective ran on a group of the layout's own mesh
    layout = result["layout"]
    allowed = (
        {a for a in AXES if layout[a] > 1}
        | set(FLAT_VIEWS)
        | {"world"}
        | ({"ep", "edp"} if layout["ep"] > 1 else set())
        | ({"tp"} if layout["pp_tp"] else set())
    )
    axes = {row["axis"] for row in result["ledger"]}
    assert axes <= allowed, (sorted(axes - allowed), layout["parallel"])
    # ... and every axis of the layout paid for something (FSDP2's gathers included), on its own
    # group or on a flattened view that contains it
    covered = axes | {a for view in axes for a in FLAT_VIEWS.get(view, ())}
    silent = [a for a in AXES if layout[a] > 1 and a not in covered]
    assert not silent, (silent, layout["parallel"], sorted(axes))


LAYOUTS_4 = {
    "dp_replicate=2 x tp=2 (SP)": dict(),
    "dp_shard=4 (FSDP2)": dict(tp=1, dp_shard=4),
    "dp_replicate=2 x dp_shard=2 (HSDP)": dict(tp=1, dp_shard=2),
    "qwen3: dp_shard=2 x tp=2": dict(model="qwen3", dp_shard=2),
    "qwen2: cp_ring=2 x tp=2": dict(model="qwen2", cp_ring=2, tp=2),
    "llama: cp_ulysses=2 x dp_shard=2": dict(cp_ulysses=2, dp_shard=2),
    "llama: USP cp_ring=2 x cp_ulysses=2, packed": dict(
        cp_ring=2, cp_ulysses=2, packed=True, batch_size=1, seq_len=64, data=None
    ),
    "llama: dp=4, 2 accumulated microbatches": dict(tp=1, microbatches=2, batch_size=8),
    "llama: pp=2 x dp=2, 1f1b": dict(pp=2, microbatches=2),
    "moe: ep=2 borrowed from tp=2 x dp=2": dict(model="moe", ep=2),
    "moe: ep=4 over dp_shard=2 x tp=2": dict(model="moe", ep=4, dp_shard=2),
    "mla: tp=2 x dp=2, ep=2, loss parallel": dict(model="mla", ep=2, loss_parallel=True),
    "qwen3: tp=4, loss parallel": dict(model="qwen3", tp=4, loss_parallel=True),
    "llama: packed, dp=2 x tp=2 (no cp)": dict(packed=True, seq_len=64, data=None),
    "conv-ae: spatial=2 x dp=2": dict(model="conv-ae", spatial=2, batch_size=4, seq_len=2),
    "conv-ae: spatial_h=2 x spatial=2 (H x W tiles)": dict(model="conv-ae", spatial_h=2, spatial=2, batch_size=2),
    "llama: pp_tp=2,1,1": dict(pp_tp="2,1,1", layers=3),
    "llama: pp=2 x tp=2 (SP)": dict(pp=2, tp=2, microbatches=2),
    "qwen2: pp=2 x cp_ring=2": dict(model="qwen2", pp=2, cp_ring=2, microbatches=2, seq_len=32),
    "llama: pp=2 x tp=2, loss parallel, gpipe": dict(pp=2, tp=2, loss_parallel=True, schedule="gpipe", microbatches=2),
    "moe: pp=2 x dp_shard=2": dict(model="moe", pp=2, dp_shard=2, microbatches=2),
    "llama: cp_ulysses=2 x tp=2 (SP)": dict(cp_ulysses=2, tp=2),
    "mla: tp=2 (SP, tensor-parallel experts) x dp_shard=2": dict(model="mla", sequence_parallel=True, dp_shard=2),
    "moe: tp=2 (SP) x dp=2, ep=2": dict(model="moe", ep=2, sequence_parallel=True),
    "mla: tp=2 (SP) x dp_shard=2, ep=4 (shared experts)": dict(model="mla", ep=4, dp_shard=2, sequence_parallel=True),
    "moe: dp_shard=4, ep=2 (experts FSDP2 over edp=2)": dict(model="moe", tp=1, dp_shard=4, ep=2),
    "moe: HSDP dp_replicate=2 x dp_shard=2, ep=2 (experts FSDP2 over edp=2)": dict(model="moe", tp=1, dp_shard=2, ep=2),
    "moe: dp_shard=4, ep=2 (experts over edp), 2 accumulated microbatches": dict(
        model="moe", tp=1, dp_shard=4, ep=2, microbatches=2, batch_size=8
    ),
}


# Quick tier: one case per distinct path of the trainer. The default layout (tp + SP beside
# dp_replicate); HSDP (FSDP2 on a 2-D mesh); each model family with its own axis (qwen3 FSDP2 x
# tp, qwen2 ring cp, mla ep with loss parallel, moe ep borrowed from tp); USP (Ulysses and ring
# together, packed documents); packed documents without cp (the in-rank document mask);
# accumulation; a pipeline (tp and the last stage's vocab-parallel loss); pp_tp; conv-ae's W
# strips and H x W tiles. The experts' FSDP2 over edp stays quick in
# test_experts_fsdp2_sharded_over_edp below.
QUICK_4 = (
    "dp_replicate=2 x tp=2 (SP)",
    "dp_replicate=2 x dp_shard=2 (HSDP)",
    "qwen3: dp_shard=2 x tp=2",
    "qwen2: cp_ring=2 x tp=2",
    "llama: USP cp_ring=2 x cp_ulysses=2, packed",
    "llama: packed, dp=2 x tp=2 (no cp)",
    "llama: dp=4, 2 accumulated microbatches",
    "llama: pp=2 x tp=2, loss parallel, gpipe",
    "llama: pp_tp=2,1,1",
    "moe: ep=2 borrowed from tp=2 x dp=2",
    "mla: tp=2 x dp=2, ep=2, loss parallel",
    "conv-ae: spatial=2 x dp=2",
    "conv-ae: spatial_h=2 x spatial=2 (H x W tiles)",
)


@pytest.mark.world(4, timeout=120)
@pytest.mark.parametrize("overrides", tiered(LAYOUTS_4, QUICK_4))
def test_layout_matches_one_process(overrides):
    _check(_train(**overrides))


@pytest.mark.world(4, timeout=120)
def test_experts_fsdp2_sharded_over_edp():
    # dp_shard=2 x tp=2, ep=2: ep is the tp pair, edp the dp_shard pair; FSDP2 all-gathers and
    # reduce-scatters the expert weights on the edp group, and nothing reduces them otherwise
    result = _train(model="moe", dp_shard=2, ep=2)
    _check(result)
    if rank() != 0:
        return
    edp = {(row["op"], row["api"]) for row in result["ledger"] if row["axis"] == "edp"}
    assert edp == {("all_gather_single", "fully_shard"), ("reduce_scatter_single", "fully_shard")}, edp


LAYOUTS_8 = {
    "llama: dp_replicate=2 x cp_ring=2 x tp=2": dict(cp_ring=2, tp=2, seq_len=32),
    "qwen2: dp_shard=2 x cp_ulysses=2 x tp=2 (FSDP2)": dict(model="qwen2", dp_shard=2, cp_ulysses=2, tp=2),
    "llama: HSDP dp_replicate=2 x dp_shard=2 x tp=2 (SP)": dict(dp_shard=2),
    "llama: dp=2 x pp=2 x tp=2 (SP)": dict(pp=2, tp=2, microbatches=2),
    "qwen3: pp=2 x cp_ring=2 x tp=2": dict(model="qwen3", pp=2, cp_ring=2, tp=2, microbatches=2, seq_len=32),
    "moe: dp_shard=2 x cp_ring=2 x tp=2, ep=8 over all of them": dict(
        model="moe", dp_shard=2, cp_ring=2, tp=2, ep=8, seq_len=32
    ),
    "conv-ae: dp_shard=2 x H x W tiles 2x2": dict(model="conv-ae", dp_shard=2, spatial_h=2, spatial=2, batch_size=4),
    "moe: pp=2 x dp_shard=4, ep=2 (experts FSDP2 over edp=2)": dict(
        model="moe", pp=2, tp=1, dp_shard=4, ep=2, microbatches=2
    ),
}


# Slow tier only: an 8-rank world costs its worker about 10 core-s to start, for one quick case
# (issue 32: the quick tier under 3 minutes). Three axes at once with a pipeline among them
# (stage groups cut out of a 3-D mesh) is the slow tier's; the 4-rank quick cases above cover
# each axis, and pp x tp the stage groups of a 2-D mesh.
@pytest.mark.slow
@pytest.mark.world(8, timeout=240)
@pytest.mark.parametrize("overrides", list(LAYOUTS_8.values()), ids=list(LAYOUTS_8))
def test_layout_matches_one_process_8_ranks(overrides):
    _check(_train(**{"batch_size": 8, **overrides}))


PRETRAINED = {
    "tp=2 (SP) x dp=2": dict(tp=2),
    "pp=2 x dp=2 (tied embeddings across stages)": dict(tp=1, pp=2, microbatches=2),
    "tp=4, 9/3 heads": dict(tp=4, sequence_parallel=False),
}
# Quick tier: the tied embedding split across stages, and 3 KV heads over tp=4 (replicated
# heads); tp=2 x dp=2 adds no path of its own.
QUICK_PRETRAINED = ("pp=2 x dp=2 (tied embeddings across stages)", "tp=4, 9/3 heads")


@pytest.mark.world(4, timeout=240)
@pytest.mark.parametrize("overrides", tiered(PRETRAINED, QUICK_PRETRAINED))
def test_pretrained_checkpoint_matches_one_process(overrides):
    # SmolLM2's shape (9 query / 3 KV heads, tied embeddings) through --model-path, trained on its
    # own tokenizer with the fine-tuning warm-up + cosine schedule.
    from harness.helpers import remove_shared_dir, shared_tmpdir
    from harness.pretrained import save_tiny_llama

    root = shared_tmpdir("shardkit-pretrained-")
    try:
        if rank() == 0:
            save_tiny_llama(Path(root))
        torch.distributed.barrier()
        result = _train(model_path=root, data=SMALL_CORPUS, steps=3, **overrides)
        if rank() == 0:
            parity = result["parity"]
            assert parity["passed"] and parity["tolerance"] == 1e-9, parity
            assert result["layout"]["model"] == "llama" and result["config"]["lr_schedule"] == "warmup-cosine"
            assert len(result["losses"]) == 3
    finally:
        remove_shared_dir(root)


def _apis(**overrides) -> set[tuple[str, str]]:
    """(op, api) of every collective a 1-step run issues (rank 0's ledger, forward and backward)."""
    # 4 key/value heads: tp 4 then holds whole heads (no replicated-head reduction tp 2 lacks)
    result = _train(**{"kv_heads": 4, **overrides, "steps": 1, "verify": False})
    box = [None if result is None else sorted({(r["op"], r["api"]) for r in result["ledger"]})]
    torch.distributed.broadcast_object_list(box, src=0)
    return set(map(tuple, box[0]))


PAIRS = {  # (pair, first axis alone, second axis alone), all on 4 ranks
    "tp x dp": (dict(tp=2, dp=2), dict(tp=4), dict(tp=1, dp=4)),
    "cp_ring x tp": (dict(cp_ring=2, tp=2, seq_len=32), dict(cp_ring=4, tp=1, seq_len=32), dict(tp=4)),
    "cp_ring x dp": (dict(cp_ring=2, tp=1, dp=2, seq_len=32), dict(cp_ring=4, tp=1, seq_len=32), dict(tp=1, dp=4)),
    "pp x dp": (dict(pp=2, tp=1, dp=2, microbatches=2), dict(pp=4, tp=1, layers=4, microbatches=2), dict(tp=1, dp=4)),
    "pp x tp": (dict(pp=2, tp=2, microbatches=2), dict(pp=4, tp=1, layers=4, microbatches=2), dict(tp=4)),
}


# Quick tier: a pipeline pair (p2p beside tp's collectives) and a ring pair (cp's p2p beside dp's
# gradient all-reduce); the other pairs compose the same kinds of collective.
QUICK_PAIRS = ("pp x tp", "cp_ring x dp")


@pytest.mark.world(4, timeout=240)
@pytest.mark.parametrize("pair,first,second", tiered(PAIRS, QUICK_PAIRS))
def test_composed_ledger_is_the_union_of_its_axes(pair, first, second):
    # Composition adds no collective of its own: a pair of axes issues exactly the (op, api)
    # kinds its two axes issue alone (group sizes differ, the kinds do not), save the kinds that
    # only a pipeline's last stage issues, which rank 0 (the first stage, whose ledger this is)
    # never does.
    both, a, b = _apis(**pair), _apis(**first), _apis(**second)
    assert both <= a | b, sorted(both - (a | b))
    last_only = LAST_STAGE_ONLY if pair.get("pp", 1) > 1 and pair.get("tp", 1) > 1 else set()
    assert (a | b) - both <= last_only, sorted((a | b) - both)


# The logits' gather (tp without loss parallelism): with sequence parallelism a stage boundary
# carries each tp rank's sequence block, so the first stage gathers nothing; the head does.
LAST_STAGE_ONLY = {("all_gather_single", "gather_forward_split_backward")}
