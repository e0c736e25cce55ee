"""``shardkit train --pp P --virtual-stages V --schedule S``: every schedule passes ``--verify``
(float64, 1e-9 against one process) and a save under one schedule resumes under another.

Fast tier: pp 2 on 2 ranks (one looped, one zero-bubble, one V schedule with chunks).
Slow tier (``-m slow``): every schedule at pp 2 (4 ranks, with FSDP2 and AC; composed with tp,
cp and ep) and at pp 4 x dp 2 (8 ranks).
"""

import time
from pathlib import Path

import pytest
import torch

from harness.helpers import SMALL_CORPUS, rank, remove_shared_dir, shared_tmpdir, world_size
from shardkit.errors import ShardkitError
from shardkit.pipeline_parallel.tables import SCHEDULES as TABLES
from shardkit.train.checkpoint_dir import check_checkpoint_dir
from shardkit.train.config import TrainConfig, validate_config
from shardkit.train.options import SCHEDULES
from shardkit.train.run import train

CORPUS = SMALL_CORPUS
SMALL = dict(steps=2, seq_len=16, batch_size=4, dtype="float64", verify=True, layers=4, lr=1e-3, tp=1, data=CORPUS)
V = {"1f1b": 1, "gpipe": 1, "interleaved-1f1b": 2, "looped-bfs": 2, "zb-h1": 1, "zbv": 2, "interleaved-zb": 2}
V["dualpipev"] = 2


def _train(**overrides) -> dict | None:
    cfg = validate_config(TrainConfig(**{**SMALL, **overrides}), world_size=world_size())
    return train(cfg, "gloo", torch.device("cpu"), time.perf_counter(), progress=False)


def _verified(result) -> bool:
    if rank() != 0:
        return result is None
    parity = result["parity"]
    return parity["passed"] and parity["max_param_rel_diff"] <= 1e-9


def _run_schedule(name: str, pp: int, **kw) -> None:
    """``--verify`` of ``name`` at ``pp`` (chunks per rank: the schedule's own v), on this world."""
    m = 2 * pp if name == "dualpipev" else pp  # dualpipev needs m >= 2 pp; interleaved m % pp == 0
    result = _train(pp=pp, schedule=name, virtual_stages=V[name], microbatches=m, batch_size=2 * m, **kw)
    assert _verified(result), result and result["parity"]
    if rank() == 0:
        assert result["layout"]["schedule"] == name and result["layout"]["virtual_stages"] == V[name]


def test_trainer_offers_every_schedule_of_the_registry():
    assert tuple(SCHEDULES) == tuple(TABLES)


@pytest.mark.world(2, timeout=180)
@pytest.mark.parametrize("name", ["interleaved-1f1b", "zb-h1", "zbv", "interleaved-zb"])
def test_schedule_verifies_at_pp2(name):
    _run_schedule(name, 2)


@pytest.mark.world(2, timeout=180)
def test_zero_bubble_verifies_with_selective_ac():
    """--ac selective under an I/W split: each block recomputes at I and again at W; the second
    recompute gets the kept outputs from the first (torch's SAC hands them back once)."""
    _run_schedule("zbv", 2, ac="selective")


@pytest.mark.world(2, timeout=180)
def test_zero_bubble_verifies_under_checks():
    """--checks runs a V table with its I/W split: every message's header read and judged, the
    table agreed at every step (no hellos: the agreed table fixes both ends of each message)."""
    _run_schedule("zbv", 2, checks=True)


@pytest.mark.world(4, timeout=240)
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pp_tp_stages_verify_under_checks(schedule):
    """--pp-tp 2,1,1 on the one runner under --checks: every boundary reshard carries its header,
    judged on the receiving stage, and the table is agreed at every step."""
    result = _train(pp_tp="2,1,1", tp=None, layers=3, schedule=schedule, microbatches=3, batch_size=3, checks=True)
    assert _verified(result), result and result["parity"]


@pytest.mark.world(4, timeout=240)
@pytest.mark.parametrize("schedule", ["zb-h1", "looped-bfs"])
def test_pp_tp_stages_verify_every_one_chunk_schedule(schedule):
    """--pp-tp 2,1,1 (stages of tp 2, 1 and 1) under the one-chunk schedules beyond 1F1B/GPipe:
    ZB-H1's I/W split through a tp-2 stage's regions and each boundary reshard, looped BFS at
    v = 1; --verify against one process (float64, 1e-9)."""
    result = _train(pp_tp="2,1,1", tp=None, layers=3, schedule=schedule, microbatches=3, batch_size=3)
    assert _verified(result), result and result["parity"]
    if rank() == 0:
        assert result["layout"]["schedule"] == schedule


