"""One rank of ``shardkit train``: TP+SP Llama inside DDP over dp, or pipeline stages x dp
(:mod:`.pipeline`), trained on real text.

Runs in every worker process (started by the local elastic launch or by torchrun). Rank 0
returns a result dict (losses, ledger, memory, timings, parity) that :mod:`.report` prints and
writes; the other ranks return None.
"""

from __future__ import annotations

import copy
import os
import resource
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from .. import CommLedger, ParallelDims, all_reduce_forward
from ..comm import ledger as _ledger
from ..expert_parallel import ep_plan
from ..tensor_parallel import apply_tp, gather_full_state_dict
from ..tensor_parallel.loss import vocab_parallel_cross_entropy
from .config import TrainConfig, uses_sequence_parallel
from .data import BatchSampler, corpus_files, load_tokens, local_rows
from .loop import causal_lm_loss, make_optimizer, run_steps
from .model import build_model
from .progress import TrainProgress
from .verify import compare_runs, reference_run

__all__ = ["worker_main"]


def _init(local_launch: bool) -> tuple[str, torch.device]:
    """Join the world: gloo on CPU for the local launch; NCCL on ``cuda:LOCAL_RANK`` under
    torchrun when GPUs are present, else gloo."""
    if not local_launch and torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if local_launch:
        torch.set_num_threads(1)  # 4 ranks on 2 cores: more threads only oversubscribe
    dist.init_process_group(backend)
    return backend, device


def _ddp_ledger_hook(state, bucket):
    """DDP's default all-reduce, recorded in the CommLedger so the summary shows dp traffic too."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    group, size = state
    nbytes = bucket.buffer().nbytes
    _ledger.record("all_reduce", "ddp", "backward", size, nbytes, nbytes)
    return default_hooks.allreduce_hook(group, bucket)


def _wrap_dp(model, dp_mesh, device):
    """DDP over the dp mesh; tp shards have the same shapes on every dp peer of a tp rank."""
    if dp_mesh.size() == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=dp_mesh.get_group(),
    )
    ddp.register_comm_hook((dp_mesh.get_group(), dp_mesh.size()), _ddp_ledger_hook)
    return ddp


def _peak_memory(device) -> int:
    """Peak memory of this rank in bytes: CUDA allocator peak, or the process's max RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _ledger_rows(ledger: CommLedger) -> list[dict]:
    """Ledger totals by (op, issuing api, phase, group size).

    Finer than ``CommLedger.summary()`` (op, group size): with tp = dp = 2 it would lump the tp
    norm-gradient all-reduces together with DDP's, and forward with backward traffic.
    """
    rows: dict[tuple, dict] = {}
    for r in ledger.records:
        row = rows.setdefault((r.op, r.api, r.phase, r.group_size), dict(count=0, bytes_sent=0, bytes_received=0))
        row["count"] += 1
        row["bytes_sent"] += r.bytes_sent
        row["bytes_received"] += r.bytes_received
    keys = ("op", "api", "phase", "group_size")
    return [{**dict(zip(keys, key)), **row} for key, row in sorted(rows.items())]


def _run_record(cfg, losses, memory, device, ledger, t_setup: float, t_train: float) -> dict:
    """The fields every model's result dict shares (config, losses, memory, ledger, timings)."""
    return {
        "config": asdict(cfg),
        "losses": losses,
        "peak_memory_bytes": memory,
        "memory_kind": "cuda max_memory_allocated" if device.type == "cuda" else "max RSS",
        "ledger": _ledger_rows(ledger),
        "timings_s": {"setup": t_setup, "train": t_train},
    }


@record
def _tensor_parallel(model, cfg: TrainConfig, tp_mesh):
    """Llama: tensor + sequence parallelism; other models (and --loss-parallel): their own HF plan
    through apply_tp, with the config's expert-parallel plan under --ep."""
    plan = ep_plan(model) if cfg.ep > 1 else None
    # Norms and routers stay replicated by design, so the plan check's "unsharded" list is expected.
    return apply_tp(model, tp_mesh, plan, sequence_parallel=uses_sequence_parallel(cfg),
                    loss_parallel=cfg.loss_parallel, check="off")


