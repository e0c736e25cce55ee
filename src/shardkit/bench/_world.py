"""``shardkit bench`` in an existing world instead of spawned gloo worlds.

Under ``torchrun`` (``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` set) the bench joins that world:
NCCL with ``--device cuda`` (each rank on ``cuda:LOCAL_RANK``), gloo with ``--device cpu``.
With ``--device cuda`` and no torchrun, the cases that run on one rank get a world of 1 on
``cuda:0`` in this process. A case whose world size this world does not have is skipped, its
reason printed and recorded (:func:`.registry.skip_reason`); the cases on torch's fake process
group run on rank 0 once the world is closed, their tensors on the same device. On CUDA,
float32 runs without TF32 (the cases' checks compare float32 results at rtol 1e-4).
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist

from ..comm import checks
from ..errors import ShardkitError
from ._launch import run_fake, run_named
from ._method import Settings
from ._quiet import quiet_known_warnings
from .registry import CASES, skip_reason

__all__ = ["LAUNCH", "torchrun_env", "run_in_world"]

LAUNCH = "torchrun --standalone --nproc-per-node N -m shardkit bench --device cuda"
TIMEOUT = timedelta(seconds=600)


def torchrun_env(environ=os.environ) -> dict[str, int] | None:
    """``{rank, world, local_rank}`` of the world torchrun made, or None outside torchrun."""
    if not all(k in environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return None
    return dict(rank=int(environ["RANK"]), world=int(environ["WORLD_SIZE"]), local_rank=int(environ["LOCAL_RANK"]))


def _need_cuda(local_rank: int) -> None:
    if not torch.cuda.is_available():
        raise ShardkitError(
            f"shardkit bench --device cuda: CUDA is not available here (torch {torch.__version__}, "
            f"{torch.cuda.device_count()} GPUs); on a machine with GPUs launch it with `{LAUNCH} ...` "
            "(N = the GPUs to use), or run the CPU bench: `shardkit bench` (--device cpu, gloo)"
        )
    if local_rank >= torch.cuda.device_count():
        raise ShardkitError(
            f"shardkit bench --device cuda: LOCAL_RANK {local_rank} but {torch.cuda.device_count()} GPUs visible"
        )


@contextmanager
def _ieee_fp32() -> Iterator[None]:
    """float32 matmuls and convolutions at full precision (no TF32, cuDNN's default for
    convolutions) while the cases run: their checks compare float32 results at rtol 1e-4."""
    conv, matmul = getattr(torch.backends.cudnn, "conv", None), torch.backends.cuda.matmul
    if conv is not None and hasattr(conv, "fp32_precision") and hasattr(matmul, "fp32_precision"):
        saved = (conv.fp32_precision, matmul.fp32_precision)
        conv.fp32_precision = matmul.fp32_precision = "ieee"
        try:
            yield
        finally:
            conv.fp32_precision, matmul.fp32_precision = saved
        return
    saved = (torch.backends.cudnn.allow_tf32, matmul.allow_tf32)  # torch before the fp32_precision API
    torch.backends.cudnn.allow_tf32 = matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, matmul.allow_tf32 = saved


@contextmanager
def _world(settings: Settings, env: dict[str, int] | None) -> Iterator[None]:
    """The process group the cases run on (the default group), closed on exit if made here."""
    cuda = settings.device == "cuda"
    local = env["local_rank"] if env else 0
    if cuda:
        _need_cuda(local)
        torch.cuda.set_device(local)
    if dist.is_initialized():  # a caller's world: used as it is
        yield
        return
    backend = "nccl" if cuda else "gloo"
    device_id = torch.device("cuda", local) if cuda else None
    with tempfile.TemporaryDirectory(prefix="shardkit-bench-") as tmp:
        if env is not None:  # torchrun's rendezvous (env://)
            dist.init_process_group(backend, timeout=TIMEOUT, device_id=device_id)
        else:  # one GPU, no torchrun: a world of 1 through a private FileStore
            store = dist.FileStore(os.path.join(tmp, "store"), 1)
            dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=TIMEOUT, device_id=device_id)
        try:
            yield
        finally:
            dist.destroy_process_group()


def _isolated(name: str, alone: bool, skipped: list[dict], run) -> list[dict]:
    """``run()``'s records; where this process is alone (a world of 1, the fake worlds) a failing
    case is recorded in ``skipped`` as failed (its traceback printed) and the next one runs. In a
    larger world the error propagates, as on the CPU: a rank going on alone would wait forever."""
    if not alone:
        return run()
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 - reported, counted as failed, never as passed
        traceback.print_exc()
        print(f"  {name}: FAILED: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        skipped.append(dict(case=name, reason=f"failed: {type(exc).__name__}: {exc}".splitlines()[0], failed=True))
        return []


def run_in_world(names: list[str], settings: Settings, progress: bool = True) -> tuple[list[dict], list[dict], bool]:
    """Run ``names`` in the existing world (see the module docstring).

    Returns:
        ``(records, skipped, writer)``: rank 0's records (other ranks: empty), the skipped
        cases as ``{"case", "reason"}`` (and ``"failed": True`` for a case that raised in a
        world of one process, where the next case still runs) and whether this rank writes the
        outputs (rank 0).

    Raises:
        ShardkitError: ``--device cuda`` where CUDA is missing, or without torchrun where no
            selected case runs on one rank (the message gives the torchrun command).
    """
    quiet_known_warnings()  # this process runs the cases (torch's peers' two known notices)
    env = torchrun_env()
    world = env["world"] if env else 1
    if env is None and settings.device == "cuda":
        _need_cuda(0)
        if all(skip_reason(n, 1) for n in names):
            raise ShardkitError(
                f"shardkit bench --device cuda: the cases {names} need more than one rank; launch with "
                f"`{LAUNCH} --cases {','.join(names)}` (N = the ranks they need: `shardkit bench --help`)"
            )
    rank = env["rank"] if env else 0
    skipped = [dict(case=n, reason=r) for n in names if (r := skip_reason(n, world))]
    for s in skipped if rank == 0 else []:
        print(f"  [{world} ranks] {s['case']}: skipped: {s['reason']}", file=sys.stderr, flush=True)
    runnable = [n for n in names if not skip_reason(n, world)]
    fake = [n for n in runnable if CASES[n].fake]
    records: list[dict] = []
    tag = f"{world} ranks, {settings.device}"
    with _world(settings, env), checks(False), _ieee_fp32() if settings.device == "cuda" else nullcontext():
        if settings.device == "cpu":
            torch.set_num_threads(1)  # as the spawned CPU worlds (the ranks share the cores)
        for name in (n for n in runnable if not CASES[n].fake):
            records += _isolated(
                name, world == 1, skipped, lambda n=name: run_named([n], dist.group.WORLD, settings, progress, tag)
            )
    if rank == 0 and fake and dist.is_initialized():  # a caller's world stays: no fake world beside it
        skipped += [dict(case=n, reason="runs on fake worlds, not beside a caller's process group") for n in fake]
    elif rank == 0 and fake:
        with checks(False), _ieee_fp32() if settings.device == "cuda" else nullcontext():
            for name in fake:
                records += _isolated(name, True, skipped, lambda n=name: run_fake([n], settings, progress))
    order = {n: i for i, n in enumerate(names)}
    records = sorted(records, key=lambda r: order[r["suite"]]) if rank == 0 else []
    return records, skipped, rank == 0
