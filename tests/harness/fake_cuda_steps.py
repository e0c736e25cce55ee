"""One layout's training steps on a CPU twin, then on fake CUDA (``harness.fake_cuda_step``).

Imported only inside the worker process, after the shim is loaded: the fake CUDA run needs the
autograd engine on fake CUDA tensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness.fake_cuda import OpLog, ReadRecorder, fake_cuda, fake_world, to_fake_cuda
from shardkit.train.config import TrainConfig, parallel_dims, validate_config
from shardkit.train.corpus import read_corpus
from shardkit.train.run import build_task, build_train_model
from shardkit.train.specs import model_spec
from shardkit.train.trainer import make_optimizer, train_step

SMALL = dict(steps=2, seq_len=32, batch_size=4, dtype="float32", verify=False, layers=2, lr=1e-3)


def _steps(cfg: TrainConfig, device: torch.device, steps: int, mode, on_step, place=lambda m: m):
    """Build the mesh, task and model (host work), then, inside ``mode``, place the model on
    ``device`` (``place``), parallelize it and run ``steps`` of the trainer's ``train_step``;
    ``on_step(k, optimizer, pm)`` before step ``k`` and at the end (``k == steps``)."""
    dims = parallel_dims(cfg)
    spec = model_spec(cfg.model)
    mesh = dims.build_mesh(device.type)
    task = build_task(cfg, device, read_corpus(cfg) if spec.reads_corpus else None)
    model = build_train_model(cfg)
    with mode:
        return _run(cfg, spec, mesh, task, place(model), steps, on_step)


def _run(cfg, spec, mesh, task, model, steps, on_step):
    pm, loss_scale = spec.parallelize(model, mesh, cfg, task)
    optimizer = make_optimizer(pm.module, cfg.lr)
    stats = []
    for k in range(steps):
        on_step(k, optimizer, pm)
        stats.append(
            train_step(
                pm,
                optimizer,
                task,
                microbatches=cfg.microbatches,
                max_norm=cfg.max_norm,
                schedule=cfg.schedule,
                loss_scale=loss_scale,
            )
        )
    on_step(steps, optimizer, pm)
    return stats


def _devices(tensors) -> list[str]:
    return sorted({t.device.type for t in tensors})


def record_reads(overrides: dict, steps: int) -> list:
    """Run the layout's steps on CPU in the current (real, gloo) world; this rank's host reads
    with their values (:class:`~harness.fake_cuda.ReadRecorder`). Collective over the world."""
    cfg = validate_config(TrainConfig(**{**SMALL, **overrides}), world_size=dist.get_world_size())
    recorder = ReadRecorder()
    _steps(cfg, torch.device("cpu"), steps, recorder, lambda *a: None)
    return recorder.reads


def fake_run(overrides: dict, steps: int, answers: list, world: int) -> dict:
    """The same steps on fake CUDA as rank 0 of a fake world of ``world`` ranks, host reads
    answered from ``answers`` (rank 0's :func:`record_reads`): JSON-able facts of the run."""
    cfg = validate_config(TrainConfig(**{**SMALL, **overrides}), world_size=world)
    answers = list(answers)
    recorded = len(answers)
    marks: list[dict] = []
    out: dict = {}
    log = OpLog()

    def on_step(k, optimizer, pm):
        marks.append({k: len(getattr(log, k)) for k in ("collectives", "to_host", "to_device", "reads")})
        if k == steps:
            out["params"] = _devices(pm.module.parameters())
            out["optimizer_state"] = _devices(
                v for state in optimizer.state.values() for v in state.values() if v.dim() > 0
            )

    with fake_world(world):
        stats = _steps(cfg, torch.device("cuda"), steps, fake_cuda(answers, log), on_step, place=to_fake_cuda)
    last, end = marks[-2], marks[-1]
    return out | {
        "skipped": [s.skipped for s in stats],
        "collectives_all": sorted({tuple(c) for c in log.collectives}),
        "collectives": log.collectives[last["collectives"] : end["collectives"]],
        "to_host": log.to_host[last["to_host"] :],
        "to_device": log.to_device[last["to_device"] :],
        "reads_per_step": [b["reads"] - a["reads"] for a, b in zip(marks, marks[1:])],
        "reads_recorded": recorded,
        "reads_left": len(answers),
        "backward_ops": sum(op.endswith("_backward") for op in log.ops),
    }
