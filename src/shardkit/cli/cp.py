"""The context-parallel side of ``shardkit train --cp-ulysses U --cp-ring R``: tp x cp x dp.

Mesh ``(dp, cp_ring, cp_ulysses, tp)``. Every rank of a cp group gets the same rows of the
global batch (this dp rank's ``[B / dp, S]``) and keeps its share of the sequence
(:meth:`~shardkit.context_parallel.CPContext.shard_batch`: labels shifted on the full sequence,
global position ids). Attention is Ulysses (``R = 1``), zigzag ring (``U = 1``) or USP (both
> 1), switched in by :func:`~shardkit.context_parallel.apply_cp`; with ``--tp T`` the model is
first sharded by its own Hugging Face plan (Megatron TP, replicated activations, through
:func:`~shardkit.tensor_parallel.apply_tp`): its attention then sees ``N / T`` heads, which the
cp attention reads from the tensors.

Gradients: the cp loss is the full-sequence token mean on every rank with each rank's share of
the gradient, so parameter gradients are summed over cp (``all_reduce_grads``) and then averaged
over dp with one flat all-reduce. DDP is not used: it would all-reduce during backward, before
the cp sum, and over its own group only (a ``cp x dp`` DDP group would average where cp must
sum); one explicit reduction after backward is simpler and exact, as in :mod:`.pipeline`.

``--packed``: every window is treated as documents packed along ``S`` (a document = one corpus
file; :class:`PackedSampler`), passed to ``shard_batch`` as ``cu_seqlens`` row by row; the
reference (:func:`packed_reference_run`) runs each document through the unsharded model alone.

Source: Megatron-LM's context-parallel training loop (labels shifted before the split, loss
summed over cp, gradients reduced over the ``dp x cp`` ranks).
"""

from __future__ import annotations

import copy
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from .. import CommLedger, ShardkitError, all_reduce_forward
from ..context_parallel import apply_cp
from ..tensor_parallel import apply_tp, gather_full_state_dict
from .config import TrainConfig
from .data import BatchSampler, corpus_files, load_tokens, local_rows
from .loop import average_grads, make_optimizer
from .model import build_model
from .progress import TrainProgress
from .verify import reference_run

__all__ = ["cp_mode", "train_cp"]

MESH_DIMS = ("dp", "cp_ring", "cp_ulysses", "tp")


def cp_mode(cfg: TrainConfig) -> str:
    """``"usp"`` when both cp sizes are > 1, else ``"ring"`` or ``"ulysses"``."""
    if cfg.cp_ring > 1 and cfg.cp_ulysses > 1:
        return "usp"
    return "ring" if cfg.cp_ring > 1 else "ulysses"


def _cp_mesh(mesh, mode: str):
    """apply_cp's mesh: the 2-D ``(cp_ring, cp_ulysses)`` sub-mesh for usp, else the 1-D dim of the mode."""
    if mode == "usp":
        return mesh["cp_ring", "cp_ulysses"]
    return mesh["cp_ring" if mode == "ring" else "cp_ulysses"]


def run_cp_steps(model, ctx, optimizer, sampler, cfg: TrainConfig, dp_mesh, device, on_step=None) -> list[float]:
    """Train ``cfg.steps`` steps; return each step's global mean loss (the same on every rank).

    Per step: this dp rank's rows ``[B / dp, S]`` -> this cp rank's tokens ``[B / dp, S_local]``;
    ``ctx.loss`` with the global target count ``B / dp x (S - 1)`` is exactly the reference's
    :func:`.loop.causal_lm_loss` of those rows, so the dp mean is the global-batch mean.
    Collective over the whole world.
    """
    dp_rank, dp = dp_mesh.get_local_rank(), dp_mesh.size()
    params = [p for p in model.parameters() if p.requires_grad]
    losses = []
    for step in range(cfg.steps):
        ids = local_rows(sampler.next_batch(), dp_rank, dp).to(device)
        batch = ctx.shard_batch(ids, ids)
        loss = ctx.loss(model(**batch.inputs).logits, batch.labels, batch.num_tokens)
        loss.backward()
        ctx.all_reduce_grads(model)  # sum over cp: each rank's gradient covers its own tokens
        average_grads(params, dp_mesh, "cp_dp_grads")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append((all_reduce_forward(loss.detach(), dp_mesh) / dp).item())
        if on_step is not None:
            on_step(step, losses[-1])
    return losses


class PackedSampler(BatchSampler):
    """:class:`.data.BatchSampler`'s windows (same generator draws), each with its documents.

    A document is one corpus file: ``next_batch`` gives ``([B, S] ids, cu)`` where ``cu[b]`` is
    the cumulative document lengths of row ``b`` (the file boundaries inside its window).

    Args:
        tokens, seq_len, batch_size, seed: as :class:`.data.BatchSampler`.
        file_sizes: token count of every corpus file, in stream order (summing to ``N``).
    """

    def __init__(self, tokens, seq_len: int, batch_size: int, seed: int, file_sizes: list[int]) -> None:
        super().__init__(tokens, seq_len, batch_size, seed)
        self.starts = torch.tensor(file_sizes, dtype=torch.int64).cumsum(0)[:-1]  # where files 1.. begin

    def next_batch(self):
        starts = torch.randint(0, self.tokens.numel() - self.seq_len + 1, (self.batch_size,), generator=self.gen)
        ids = self.tokens[starts[:, None] + self._offsets].long()
        cu = []
        for a in starts.tolist():
            inside = self.starts[(self.starts > a) & (self.starts < a + self.seq_len)] - a
            cu.append((0, *inside.tolist(), self.seq_len))
        return ids, cu


def _targets(cu: tuple[int, ...]) -> int:
    """Next-token targets of one packed row: ``len - 1`` per document."""
    return sum(max(b - a - 1, 0) for a, b in zip(cu[:-1], cu[1:]))