# No "every schedule at pp 2 x dp 2" matrix: each schedule at pp 2 is verified below (with FSDP2
# and AC, composed with tp / cp / ep, and alone on 2 ranks), and beside a plain dp_replicate at
# pp 4 x dp 2; such a matrix repeated those two paths (issue 32, item 4).


@pytest.mark.slow
@pytest.mark.world(4, timeout=300)
@pytest.mark.parametrize("name", list(V))
def test_every_schedule_verifies_with_fsdp2_and_activation_checkpointing(name):
    """pp=2 x dp_shard=2 (FSDP2: each group gathered once, reduced after its last B or W) with
    --ac full on the one-chunk schedules and --ac selective on the chunked ones."""
    _run_schedule(name, 2, dp_shard=2, ac="full" if V[name] == 1 else "selective")


COMPOSED = {
    "zbv: pp=2 x tp=2 (SP)": dict(name="zbv", tp=2),
    "zb-h1: pp=2 x tp=2, loss parallel": dict(name="zb-h1", tp=2, loss_parallel=True),
    "dualpipev: pp=2 x tp=2 (SP), loss parallel": dict(name="dualpipev", tp=2, loss_parallel=True),
    "interleaved-1f1b: qwen3 pp=2 x tp=2 (SP)": dict(name="interleaved-1f1b", model="qwen3", tp=2),
    "interleaved-1f1b: pp=2 x dp_shard=2 (FSDP2)": dict(name="interleaved-1f1b", dp_shard=2),
    "dualpipev: qwen2 pp=2 x cp_ring=2": dict(name="dualpipev", model="qwen2", cp_ring=2, seq_len=32),
    "looped-bfs: moe pp=2 x dp_shard=2, ep=2": dict(name="looped-bfs", model="moe", dp_shard=2, ep=2),
    "zbv: pp=2 x dp_shard=2 (FSDP2 reduced after the last W)": dict(name="zbv", dp_shard=2),
    "dualpipev: pp=2 x dp_shard=2 (FSDP2 reduced after the last W)": dict(name="dualpipev", dp_shard=2),
    "zb-h1: pp=2 x dp_shard=2, --ac full (FSDP2, I/W split, recomputed twice)": dict(
        name="zb-h1", dp_shard=2, ac="full"
    ),
    "zbv: pp=2 x dp_shard=2, --ac selective (FSDP2 gathered until the last W's recompute)": dict(
        name="zbv", dp_shard=2, ac="selective"
    ),
    "zbv: pp=2 x tp=2 (SP), --ac selective (recomputed at I and again at W, collectives replayed)": dict(
        name="zbv", tp=2, ac="selective"
    ),
    "zb-h1: moe pp=2 x tp=2, ep=2 (I/W split)": dict(name="zb-h1", model="moe", tp=2, ep=2),
    "zbv: qwen2 pp=2 x cp_ring=2 (I/W split)": dict(name="zbv", model="qwen2", cp_ring=2, seq_len=32),
    "zbv: pp=2 x cp_ulysses=2 (I/W split)": dict(name="zbv", cp_ulysses=2),
    "zb-h1: pp=2 x dp=2, --ac full (I/W split)": dict(name="zb-h1", ac="full"),
    "interleaved-1f1b: pp=2 x dp=2, --ac full": dict(name="interleaved-1f1b", ac="full"),
}


@pytest.mark.slow
@pytest.mark.world(4, timeout=300)
@pytest.mark.parametrize("overrides", list(COMPOSED.values()), ids=list(COMPOSED))
def test_chunked_schedules_compose_with_tp_fsdp_cp_ep(overrides):
    _run_schedule(**overrides, pp=2)


@pytest.mark.slow
@pytest.mark.world(8, timeout=600)
@pytest.mark.parametrize("name", list(V))
def test_every_schedule_verifies_at_pp4_x_dp2(name):
    _run_schedule(name, 4, layers=8)


