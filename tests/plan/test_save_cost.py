"""The planner's price of a checkpoint save (:mod:`shardkit.plan.saving`, issue 33 item 5):
by hand on a small config, and the staged bytes equal to what the trainer's state, staged by
:class:`~shardkit.checkpoint.background.CpuStager`, measures (under FSDP2: the rank's shard)."""

from dataclasses import replace

import pytest
import torch

from harness.helpers import SMALL_CORPUS, world_size
from harness.tiny_lm import TINY_LLAMA_CONFIG as TINY
from shardkit import Cluster, ModelShape, ParallelDims, StepOptions
from shardkit.checkpoint.background import CpuStager
from shardkit.checkpoint.train_state import _ensure_adam_state, _state_dict
from shardkit.plan import save_cost
from shardkit.plan.options import hooked_params, resolve_options
from shardkit.train.config import TrainConfig, parallel_dims, validate_config
from shardkit.train.run import build_parallel_model, build_task, build_train_model
from shardkit.train.trainer import make_optimizer


def test_sync_pays_the_write_async_the_staging_copy():
    shape = ModelShape.from_config(TINY)
    cluster = Cluster(gpus=4, host_gbps=20.0, checkpoint_gbps=2.0)
    opts = StepOptions(seq_len=16, global_batch=4, dtype="bfloat16")  # float32 masters: 12 bytes a parameter
    dims = ParallelDims(tp=2, dp_shard=2)
    held = shape.rank_params(2)[0]
    sync = save_cost(shape, dims, opts, cluster, asynchronous=False)
    assert sync.written == shape.total_params * 12 / 4 and sync.staged == 0.0
    assert sync.critical_s == sync.write_s == pytest.approx(sync.written / 2e9)
    ahead = save_cost(shape, dims, opts, cluster, asynchronous=True)
    # the rank's FSDP2 shard of its tp-local state (never gathered); the norms FSDP2 leaves to the
    # sum over tp (sequence parallelism) whole
    kept = hooked_params(shape, dims, resolve_options(shape, dims, opts), 0)
    assert kept > 0 and ahead.staged == (kept + (held - kept) / 2) * 12
    assert ahead.critical_s == ahead.stage_s == pytest.approx(ahead.staged / 20e9)
    hsdp = save_cost(shape, ParallelDims(tp=2, dp_replicate=2, dp_shard=2), opts, cluster, asynchronous=True)
    assert hsdp.staged == ahead.staged  # HSDP's replicas stage the same shard
    zero = save_cost(shape, ParallelDims(tp=2, dp_replicate=2), replace(opts, zero=1), cluster, asynchronous=True)
    assert zero.staged == held * 12  # ZeRO's moments are gathered per parameter first
    # a write longer than the steps between saves shows as the next save's wait
    late = save_cost(shape, dims, opts, cluster, asynchronous=True, save_every=2, step_s=ahead.write_s / 4)
    assert late.critical_s == pytest.approx(ahead.stage_s + ahead.write_s / 2)
    wide = save_cost(shape, ParallelDims(tp=1, dp_shard=4), StepOptions(dtype="float64"), cluster, asynchronous=True)
    assert wide.staged == shape.total_params * 24 / 4  # float64 parameter and moments, a quarter each


CORPUS = SMALL_CORPUS


@pytest.mark.world(2, timeout=120)
@pytest.mark.parametrize(
    "layout",
    [dict(tp=2), dict(tp=1, pp=2, microbatches=2), dict(tp=1, dp_shard=2)],
    ids=["tp=2", "pp=2", "FSDP2 dp_shard=2"],
)
def test_staged_bytes_equal_the_trainers_staged_state(layout):
    cfg = validate_config(
        TrainConfig(seq_len=16, batch_size=4, dtype="float32", layers=2, lr=1e-3, data=CORPUS, **layout),
        world_size=world_size(),
    )
    device = torch.device("cpu")
    task = build_task(cfg, device)
    model = build_train_model(cfg)
    shape = ModelShape.from_config(model.config)
    pm, _ = build_parallel_model(model, parallel_dims(cfg).build_mesh("cpu"), cfg, task, device)
    optimizer = make_optimizer(pm.module, 1e-3, pm.grads)
    _ensure_adam_state(optimizer)
    state, _ = _state_dict(pm, optimizer, {})
    stager = CpuStager()
    stager.stage(state)
    scalars = sum(4 for k in state if k.endswith("/step"))  # AdamW's step counts: not priced
    dims = ParallelDims(tp=layout["tp"], pp=layout.get("pp", 1), dp_shard=layout.get("dp_shard", 1))
    opts = StepOptions(seq_len=16, global_batch=4, dtype="float32", microbatches=layout.get("microbatches", 1))
    priced = save_cost(shape, dims, opts, Cluster(gpus=2), asynchronous=True).staged
    measured = torch.tensor([float(stager.staged_bytes - scalars)])
    torch.distributed.all_reduce(measured, op=torch.distributed.ReduceOp.MAX)  # the fullest rank
    assert measured.item() == priced


def test_plan_command_prices_a_save(tmp_path, capsys):
    from shardkit.cli.main import main

    config = tmp_path / "config.json"
    config.write_text(__import__("json").dumps(TINY))
    code = main(
        ["plan", "--config", str(config), "--gpus", "4", "--seq-len", "16", "--global-batch", "8"]
        + ["--top", "2", "--plot", str(tmp_path / "p.png")]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    line = next(x for x in out.splitlines() if x.startswith("a save of the fastest layout"))
    assert "GB written per GPU at 1 GB/s" in line and "--async-checkpoint" in line and "GB staged at 25 GB/s" in line
