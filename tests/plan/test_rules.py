"""One home for the layout rules: the trainer's validation and the planner agree on every layout.

The same layouts (valid and invalid) go through ``shardkit train``'s :func:`validate_config`
and the planner's :func:`check_layout`; both must accept or both refuse. The layouts where the
planner used to be stricter than the trainer (uneven sequence over cp, tp not dividing the
vocabulary, the KV heads, the heads per Ulysses rank or the experts) are among them, and three train
with ``--verify`` parity here, so the common verdict is the trainer's real one.
"""

import time

import pytest
import torch

from harness.helpers import SMALL_CORPUS, rank, world_size
from shardkit import ParallelDims, ShardkitError
from shardkit.plan import ModelShape, StepOptions
from shardkit.plan.options import check_layout
from shardkit.plan.rules import cp_tokens_rule, decoder_layout_rule, stage_heads_rule
from shardkit.train.config import TrainConfig, parse_pp_tp, validate_config
from shardkit.train.run import train
from shardkit.train.specs import model_spec

CORPUS = SMALL_CORPUS
BASE = dict(seq_len=16, batch_size=8, layers=2, dtype="float32")
# (overrides, the trainer runs it): the verdicts both sides must give
LAYOUTS = [
    (dict(tp=2), True),
    (dict(tp=3, nproc=3, heads=6, kv_heads=2, hidden_size=96), True),  # 256 vocab, 2 KV heads over 3 ranks: uneven
    (dict(tp=8, nproc=8), False),  # 4 query heads over 8 ranks
    (dict(tp=4, heads=6, kv_heads=2, hidden_size=96), True),  # 6 heads over 4 ranks: balanced
    (dict(tp=1, cp_ring=2, seq_len=17), True),  # uneven zigzag parts
    (dict(tp=1, cp_ring=4, seq_len=3), False),  # a cp rank without a token
    (dict(tp=1, cp_ulysses=4), True),  # 2 KV heads over 4 Ulysses ranks
    (dict(tp=1, cp_ulysses=4, seq_len=3), False),
    (dict(tp=2, cp_ring=2, heads=6, kv_heads=2, hidden_size=96), True),
    (dict(tp=4, cp_ring=2, heads=6, kv_heads=2, hidden_size=96), False),  # cp: tp must divide the heads
    (dict(tp=1, pp=2), True),
    (dict(tp=1, pp=4), False),  # 2 layers, 4 stages
    (dict(tp=2, ep=2), False),  # a dense model
    (dict(model="moe", tp=2, ep=2), True),
    (dict(model="moe", tp=2, ep=2, experts=3), True),  # 3 experts over 2 ep ranks: balanced
    (dict(tp=2, batch_size=5, nproc=4), False),  # 5 rows over dp=2
    (dict(tp=1, batch_size=8, microbatches=3, nproc=2), False),
    (dict(pp_tp="2,1", sequence_parallel=True, layers=3), False),
    (dict(pp_tp="2,1,1", layers=3), True),
    (dict(tp=2, seq_len=1), False),
    (dict(tp=2, sequence_parallel=True, seq_len=3), True),  # 3 tokens over 2 SP ranks: uneven
]


def _trainer(overrides: dict) -> str | None:
    try:
        validate_config(TrainConfig(**{**BASE, **overrides}))
    except ShardkitError as e:
        return str(e)
    return None


def _planner(overrides: dict) -> str | None:
    cfg = TrainConfig(**{**BASE, **overrides})
    family = model_spec(cfg.model).family
    assert family is not None
    try:
        pp_tp = parse_pp_tp(cfg.pp_tp) if cfg.pp_tp else None
        tp = 1 if pp_tp else cfg.tp or 1
        ranks = sum(pp_tp) if pp_tp else cfg.pp * cfg.cp_size * tp
        world = cfg.nproc or max(4, ranks)
        dims = ParallelDims(
            dp_replicate=max(1, world // ranks),
            pp=cfg.pp if not pp_tp else len(pp_tp),
            tp=tp,
            cp_ring=cfg.cp_ring,
            cp_ulysses=cfg.cp_ulysses,
            ep=cfg.ep,
            pp_tp=pp_tp,
            world_size=world,
        )
        opts = StepOptions(cfg.seq_len, cfg.batch_size, cfg.microbatches, cfg.dtype, cfg.sequence_parallel)
        check_layout(ModelShape.from_config(family.config(cfg)), dims, opts)
    except ShardkitError as e:
        return str(e)
    return None


@pytest.mark.parametrize("overrides,runs", LAYOUTS, ids=[str(o) for o, _ in LAYOUTS])
def test_trainer_and_planner_give_the_same_verdict(overrides, runs):
    trainer, planner = _trainer(overrides), _planner(overrides)
    assert (trainer is None) == runs, trainer
    assert (planner is None) == runs, planner


def test_the_rules_name_the_flags_and_sizes():
    assert cp_tokens_rule(17, 2, 1) is None and cp_tokens_rule(16, 1, 1) is None
    assert "smallest ring part has 0 tokens" in cp_tokens_rule(3, 4, 1)
    assert stage_heads_rule(4, 2, 8, 1, "--tp 8") == (
        "--tp 8: 4 query heads cannot be split over tp=8 ranks (whole heads per rank)"
    )
    why = decoder_layout_rule(
        ParallelDims(spatial=2, world_size=2),
        seq_len=16,
        global_batch=2,
        microbatches=1,
        sequence_parallel=False,
        heads=4,
        kv_heads=2,
        layers=2,
        experts=0,
    )
    assert why == "--spatial 2 needs --model conv-ae (language models use --tp/--cp-*/--pp/--dp*)"


@pytest.mark.world(3, timeout=120)
def test_tp_3_over_an_uneven_vocabulary_and_kv_heads_trains_with_parity():
    # 256-token vocabulary (vocab-parallel loss) and 2 KV heads over 3 tp ranks: the planner
    # refused it before its rules were the trainer's
    _check(dict(tp=3, heads=6, kv_heads=2, hidden_size=96, loss_parallel=True))


@pytest.mark.world(4, timeout=120)
def test_uneven_experts_over_ep_train_with_parity():
    # 3 routed experts over ep=2 (2 + 1): the planner asked ep to divide them
    _check(dict(model="moe", tp=2, ep=2, experts=3))


@pytest.mark.world(4, timeout=120)
def test_uneven_zigzag_parts_and_ulysses_heads_train_with_parity():
    # 18 tokens in 4 zigzag chunks (5, 5, 4, 4), each split over 2 Ulysses ranks; 3 KV heads over 2 ranks
    _check(dict(tp=1, cp_ring=2, cp_ulysses=2, seq_len=18, heads=6, kv_heads=3, hidden_size=96, batch_size=1))


def _check(overrides: dict) -> None:
    small = dict(steps=2, seq_len=16, batch_size=4, dtype="float64", verify=True, layers=2, lr=1e-3, data=CORPUS)
    cfg = validate_config(TrainConfig(**{**small, **overrides}), world_size=world_size())
    assert _planner({**overrides, "nproc": world_size()}) is None
    result = train(cfg, "gloo", torch.device("cpu"), time.perf_counter(), progress=False)
    if rank() == 0:
        assert result["parity"]["passed"], result["parity"]
    else:
        assert result is None
