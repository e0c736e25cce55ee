"""``shardkit train --mixed-precision bf16``: flags, refusals, and layouts that still match one process.

Each layout runs :func:`shardkit.train.run.train` under ``--verify``: the one-process reference
computes in the same mixed precision (the LM spec passes ``mixed_precision`` with ``mesh=None``
too), so the two runs differ by bf16 rounding order only and are held to bfloat16's tolerance
(:data:`shardkit.train.verify.TOLERANCES`; a missing or doubled reduction is O(1)). The run's
ledger rows (``report.json``'s ``ledger``) then show every parameter-gradient reduction in float32
and every collective moving activations in bfloat16.
"""

import time

import pytest
import torch

from harness.helpers import SMALL_CORPUS, rank, world_size
from harness.tiers import tiered
from shardkit.cli.main import build_parser
from shardkit.cli.train import config_from_args
from shardkit.errors import ShardkitError
from shardkit.train.config import TrainConfig, validate_config
from shardkit.train.run import train

CORPUS = SMALL_CORPUS
SMALL = dict(steps=2, seq_len=16, batch_size=4, layers=2, verify=True, mixed_precision="bf16", data=CORPUS)
LAYOUTS = {
    "dp_replicate=2 x tp=2 (SP)": dict(),
    "cp_ulysses=2 x dp_shard=2 (FSDP2)": dict(tp=1, cp_ulysses=2, dp_shard=2),
    "pp=2 x tp=2 (SP), 1f1b": dict(pp=2, tp=2, microbatches=2),
    "dp_replicate=2 x tp=2 (SP), --ac selective": dict(ac="selective"),
    "moe: ep=2 from tp=2 x dp=2, --ac full": dict(model="moe", ep=2, ac="full"),
    "moe: dp_shard=2 x tp=2, ep=2 (experts FSDP2 over edp), --ac selective": dict(
        model="moe", dp_shard=2, ep=2, ac="selective"
    ),
}
REDUCTIONS = {"dp_cp_grads", "expert_grads", "sum_grad_over", "tp_replicated_heads", "sum_tied_embedding_grads"}


def _is_reduction(row: dict) -> bool:
    return row["api"] in REDUCTIONS or (
        row["api"] == "fully_shard" and row["op"] in ("reduce_scatter_single", "all_reduce")
    )


def _args(*argv):
    return build_parser().parse_args(["train", *argv])


def test_the_flag_reaches_the_config():
    assert config_from_args(_args("--mixed-precision", "bf16")).mixed_precision == "bf16"
    assert config_from_args(_args()).mixed_precision == "none"


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
def test_mixed_precision_needs_float32_masters(dtype):
    with pytest.raises(ShardkitError, match=f"--mixed-precision bf16 .* needs --dtype float32, got --dtype {dtype}"):
        validate_config(TrainConfig(mixed_precision="bf16", dtype=dtype))


def test_unknown_mode_and_the_conv_model_are_refused():
    with pytest.raises(ShardkitError, match="--mixed-precision: mixed precision must be one of none, bf16"):
        validate_config(TrainConfig(mixed_precision="fp8"))
    with pytest.raises(ShardkitError, match="--mixed-precision bf16 with --model conv-ae"):
        validate_config(TrainConfig(model="conv-ae", mixed_precision="bf16"))


# Quick tier: tp + SP beside dp_replicate (dp's all-reduce in float32), a pipeline (bfloat16 stage
# boundaries), moe with full AC (expert reductions, the recompute in bf16), and moe with FSDP2 over
# dp_shard and edp under selective AC (FSDP2's float32 reduce-scatter of dense and expert weights,
# the replayed results). Ulysses x FSDP2 and selective AC alone add no reduction of their own.
QUICK = (
    "dp_replicate=2 x tp=2 (SP)",
    "pp=2 x tp=2 (SP), 1f1b",
    "moe: ep=2 from tp=2 x dp=2, --ac full",
    "moe: dp_shard=2 x tp=2, ep=2 (experts FSDP2 over edp), --ac selective",
)


@pytest.mark.world(4, timeout=240)
@pytest.mark.parametrize("overrides", tiered(LAYOUTS, QUICK))
def test_mixed_precision_layout_matches_one_process_and_reduces_in_fp32(overrides):
    cfg = validate_config(TrainConfig(**{**SMALL, **overrides}), world_size=world_size())
    result = train(cfg, "gloo", torch.device("cpu"), time.perf_counter(), progress=False)
    if rank() != 0:
        assert result is None
        return
    parity = result["parity"]
    assert parity["passed"] and parity["dtype"] == "bfloat16", parity
    rows = result["ledger"]
    reductions = [r for r in rows if _is_reduction(r)]
    moving = [r for r in rows if r["axis"] in ("tp", "cp_ulysses", "pp", "ep") and not _is_reduction(r)]
    moving = [r for r in moving if r["phase"] != "check" and r["dtype"] in ("float32", "bfloat16")]
    assert reductions and all(r["dtype"] == "float32" for r in reductions), reductions
    assert moving and all(r["dtype"] == "bfloat16" for r in moving), moving
