"""Placement on CUDA, proven on this CPU build: one rank of each layout's training forward on fake
CUDA tensors (``harness.fake_cuda``) and torch's fake process group.

The trainer's own pieces run as in a step (the spec's ``parallelize``, the task's ``prepare``,
``forward`` and ``loss_sum``), with the model and every microbatch on a fake ``cuda`` device.
Asserted: every tensor handed to a c10d op is on CUDA, no op turns CUDA inputs into a CPU tensor
(a device-to-host copy or a CPU fallback), no value of a CUDA tensor is read on the host (a
synchronization), and the loss is on CUDA. The sampler's batch and its token count are host data
drawn before the step, as in the trainer.

Forward only: the autograd engine needs a real CUDA device for a tensor that requires grad
(torch 2.13's CPU build aborts the process; a CUDA build without a GPU raises), and FSDP2/DDP
create CUDA streams, which a CPU build cannot: those parts are checked on a GPU by
``scripts/gpu_first_checks.sh``. Mixture-of-experts layouts are not here: dropless dispatch
reads each layer's token counts on the host by design (the split sizes of its all-to-all), a
value a fake tensor does not have; likewise transformers' own MoE experts (``--model mla``), and
the conv-ae's spatial layers, which learn every rank's split sizes on the first step of a crop
shape (one read per layer, then none: tests/train/test_host_syncs.py).
"""

from __future__ import annotations

import pytest
import torch

from harness.fake_cuda import fake_cuda, fake_world, to_fake_cuda
from shardkit.comm.host_sync import host_side
from shardkit.train.config import TrainConfig, parallel_dims, validate_config
from shardkit.train.corpus import read_corpus
from shardkit.train.run import build_task, build_train_model
from shardkit.train.specs import model_spec

SMALL = dict(steps=1, seq_len=32, batch_size=4, dtype="float32", verify=False, layers=2, lr=1e-3)

LAYOUTS = {
    "tp": dict(tp=2),
    "tp_sp_dp": dict(tp=2, dp_replicate=2),
    "uneven_gqa_tp": dict(tp=4, hidden_size=96, heads=6, kv_heads=2),
    "ulysses": dict(tp=1, cp_ulysses=2),
    "ring": dict(tp=1, cp_ring=2),
    "usp_tp": dict(tp=2, cp_ring=2, cp_ulysses=2),
    "ring_packed": dict(tp=1, cp_ring=2, packed=True, batch_size=2),
    "packed": dict(tp=2, packed=True),
}


def _forward(kw: dict):
    cfg = validate_config(TrainConfig(**{**SMALL, **kw}))
    dims = parallel_dims(cfg)
    spec = model_spec(cfg.model)
    with fake_world(dims.product):
        mesh = dims.build_mesh("cuda")
        task = build_task(cfg, torch.device("cuda"), read_corpus(cfg) if spec.reads_corpus else None)
        model = build_train_model(cfg)
        batch = task.next_batch()  # host data, drawn before the step
        n = task.count(batch)
        with fake_cuda() as log, torch.no_grad():
            pm, _ = spec.parallelize(to_fake_cuda(model), mesh, cfg, task)
            dp, dp_rank = (1, 0) if pm.mesh is None else (pm.mesh.size("dp"), pm.mesh.local_rank("dp"))
            losses = []
            with host_side():  # as train_step: the microbatches are host data (real CPU tensors)
                mbs = task.microbatches(batch, dp_rank, dp, cfg.microbatches)
            for mb in mbs:
                inputs, targets = task.prepare(mb, pm)
                losses.append(task.loss_sum(task.forward(pm.module, inputs), targets, pm))
    return log, losses, n


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_training_forward_stays_on_cuda(layout):
    log, losses, n = _forward(LAYOUTS[layout])
    assert n > 0 and losses and all(loss.device.type == "cuda" for loss in losses)
    assert log.collectives, "no collective ran: the layout was not exercised"
    off_device = sorted({c for c in log.collectives if c[1] != "cuda"})
    assert not off_device, f"c10d ops handed non-CUDA tensors: {off_device}"
    assert not log.to_host, f"CUDA inputs gave CPU outputs: {sorted(set(log.to_host))}"
