"""One rank of ``shardkit train``: build the layout's mesh, parallelize, train, report.

Runs in every worker process (started by the local elastic launch or by torchrun). The layout
(:func:`.config.parallel_dims`) gives one :class:`~shardkit.ParallelDims`, whose mesh is the only
one built. The model, its task and its parallelization are its spec's (:mod:`.specs`): the
decoder LMs go through :func:`~shardkit.parallelize.parallelize` (or
:func:`~shardkit.parallelize.parallelize_stage` with a pipeline), ``conv-ae`` through
:func:`~shardkit.parallelize.parallelize_conv`; every step through :func:`.trainer.train_step`.
Rank 0 returns a result dict (losses, gradient norms, ledger, memory, timings, parity) that
:mod:`.report` prints and writes; the other ranks return None.
"""

from __future__ import annotations

import copy
import os
import time
from contextlib import nullcontext
from dataclasses import asdict
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from .. import CommLedger
from .._local_world import init_local_world
from ..checkpoint import load_train_state
from ..checkpoint.hf_writer import hf_description, write_hf
from ..checkpoint.lock import root_lock
from ..comm import checks, checks_enabled, flight_recorder
from ..comm._group import resolve_group
from ..comm.agree import agree
from ..parallelize import ParallelModel, gather_full_parameters
from ..parallelize.saved_bytes import activation_meter
from .checkpoint_dir import recheck_checkpoint_dir, resume_source
from .config import TrainConfig, parallel_dims
from .corpus import shared_corpus
from .environment import run_environment
from .evaluate import eval_loss
from .liveness import Heartbeat, set_phase
from .liveness import progress as count_progress
from .metrics import ledger_rows, model_size, open_metrics, peak_memory, utilisation
from .moe_balance import moe_balance_for
from .profiling import step_profiler
from .progress import default_log_every, make_progress, setup_note
from .saving import StepSaves
from .schedule import fast_forward, warmup_cosine
from .specs import model_spec
from .trainer import LossScale, make_optimizer, nonfinite_step, train_step
from .verify import compare_runs

__all__ = ["worker_main", "build_task", "build_train_model", "build_parallel_model", "run_training"]


def _init(run_dir: str | None, timeout: timedelta) -> tuple[str, torch.device]:
    """Join the world with ``timeout`` on every collective: gloo on CPU for the local launch
    (through its private ``run_dir``: :func:`shardkit._local_world.init_local_world`); under torchrun
    (``run_dir`` None) NCCL on ``cuda:LOCAL_RANK`` when GPUs are present, else gloo."""
    if run_dir is not None:
        torch.set_num_threads(1)  # 4 ranks on 2 cores: more threads only oversubscribe
        init_local_world(run_dir, timeout)
        return "gloo", torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, timeout=timeout)
    return backend, device


def build_task(cfg: TrainConfig, device, corpus=None):
    """The training task of ``cfg``'s model spec with a fresh sampler (the same batches on every rank).

    ``corpus``: the LM's token stream (:class:`.corpus.Corpus`); None: read it with
    :func:`.corpus.shared_corpus`, collective over the world (global rank 0 reads, every rank
    receives the same tokens). The ``--verify`` reference passes the run's own corpus.
    """
    return model_spec(cfg.model).task(cfg, device, corpus)


def build_train_model(cfg: TrainConfig):
    """The model of ``cfg`` (its spec's), the same on every rank (same seed)."""
    return model_spec(cfg.model).build(cfg)


def build_parallel_model(model, mesh, cfg: TrainConfig, task, device) -> tuple[ParallelModel, LossScale | None]:
    """``model`` parallelized for ``cfg``'s layout on ``mesh`` by its spec (None: one process, unchanged)."""
    return model_spec(cfg.model).parallelize(model.to(device), mesh, cfg, task)


def _extra_state(task, balance=None) -> dict[str, torch.Tensor]:
    """What a checkpoint keeps besides model and optimizer (the same on every rank holding it): the
    data sampler's generator, torch's RNG and the MoE routers' biases (loaded in place)."""
    biases = balance.biases() if balance is not None else {}
    return {"data_generator": task.sampler.gen.get_state(), "torch_rng": torch.get_rng_state(), **biases}