def _vocab_parallel_loss(tp_mesh):
    """:func:`.loop.causal_lm_loss` on vocab-sharded logits ``[B, S, V_r]``."""

    def loss_fn(logits, ids):
        return vocab_parallel_cross_entropy(logits[:, :-1], ids[:, 1:], tp_mesh)

    return loss_fn


def worker_main(cfg: TrainConfig, local_launch: bool) -> dict | None:
    """Entry point of every rank. Returns rank 0's result dict, None on other ranks."""
    t0 = time.perf_counter()
    backend, device = _init(local_launch)
    try:
        return _train(cfg, backend, device, t0)
    finally:
        dist.destroy_process_group()


def _train(cfg: TrainConfig, backend: str, device, t0: float) -> dict | None:
    if cfg.model == "conv-ae":
        return _train_conv_ae(cfg, backend, device, t0)
    if cfg.cp_size > 1:
        from .cp import train_cp  # tp x cp x dp: its own mesh and step (no DDP)

        return train_cp(cfg, backend, device, t0)
    rank = dist.get_rank()
    if cfg.pp > 1:
        from .pipeline import pipeline_mesh  # stages of different tp sizes are not a rectangle

        mesh = pipeline_mesh(cfg, device.type)
    else:
        mesh = ParallelDims(dp=cfg.dp, pp=cfg.pp, tp=cfg.tp).build_mesh(device.type)
    tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    tokens = load_tokens(corpus_files(cfg.data))
    sampler = BatchSampler(tokens, cfg.seq_len, cfg.batch_size, cfg.seed)

    model = build_model(cfg)
    reference = copy.deepcopy(model) if cfg.verify and rank == 0 else None
    if cfg.pp > 1:
        from .pipeline import build_stage, gather_stage_params, run_pipeline_steps

        stage = build_stage(model, mesh, cfg, device)
        model = stage.module  # the full model's other stages are dropped with it
    else:
        model = _wrap_dp(_tensor_parallel(model, cfg, tp_mesh).to(device), dp_mesh, device)
    optimizer = make_optimizer(model, cfg)
    dp_rank, dp = dp_mesh.get_local_rank(), dp_mesh.size()
    t_setup = time.perf_counter() - t0

    tokens_per_step = cfg.batch_size * cfg.seq_len
    progress = TrainProgress(cfg.steps, tokens_per_step) if rank == 0 else None
    with CommLedger() as ledger, (progress or nullcontext()):
        t1 = time.perf_counter()
        if cfg.pp > 1:
            losses = run_pipeline_steps(
                stage, optimizer, sampler, cfg, mesh, device, on_step=progress.update if progress else None
            )
        else:
            losses = run_steps(
                model,
                optimizer,
                sampler,
                cfg.steps,
                rows=lambda b: local_rows(b, dp_rank, dp),
                device=device,
                reduce_loss=lambda loss: all_reduce_forward(loss, dp_mesh) / dp,
                on_step=progress.update if progress else None,
                loss_fn=_vocab_parallel_loss(tp_mesh) if cfg.loss_parallel else causal_lm_loss,
            )
        t_train = time.perf_counter() - t1

    memory = [None] * dist.get_world_size()
    dist.all_gather_object(memory, _peak_memory(device))
    if not cfg.verify:
        full_params = None
    elif cfg.pp > 1:
        full_params = gather_stage_params(stage, mesh)
    else:
        full_params = gather_full_state_dict(model)
    if rank != 0:
        return None

    layout = {
        "pp": cfg.pp,
        "tp": cfg.tp,
        "pp_tp": cfg.pp_tp,
        "model": cfg.model,
        "ep": cfg.ep,
        "loss_parallel": cfg.loss_parallel,
        "dp": cfg.dp,
        "microbatches": cfg.microbatches,
        "schedule": cfg.schedule if cfg.pp > 1 else None,
    }
    verify = None if reference is None else (lambda: reference_run(reference.to(device), cfg, tokens, device))
    return lm_result(cfg, layout, backend, device, (losses, memory, ledger, t_setup, t_train), tokens, full_params, verify)