def run_cp_packed_steps(model, ctx, optimizer, sampler, cfg: TrainConfig, dp_mesh, device, on_step=None):
    """:func:`run_cp_steps` on packed rows: one ``shard_batch`` per row (``cu_seqlens`` is per row).

    Rows hold different target counts, so every row's loss is divided by the *global* count (every
    rank sees the whole global batch) and the gradients are summed over dp, not averaged.
    """
    dp_rank, dp = dp_mesh.get_local_rank(), dp_mesh.size()
    params = [p for p in model.parameters() if p.requires_grad]
    n = cfg.batch_size // dp
    losses = []
    for step in range(cfg.steps):
        ids, cus = sampler.next_batch()
        total = sum(_targets(cu) for cu in cus)
        step_loss = torch.zeros((), dtype=torch.float64, device=device)
        for r in range(dp_rank * n, (dp_rank + 1) * n):
            row = ids[r : r + 1].to(device)
            batch = ctx.shard_batch(row, row, cu_seqlens=cus[r])
            loss = ctx.loss(model(**batch.inputs).logits, batch.labels, total)
            loss.backward()
            step_loss += loss.detach()
        ctx.all_reduce_grads(model)
        average_grads(params, dp_mesh, "cp_dp_grads")
        for p in params if dp > 1 else ():
            p.grad.mul_(dp)  # the average back to the sum: each row's loss already has the global count
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(all_reduce_forward(step_loss, dp_mesh).item())
        if on_step is not None:
            on_step(step, losses[-1])
    return losses


def packed_reference_run(model, cfg: TrainConfig, tokens, file_sizes, device) -> tuple[list[float], dict]:
    """The one-process reference of a ``--packed`` run: every document of every row through the
    unsharded model on its own (positions from 0), one token-mean loss over the global batch."""
    sampler = PackedSampler(tokens, cfg.seq_len, cfg.batch_size, cfg.seed, file_sizes)
    optimizer = make_optimizer(model, cfg)
    losses = []
    for _ in range(cfg.steps):
        ids, cus = sampler.next_batch()
        ids = ids.to(device)
        total = sum(_targets(cu) for cu in cus)
        loss = 0.0
        for r, cu in enumerate(cus):
            for a, b in zip(cu[:-1], cu[1:]):
                if b - a > 1:
                    logits = model(input_ids=ids[r : r + 1, a:b]).logits[0, :-1]
                    loss = loss + torch.nn.functional.cross_entropy(logits, ids[r, a + 1 : b], reduction="sum")
        loss = loss / total
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {name: p.detach() for name, p in model.named_parameters()}


def train_cp(cfg: TrainConfig, backend: str, device, t0: float) -> dict | None:
    """One rank of a tp x cp x dp run. Returns rank 0's result dict, None on other ranks."""
    from .worker import _peak_memory, lm_result

    rank = dist.get_rank()
    mesh = init_device_mesh(device.type, (cfg.dp, cfg.cp_ring, cfg.cp_ulysses, cfg.tp), mesh_dim_names=MESH_DIMS)
    tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    files = corpus_files(cfg.data)
    tokens = load_tokens(files)
    file_sizes = [f.stat().st_size for f in files]
    if cfg.packed and sum(file_sizes) != tokens.numel():  # every rank reads the same files: same verdict
        raise ShardkitError(f"--packed: the corpus changed while it was read ({sum(file_sizes)} != {tokens.numel()} bytes)")
    if cfg.packed:
        sampler = PackedSampler(tokens, cfg.seq_len, cfg.batch_size, cfg.seed, file_sizes)
    else:
        sampler = BatchSampler(tokens, cfg.seq_len, cfg.batch_size, cfg.seed)

    model = build_model(cfg)
    reference = copy.deepcopy(model) if cfg.verify and rank == 0 else None
    if cfg.tp > 1:
        # Norms stay replicated by design, so the plan check's "unsharded" list is expected.
        model = apply_tp(model, tp_mesh, None, check="off")
    model = model.to(device)
    mode = cp_mode(cfg)
    ctx = apply_cp(model, _cp_mesh(mesh, mode), mode)
    optimizer = make_optimizer(model, cfg)
    t_setup = time.perf_counter() - t0

    tokens_per_step = cfg.batch_size * cfg.seq_len
    progress = TrainProgress(cfg.steps, tokens_per_step) if rank == 0 else None
    with CommLedger() as ledger, (progress or nullcontext()):
        t1 = time.perf_counter()
        run = run_cp_packed_steps if cfg.packed else run_cp_steps
        losses = run(model, ctx, optimizer, sampler, cfg, dp_mesh, device,
                              on_step=progress.update if progress else None)
        t_train = time.perf_counter() - t1

    memory = [None] * dist.get_world_size()
    dist.all_gather_object(memory, _peak_memory(device))
    # Parameters are replicated over cp and dp: gather the tp shards (collective over tp).
    full_params = gather_full_state_dict(model) if cfg.verify else None
    if rank != 0:
        return None

    layout = {"model": cfg.model, "tp": cfg.tp, "cp_ring": cfg.cp_ring, "cp_ulysses": cfg.cp_ulysses,
              "cp_mode": mode, "packed": cfg.packed, "dp": cfg.dp}
    verify = None
    if reference is not None:
        if cfg.packed:
            verify = lambda: packed_reference_run(reference.to(device), cfg, tokens, file_sizes, device)  # noqa: E731
        else:
            verify = lambda: reference_run(reference.to(device), cfg, tokens, device)  # noqa: E731
    return lm_result(cfg, layout, backend, device, (losses, memory, ledger, t_setup, t_train), tokens, full_params, verify)