def run_training(
    pm,
    task,
    cfg: TrainConfig,
    loss_scale=None,
    on_step=None,
    layout: str = "",
    metrics=None,
    hf=None,
    progress=None,
    host_syncs=None,
) -> dict:
    """Steps ``first..cfg.steps - 1`` of :func:`.trainer.train_step`; per-step losses and gradient norms.

    With ``cfg.checkpoint_dir``: the run holds the directory's lock throughout (another run on it
    is refused), ``cfg.resume`` first loads the latest save (``cfg.resume_from``: that save;
    ``first`` = its step; :func:`.checkpoint_dir.resume_source`), and the state
    is saved every ``cfg.save_every`` steps and after the last one (the newest ``cfg.keep`` kept),
    each save's manifest holding ``hf`` (:func:`~shardkit.checkpoint.hf_writer.hf_description`).

    With ``cfg.eval_every``, the held-out loss (:func:`.evaluate.eval_loss`) after every
    ``eval_every``-th step and the last: ``eval_losses`` ``[[step, loss], ...]`` (1-based steps).

    A step with a non-finite global loss or gradient norm is not applied (:func:`.trainer.
    train_step`); up to ``cfg.skip_nonfinite`` of them are skipped (counted in this run, a
    resumed run counts afresh), one more raises :class:`~shardkit.errors.NonFiniteError` on
    every rank before that step's save.

    ``on_step(step, loss)`` and ``progress.update(step, loss, lr, eval_loss)`` (:mod:`.progress`) are called
    after every step (0-based), ``metrics.write`` records it (:class:`.metrics.MetricsLog`); ``host_syncs``
    (:class:`~shardkit.comm.host_sync.HostSyncCounter`) counts each ``train_step``'s host syncs.
    ``--profile-steps`` / ``--memory-snapshot``: :mod:`.profiling` (``profile`` in the result).

    Raises:
        NonFiniteError: more non-finite steps than ``cfg.skip_nonfinite``.
    """
    if pm.mesh is not None and cfg.checkpoint_dir is not None:
        world = dist.group.WORLD
        assert world is not None  # a mesh exists: the world is initialized
        recheck = partial(recheck_checkpoint_dir, cfg)
        say = progress.note if progress else None  # rank 0 says what was saved and removed
        with root_lock(cfg.checkpoint_dir, world, "shardkit train --checkpoint-dir", verify=recheck):
            with StepSaves(cfg, say, timedelta(seconds=cfg.timeout)) as saves:  # waits for a pending save
                return _run_steps(pm, task, cfg, loss_scale, on_step, layout, metrics, hf, progress, host_syncs, saves)
    return _run_steps(pm, task, cfg, loss_scale, on_step, layout, metrics, hf, progress, host_syncs)


def _run_steps(
    pm, task, cfg: TrainConfig, loss_scale, on_step, layout: str, metrics, hf, progress, host_syncs=None, saves=None
) -> dict:
    assert cfg.lr is not None  # validate_config resolved it
    optimizer = make_optimizer(pm.module, cfg.lr, pm.grads)
    scheduler = None
    if cfg.lr_schedule == "warmup-cosine":
        scheduler = warmup_cosine(optimizer, cfg.steps)
    first = 0
    balance = moe_balance_for(pm, cfg)  # None without the --moe-* flags
    if pm.mesh is not None:  # the --verify reference (no mesh) starts at step 0 and is compared from `first`
        path = resume_source(cfg)
        if path is not None:
            set_phase("loading")
            extra = _extra_state(task, balance)
            first = load_train_state(path, pm, optimizer, extra, allow_unverified=cfg.allow_unverified)
            task.sampler.gen.set_state(extra["data_generator"])
            torch.set_rng_state(extra["torch_rng"])
            if scheduler is not None:  # the schedule is a function of the step count
                fast_forward(scheduler, optimizer, cfg.steps, first)
    losses, norms, skipped, evals, moe_loads = [], [], [], [], []
    saved: dict = {"saved_activation_bytes": None, "saved_bytes_per_block": None}
    prof = step_profiler(cfg) if pm.mesh is not None else None  # --profile-steps, --memory-snapshot
    for step in range(first, cfg.steps):
        set_phase("training")  # entering a phase is progress: one count per step
        lr = optimizer.param_groups[0]["lr"]  # the rate this step uses
        # the first step counts the activation bytes each block keeps (pack hooks cost Python time)
        meter = activation_meter(pm.module, cfg.ac if pm.mesh is not None else "none") if step == first else None
        with meter or nullcontext(), host_syncs or nullcontext(), prof.step(step) if prof else nullcontext():
            stats = train_step(
                pm,
                optimizer,
                task,
                microbatches=cfg.microbatches,
                max_norm=cfg.max_norm,
                schedule=cfg.schedule,
                loss_scale=loss_scale,
                scheduler=scheduler,
                after_step=balance.after_step if balance is not None else None,
            )
        if stats.moe is not None:
            moe_loads.append(stats.moe["moe_load_counts"])
        if host_syncs is not None:
            host_syncs.next_step()
        if meter is not None:
            saved = {"saved_activation_bytes": sum(meter.per_block), "saved_bytes_per_block": meter.per_block}
        held = None
        if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
            set_phase("evaluating")
            held = eval_loss(pm, task, cfg.microbatches, cfg.schedule, loss_scale)
            evals.append([step + 1, held])
        losses.append(stats.loss)
        norms.append(stats.grad_norm)
        if on_step is not None:
            on_step(step, stats.loss)
        if progress is not None:
            progress.update(step, stats.loss, lr, held)
        if metrics is not None:
            metrics.write(step, stats, lr, saved["saved_activation_bytes"] if step == first else None, held)
        if stats.skipped:
            skipped.append(step + 1)
            nonfinite_step(step, stats, lr, len(skipped), cfg.skip_nonfinite)
        done = step + 1
        if saves is not None and (done == cfg.steps or (cfg.save_every and done % cfg.save_every == 0)):
            set_phase("saving")
            saves.save(pm, optimizer, done, _extra_state(task, balance), layout, hf)
            count_progress()  # the save's files are written (--async-checkpoint: staged)
    return {
        "losses": losses,
        "grad_norms": norms,
        "first_step": first,
        "skipped_steps": skipped,
        "eval_losses": evals,
        "moe_load_counts": moe_loads,
        **saved,
        **(prof.result() if prof else {}),
    }


