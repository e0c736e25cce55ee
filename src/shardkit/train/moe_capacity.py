"""The token groups of ``--moe-capacity-factor``: which tokens each router call of the parallel
run holds, so the one-process ``--verify`` reference applies the capacity to the same groups.

Capacity is per router call (Megatron-LM applies it to one rank's tokens). In the parallel run
a call holds:

* ``k = B / (dp M)`` batch rows: data rank ``r``'s microbatch ``i`` is global rows
  ``[(r M + i) k, (r M + i + 1) k)``, so the reference's microbatch ``j`` (``dp k`` rows) is
  ``dp`` consecutive groups of ``k`` rows;
* of each row, the sequence positions of one cp rank, in its local order (the ring layout's
  part of ring rank ``a``, then Ulysses rank ``u``'s balanced block of it), as
  :meth:`~shardkit.context_parallel.CPContext.shard_batch` cuts them;
* with sequence parallelism and ``ep > 1`` (the MoE block runs on each tp rank's sequence
  block), one tp rank's balanced block of those positions; without ``ep`` the sequence-parallel
  MoE block gathers the sequence first, so the tp ranks route the same (whole) call.

Tokens enter the router row-major (``[rows, positions]`` flattened), the order
``drop_policy="position"`` drops by. :func:`reference_groups` returns the map from a
reference call's token count to those groups (:func:`~shardkit.expert_parallel.router_capacity.
grouped_capacity_keep`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .._shapes import balanced_split_sizes, split_offsets
from ..context_parallel._sizes import _order
from ..errors import ShardkitError
from .options import TrainConfig

__all__ = ["sequence_groups", "reference_groups"]


def sequence_groups(seq_len: int, cp_ring: int, cp_ulysses: int, cp_layout: str, sp_blocks: int) -> list[torch.Tensor]:
    """Positions ``[0, S)`` of each router call of one batch row, in the order the call sees them.

    Args:
        seq_len: ``S``.
        cp_ring: ring cp ranks (their parts follow ``cp_layout``).
        cp_ulysses: Ulysses ranks (a balanced block of their ring part each).
        cp_layout: ``"zigzag"``, ``"contiguous"`` or ``"stripe"``.
        sp_blocks: tp ranks routing their own sequence block (1: the call holds the cp part whole).
    """
    order = _order((0, seq_len), cp_ring, torch.device("cpu"), cp_layout)
    out = []
    for a in range(cp_ring):
        part = order.local(a)
        u_sizes = balanced_split_sizes(part.numel(), cp_ulysses)
        for u in range(cp_ulysses):
            mine = part[split_offsets(u_sizes)[u] :][: u_sizes[u]]
            t_sizes = balanced_split_sizes(mine.numel(), sp_blocks)
            out += [mine[split_offsets(t_sizes)[t] :][: t_sizes[t]] for t in range(sp_blocks)]
    return out


def reference_groups(cfg: TrainConfig) -> Callable[[int], list[torch.Tensor]]:
    """For the ``--verify`` reference: a call's token count ``T`` -> its token groups (module docstring).

    Raises (when called):
        ShardkitError: ``T`` is not whole groups of ``k`` rows of ``S`` tokens.
    """
    dp = (cfg.dp_replicate or 1) * cfg.dp_shard  # validate_config resolved dp_replicate
    rows = cfg.batch_size // (dp * cfg.microbatches)
    tp = 1 if cfg.pp_tp is not None else (cfg.tp or 1)  # pp_tp stages: the mesh's tp dim is 1
    sp_blocks = tp if cfg.sequence_parallel and cfg.ep > 1 else 1
    positions = sequence_groups(cfg.seq_len, cfg.cp_ring, cfg.cp_ulysses, cfg.cp_layout, sp_blocks)
    cache: dict[int, list[torch.Tensor]] = {}

    def groups(num_tokens: int) -> list[torch.Tensor]:
        if num_tokens not in cache:
            block = rows * cfg.seq_len
            if rows < 1 or num_tokens % block:
                raise ShardkitError(
                    f"--moe-capacity-factor reference: a router call of {num_tokens} tokens is not whole groups of "
                    f"{rows} row(s) x {cfg.seq_len} tokens (the parallel run's calls)"
                )
            out = []
            for c in range(num_tokens // block):
                row_starts = (c * rows + torch.arange(rows, dtype=torch.int64))[:, None] * cfg.seq_len
                out += [(row_starts + pos[None, :]).reshape(-1) for pos in positions]
            cache[num_tokens] = out
        return cache[num_tokens]

    return groups
