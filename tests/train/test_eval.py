"""Validation (``--eval-every N --eval-batches K``): a held-out tail of the corpus, never trained
on, and its loss through the training loss path of the layout, equal to one process's."""

import dataclasses
import json
import os
import time

import pytest
import torch

from harness.helpers import SMALL_CORPUS, rank, remove_shared_dir, shared_tmpdir, world_size
from harness.tiers import tiered
from shardkit import ShardkitError
from shardkit.train.config import TrainConfig, validate_config
from shardkit.train.corpus import Corpus
from shardkit.train.data import HeldOutBatches, held_out_start
from shardkit.train.lm_spec import lm_task
from shardkit.train.run import train

CORPUS = SMALL_CORPUS


def test_the_held_out_tail_is_never_trained_on():
    tokens = torch.arange(200, dtype=torch.int64) % 256
    cfg = validate_config(TrainConfig(seq_len=8, batch_size=4, eval_every=2, eval_batches=3, packed=True), 4)
    task = lm_task(cfg, torch.device("cpu"), Corpus(tokens, (150, 50)))
    assert held_out_start(200, 8) == 180 and torch.equal(task.sampler.tokens, tokens[:180])
    assert task.sampler.starts.tolist() == [150]  # the documents cut at the split
    batches = task.held_out.batches()
    assert len(batches) == 3 and all(b.shape == (4, 8) for b in batches)
    starts = torch.cat(batches)[:, 0]
    assert starts.min() == 180 and starts.max() == 200 - 8  # spread over the tail, first to last window
    assert all(torch.equal(a, b) for a, b in zip(batches, task.held_out.batches()))  # the same every time
    for _ in range(20):  # training windows end before the tail
        assert int(task.next_batch()[0].max()) < 180
    plain = lm_task(validate_config(TrainConfig(seq_len=8, batch_size=4), 4), torch.device("cpu"), Corpus(tokens))
    assert plain.held_out is None and plain.sampler.tokens.numel() == 200


def test_held_out_limits_are_refused():
    with pytest.raises(ShardkitError, match="--eval-every: the corpus has 15 tokens; holding out 8"):
        held_out_start(15, 8)
    assert HeldOutBatches(torch.arange(8), 8, 2, 1).batches()[0].tolist() == [list(range(8))] * 2
    for kw, match in (
        (dict(eval_every=-1), "--eval-every must be >= 0"),
        (dict(eval_every=2, eval_batches=0), "--eval-batches >= 1"),
        (dict(eval_every=2, model="conv-ae", spatial=2, tp=1), "--model conv-ae trains on no text corpus"),
    ):
        with pytest.raises(ShardkitError, match=match):
            validate_config(TrainConfig(**kw), 4)


LAYOUTS = {
    "tp=2 (sequence parallel)": dict(),
    "pp=2, 2 microbatches (the forward-only table)": dict(tp=1, pp=2, microbatches=2),
    "pp=2, zbv (forward-only table of an I/W schedule)": dict(
        tp=1, pp=2, microbatches=4, schedule="zbv", virtual_stages=2, layers=4
    ),
    "dp_shard=2 (FSDP2)": dict(tp=1, dp_shard=2),
    "cp_ring=2": dict(tp=1, cp_ring=2),
    "tp=2, vocab-parallel loss, selective AC": dict(loss_parallel=True, ac="selective"),
    "moe ep=2 over dp_shard=2": dict(model="moe", tp=1, dp_shard=2, ep=2),
}


# Quick tier: one case per path of the held-out loss: tp's sequence-parallel forward, a
# pipeline's forward-only table, the ring's sharded held-out batch, the vocab-parallel loss under
# AC, and the MoE layers (no balancing update while evaluating). The zbv table runs the same
# forward-only runner as 1f1b's; FSDP2's gathers outside training stay quick in
# test_eval_of_fsdp2_pipeline_stages_equals_one_process below.
QUICK = (
    "tp=2 (sequence parallel)",
    "pp=2, 2 microbatches (the forward-only table)",
    "cp_ring=2",
    "tp=2, vocab-parallel loss, selective AC",
    "moe ep=2 over dp_shard=2",
)


@pytest.mark.world(2, timeout=180)
@pytest.mark.parametrize("layout", tiered(LAYOUTS, QUICK))
def test_eval_loss_at_the_right_steps_equals_one_process(layout):
    """Against the --verify reference in float64: the same held-out loss after steps 2, 4 and the
    last (5), in the result and in metrics.jsonl; training itself unchanged (parity passes)."""
    _eval_equals_one_process(layout)


@pytest.mark.world(4, timeout=240)
def test_eval_of_fsdp2_pipeline_stages_equals_one_process():
    """pp=2 x dp_shard=2: FSDP2 stages evaluated by the forward-only table between steps."""
    _eval_equals_one_process(dict(tp=1, pp=2, dp_shard=2, microbatches=2))


def _eval_equals_one_process(layout):
    folder = shared_tmpdir("shardkit-eval-")
    try:
        # data: one 90 KB file; the stdlib's 31 MB (the default), read and broadcast, was a third of the CPU
        cfg = TrainConfig(
            seq_len=16, batch_size=4, dtype="float64", steps=5, eval_every=2, eval_batches=2, verify=True, data=CORPUS
        )
        cfg = dataclasses.replace(cfg, report=folder)
        cfg = validate_config(dataclasses.replace(cfg, **layout), world_size=world_size())
        result = train(cfg, "gloo", torch.device("cpu"), time.perf_counter(), progress=False)
        if rank() != 0:
            return
        steps = [s for s, _ in result["eval_losses"]]
        assert steps == [2, 4, 5] == [s for s, _ in result["reference_eval_losses"]]
        for (_, a), (_, b) in zip(result["eval_losses"], result["reference_eval_losses"]):
            assert abs(a - b) <= 1e-10 * abs(b), (result["eval_losses"], result["reference_eval_losses"])
        assert result["eval_losses"][-1][1] != result["eval_losses"][0][1]  # the model trained in between
        with open(os.path.join(folder, "metrics.jsonl")) as f:
            lines = [json.loads(line) for line in f]
        assert [(m["step"], m.get("eval_loss")) for m in lines] == [
            (1, None),
            (2, result["eval_losses"][0][1]),
            (3, None),
            (4, result["eval_losses"][1][1]),
            (5, result["eval_losses"][2][1]),
        ]
        assert result["parity"]["passed"]  # evaluating changed nothing in training
    finally:
        remove_shared_dir(folder)