@record
def worker_main(cfg: TrainConfig, run_dir: str | None, flight_dir: str | None = None) -> dict | None:
    """Entry point of every rank. Returns rank 0's result dict, None on other ranks.

    ``run_dir``: the local launch's private directory
    (:func:`shardkit._local_world.private_run_dir`); None
    under torchrun. With ``flight_dir``, the rank beats a heartbeat there while it runs
    (:class:`.liveness.Heartbeat`), and on any failure (an error, a collective timeout, SIGTERM
    turned into an exception) it writes its flight recorder (its last shardkit collectives) there
    before re-raising, so the launcher can name the rank that stopped answering and the first
    call where the ranks diverged.
    """
    t0 = time.perf_counter()
    # the first beat before joining the world (the launcher sets RANK): a rank that never joins
    # is then the one without a heartbeat, not the ranks waiting for it
    rank = int(os.environ.get("RANK", "0"))
    beating = Heartbeat(flight_dir, rank) if flight_dir is not None else nullcontext()
    with beating:
        backend, device = _init(run_dir, timedelta(seconds=cfg.timeout))
        try:
            return train(cfg, backend, device, t0)
        except BaseException as exc:
            if flight_dir is not None:
                flight_recorder.dump_all(flight_dir, reason=f"{type(exc).__name__}: {exc}"[:500])
            raise
        finally:
            dist.destroy_process_group()


def train(cfg: TrainConfig, backend: str, device, t0: float, progress: bool = True, host_syncs=None) -> dict | None:
    """The whole run on this rank, inside an initialized world of ``cfg.nproc`` ranks.

    ``progress``: rank 0 says each set-up stage on stderr and shows its progress: a bar on a
    terminal, a plain line every ``cfg.log_every`` steps elsewhere (tests turn it off). With ``cfg.checks`` the run
    (parallelize, its fingerprint, every step) is in shardkit's check mode, switched on for this
    run only with :class:`shardkit.comm.checks` (every rank sets it alike: the config is the same).
    ``host_syncs``: see :func:`run_training` (the run's own steps, not the ``--verify`` reference).
    """
    with checks(cfg.checks or checks_enabled()):
        return _train(cfg, backend, device, t0, progress, host_syncs)


