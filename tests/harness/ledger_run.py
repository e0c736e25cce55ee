"""One training run of ``shardkit train``'s in-process trainer under a :class:`CommLedger`, for
the tests that hold the planner's collectives to what the runtime issued (tests/plan)."""

from __future__ import annotations

import torch

from shardkit import CommLedger
from shardkit.plan import ModelShape
from shardkit.sharding import ParallelDims
from shardkit.train.config import TrainConfig, parallel_dims
from shardkit.train.model import hf_config
from shardkit.train.run import build_parallel_model, build_task, build_train_model, run_training
from shardkit.train.specs import model_spec


def ledger_of_a_run(cfg: TrainConfig) -> tuple[ParallelDims, ModelShape, CommLedger]:
    """Collective over the world: train ``cfg`` (validated) on CPU with every collective recorded;
    the layout, the model's shape for the planner and this rank's ledger."""
    dims = parallel_dims(cfg)
    mesh = dims.build_mesh("cpu")
    task = build_task(cfg, torch.device("cpu"))
    pm, loss_scale = build_parallel_model(build_train_model(cfg), mesh, cfg, task, torch.device("cpu"))
    with CommLedger() as ledger:
        run_training(pm, task, cfg, loss_scale)
    shape = ModelShape.from_config(hf_config(cfg, model_spec(cfg.model).family)[1])
    return dims, shape, ledger