@pytest.mark.slow
@pytest.mark.world(4, timeout=300)
@pytest.mark.parametrize("name", ["interleaved-1f1b", "zbv"])
def test_tied_embeddings_on_chunks(name):
    """A tied checkpoint (SmolLM2's shape): looped chunks keep the two copies on ranks 0 and p - 1
    (their gradients summed), the V places both on rank 0 (one parameter)."""
    from harness.pretrained import save_tiny_llama

    root = shared_tmpdir("sched-tied")
    try:
        if rank() == 0:
            save_tiny_llama(Path(root), num_hidden_layers=4)
        torch.distributed.barrier()
        data = SMALL_CORPUS
        _run_schedule(name, 2, model_path=root, data=data)
    finally:
        remove_shared_dir(root)


@pytest.mark.world(2, timeout=240)
def test_save_under_1f1b_resumes_under_interleaved_with_the_same_losses():
    """4 steps under 1f1b; 2 steps saved under 1f1b, then resumed under interleaved-1f1b on 2
    chunks per rank (the chunks re-cut the layers): the same losses (float64, 1e-12)."""
    root = shared_tmpdir("sched-resume")
    try:
        base = dict(pp=2, microbatches=2, batch_size=4, verify=False)
        whole = _train(**base, steps=4)
        cfg = validate_config(TrainConfig(**{**SMALL, **base, "steps": 2, "checkpoint_dir": root}), world_size=2)
        check_checkpoint_dir(cfg)
        train(cfg, "gloo", torch.device("cpu"), time.perf_counter(), progress=False)
        again = dict(schedule="interleaved-1f1b", virtual_stages=2, checkpoint_dir=root, resume=True)
        resumed = _train(**base, steps=4, **again)
        if rank() == 0:
            a, b = whole["losses"], resumed["losses"]
            assert resumed["first_step"] == 2 and len(b) == 2, resumed.get("first_step")
            assert all(abs(x - y) <= 1e-12 * abs(x) for x, y in zip(a[2:], b)), (a, b)
    finally:
        remove_shared_dir(root)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            dict(pp=2, schedule="zbv", virtual_stages=1, microbatches=2),
            "--schedule zbv needs --virtual-stages 2, got 1",
        ),
        (
            dict(pp=2, schedule="interleaved-1f1b", virtual_stages=2, microbatches=3, batch_size=6),
            "microbatches must be a multiple of pp",
        ),
        (dict(pp=2, schedule="dualpipev", virtual_stages=2, microbatches=2), "microbatches must be >= 2 x pp = 4"),
        (dict(pp=2, schedule="1f1b", virtual_stages=2, microbatches=2), "needs --virtual-stages 1, got 2"),
        (dict(pp=1, schedule="zbv", virtual_stages=2), "need a pipeline"),
        (
            dict(pp_tp="2,1", tp=None, schedule="interleaved-1f1b", virtual_stages=2, microbatches=2),
            "--pp-tp stages hold one chunk each",
        ),
        (dict(pp_tp="2,1", tp=None, schedule="zbv", virtual_stages=2, microbatches=2), "hold one chunk each"),
        (dict(pp=2, schedule="looped-bfs", virtual_stages=3, microbatches=2, layers=4), "cannot fill 6 chunks"),
    ],
)
def test_combinations_that_cannot_work_are_refused_naming_the_limit(overrides, message):
    with pytest.raises(ShardkitError, match=message):
        validate_config(TrainConfig(**{**SMALL, **overrides}), world_size=4)


def test_selective_checkpointing_alone_allows_one_backward_per_region():
    """Why shardkit's selective recompute keeps its own copy of the kept outputs
    (``parallelize.checkpointing._KeptOutputs``): after ``I`` (a backward to the input that keeps
    the graph), ``W``'s pass to the weights recomputes the checkpointed region again, and torch's
    selective checkpointing alone refuses a second backward through one region. Fails (and the
    copy can go) once torch allows it."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    def keep_matmuls(ctx, func, *args, **kwargs):
        saved = func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE

    lin = torch.nn.Linear(3, 3, dtype=torch.float64)
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    contexts = functools.partial(create_selective_checkpoint_contexts, keep_matmuls)
    y = checkpoint(lambda t: torch.tanh(lin(torch.tanh(lin(t)))), x, use_reentrant=False, context_fn=contexts)
    torch.autograd.grad(y.sum(), x, retain_graph=True)  # I
    with pytest.raises(RuntimeError, match="backward an extra time"):
        torch.autograd.grad(y.sum(), list(lin.parameters()))  # W