def _train(cfg: TrainConfig, backend: str, device, t0: float, progress: bool, host_syncs=None) -> dict | None:
    rank = dist.get_rank()
    dims = parallel_dims(cfg)

    def note(what: str) -> None:  # set-up stages on rank 0, so a log file is not blank meanwhile
        count_progress()  # each stage of the set-up is progress (phase starting)
        if progress and rank == 0:
            setup_note(what, t0)

    note(f"{cfg.nproc} rank(s) joined ({backend}); building the mesh {dims.describe()}")
    mesh = dims.build_mesh(device.type)
    corpus = None
    spec = model_spec(cfg.model)
    if spec.reads_corpus:
        note(f"reading the corpus ({cfg.data or 'the Python standard library'})")
        corpus = shared_corpus(cfg, device)  # read once (rank 0), reused by the --verify reference
    task = build_task(cfg, device, corpus)
    note(f"building the model ({cfg.model_path or cfg.model})")
    model = build_train_model(cfg)
    hf = hf_description(model, cfg.model_path, cfg.tokenizer)  # kept in each save's manifest (shardkit export)
    size = model_size(model, cfg.seq_len)  # the whole model, before parallelize cuts it
    reference = copy.deepcopy(model) if cfg.verify and rank == 0 else None
    note(f"parallelizing ({dims.describe()})")
    pm, loss_scale = build_parallel_model(model, mesh, cfg, task, device)
    del model
    t_setup = time.perf_counter() - t0
    source = resume_source(cfg)  # every rank alike (the same files), checked before launch
    note(f"loading {source}, then training" if source is not None else f"training {cfg.steps} steps")

    unit, unit_name = spec.unit
    sample = spec.sample_size(cfg)
    every = cfg.log_every or default_log_every(cfg.steps)
    bar = make_progress(cfg.steps, cfg.batch_size * sample, every, unit) if progress and rank == 0 else None
    with CommLedger() as ledger, bar or nullcontext():
        t1 = time.perf_counter()
        metrics = open_metrics(cfg, rank, unit_name, sample, device, resumed=source is not None)
        try:
            run = run_training(
                pm,
                task,
                cfg,
                loss_scale,
                layout=dims.describe(),
                metrics=metrics,
                hf=hf,
                progress=bar,
                host_syncs=host_syncs,
            )
        finally:
            if metrics is not None:
                metrics.close()
        t_train = time.perf_counter() - t1

    # the gather, then rank 0 alone (the others exit): the report's files, --save-hf, --verify
    set_phase("finishing")
    world = resolve_group(dist.group.WORLD, "shardkit train")
    gathered = agree(world, "shardkit train", None, [peak_memory(device), run["saved_activation_bytes"]], gather=True)
    memory, saved_bytes = [m for m, _ in gathered], [s for _, s in gathered]
    outputs = spec.outputs if cfg.report is not None else None
    full_params = gather_full_parameters(pm) if cfg.verify or outputs is not None or cfg.save_hf else None
    if rank != 0:
        return None
    files = []
    if metrics is not None:
        files += metrics.files()
    if outputs is not None and cfg.report is not None:
        assert full_params is not None  # gathered above; rank 0 holds them
        files += outputs(cfg, cfg.report, full_params)
        count_progress()
    if cfg.save_hf is not None:  # --save-hf: the trained model as a Hugging Face directory
        assert full_params is not None  # gathered above; rank 0 holds them
        set_phase("exporting")
        files.append(write_hf(cfg.save_hf, full_params, hf, "this run"))
        set_phase("finishing")
    rate = cfg.batch_size * sample * (cfg.steps - run["first_step"]) / t_train  # this run's steps
    result = {
        "layout": {
            "nproc": cfg.nproc,
            "model": cfg.model,
            "parallel": dims.describe(),
            **{k: v for k, v in asdict(dims).items() if k != "world_size"},
            "sequence_parallel": pm.sequence_parallel,
            "loss_parallel": cfg.loss_parallel,
            "microbatches": cfg.microbatches,
            "schedule": cfg.schedule if dims.pp > 1 else None,
            "virtual_stages": cfg.virtual_stages if dims.pp > 1 else None,
            "packed": cfg.packed,
            "backend": backend,
            "device": str(device),
        },
        "config": asdict(cfg),
        "run_id": metrics.run_id if metrics is not None else None,
        "environment": run_environment(),
        **run,
        "peak_memory_bytes": memory,
        "memory_kind": "cuda max_memory_allocated" if device.type == "cuda" else "max RSS",
        # per rank, its first step: bytes its decoder blocks kept for backward (parallelize.saved_bytes)
        "saved_activation_bytes": saved_bytes,
        "ledger": ledger_rows(ledger, mesh),
        "timings_s": {"setup": t_setup, "train": t_train},
        "files": files,
        f"{unit_name}_per_s": rate,
        **size,
        **utilisation(size["flops_per_token"], rate if unit_name == "tokens" else None, dist.get_world_size(), device),
    }
    if reference is not None:
        assert full_params is not None  # gathered above for --verify; rank 0 holds them
        t2 = time.perf_counter()
        ref_pm, _ = build_parallel_model(reference, None, cfg, None, device)
        ref = run_training(ref_pm, build_task(cfg, device, corpus), cfg)
        ref_params = gather_full_parameters(ref_pm)
        assert ref_params is not None  # one process: its own parameters
        first = run["first_step"]  # a resumed run is compared from the step it resumed at
        result["reference_losses"] = ref["losses"][first:]
        result["reference_grad_norms"] = ref["grad_norms"][first:]
        result["reference_eval_losses"] = [e for e in ref["eval_losses"] if e[0] > first]
        result["parity"] = compare_runs(
            run["losses"],
            result["reference_losses"],
            full_params,
            ref_params,
            cfg.dtype if cfg.mixed_precision == "none" else "bfloat16",  # bf16 compute: bf16's tolerance
            grad_norms=(run["grad_norms"], result["reference_grad_norms"]),
            moe_loads=(run["moe_load_counts"], ref["moe_load_counts"][first:]),
        )
        result["timings_s"]["verify"] = time.perf_counter() - t2
    return result