def lm_result(cfg: TrainConfig, layout: dict, backend: str, device, run: tuple, tokens, full_params, verify) -> dict:
    """Rank 0's result of a causal-LM run: ``layout`` plus the shared record fields and, when
    ``verify`` (a callable returning the reference losses and parameters) is given, the parity.

    Args:
        run: ``(losses, memory, ledger, t_setup, t_train)`` of the parallel run.
    """
    losses, memory, ledger, t_setup, t_train = run
    result = {
        "layout": {"nproc": cfg.nproc, **layout, "backend": backend, "device": str(device)},
        **_run_record(cfg, losses, memory, device, ledger, t_setup, t_train),
        "tokens_per_s": cfg.batch_size * cfg.seq_len * cfg.steps / t_train,
        "corpus_tokens": tokens.numel(),
    }
    if verify is not None:
        t2 = time.perf_counter()
        ref_losses, ref_params = verify()
        result["reference_losses"] = ref_losses
        result["parity"] = compare_runs(losses, ref_losses, full_params, ref_params, cfg.dtype)
        result["timings_s"]["verify"] = time.perf_counter() - t2
    return result


def _train_conv_ae(cfg: TrainConfig, backend: str, device, t0: float) -> dict | None:
    """``--model conv-ae``: every rank holds a W-slab of each frame (:mod:`.conv_ae`)."""
    from torch.distributed.device_mesh import init_device_mesh

    from ..spatial import apply_spatial
    from .conv_ae import CROP, CropSampler, build_conv_ae, load_image, run_conv_ae_steps

    rank = dist.get_rank()
    group = init_device_mesh(device.type, (cfg.spatial,), mesh_dim_names=("spatial",)).get_group()
    image = load_image()
    model = build_conv_ae(cfg.dtype, cfg.seed)
    reference = copy.deepcopy(model) if cfg.verify and rank == 0 else None
    model = apply_spatial(model.to(device), group, dim=-1)
    optimizer = make_optimizer(model, cfg)
    t_setup = time.perf_counter() - t0

    pixels_per_step = cfg.batch_size * CROP[0] * CROP[1]
    progress = TrainProgress(cfg.steps, pixels_per_step, unit="px") if rank == 0 else None
    with CommLedger() as ledger, (progress or nullcontext()):
        t1 = time.perf_counter()
        sampler = CropSampler(image, CROP, cfg.batch_size, cfg.seed)
        losses = run_conv_ae_steps(model, optimizer, sampler, cfg.steps, device, group,
                                   on_step=progress.update if progress else None)
        t_train = time.perf_counter() - t1

    memory = [None] * dist.get_world_size()
    dist.all_gather_object(memory, _peak_memory(device))
    if rank != 0:
        return None
    result = {
        "layout": {"nproc": cfg.nproc, "model": cfg.model, "spatial": cfg.spatial, "dp": 1, "backend": backend,
                   "device": str(device)},
        **_run_record(cfg, losses, memory, device, ledger, t_setup, t_train),
        "pixels_per_s": pixels_per_step * cfg.steps / t_train,
        "image": {"shape": list(image.shape), "crop": list(CROP)},
    }
    if reference is not None:
        # Parameters are replicated (apply_spatial sums their gradients over the group), so
        # rank 0's are the full ones.
        params = {name: p.detach() for name, p in model.named_parameters()}
        t2 = time.perf_counter()
        reference = reference.to(device)
        sampler = CropSampler(image, CROP, cfg.batch_size, cfg.seed)
        ref_losses = run_conv_ae_steps(reference, make_optimizer(reference, cfg), sampler, cfg.steps, device)
        ref_params = {name: p.detach() for name, p in reference.named_parameters()}
        result["reference_losses"] = ref_losses
        result["parity"] = compare_runs(losses, ref_losses, params, ref_params, cfg.dtype)
        result["timings_s"]["verify"] = time.perf_counter() - t2
    return result
