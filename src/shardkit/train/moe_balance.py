"""The trainer's MoE balancing (``--moe-bias-update-rate``, ``--moe-z-loss``, ``--moe-seq-aux-loss``)
and expert capacity (``--moe-capacity-factor``, ``--moe-drop-policy``, ``--moe-pad-to-capacity``).

:func:`install_moe_balance` puts :func:`~shardkit.expert_parallel.router.install_balanced_router`
on every router of the full model, before :func:`~shardkit.parallelize.parallelize` (the
routers are not tensor-parallel: every transform keeps their forward), for the parallel run and
the ``--verify`` reference alike, with the same global scales (the step's ``B x S`` tokens and
``B`` sequences), so both add the same losses.

:class:`MoEBalance` runs after each optimizer step: one all-reduce over the world of a
``[L, E + 2]`` float64 table (per decoder layer: the per-expert load, then this step's z-loss and
sequence loss), where each rank fills the rows of its own layers and only ranks with distinct
tokens contribute (tp ranks hold copies of the same tokens unless sequence parallelism splits
them). So every rank holding a layer gets that layer's load over the whole global batch, equal to
the one-process reference's load, and steps the bias by the same sign on every rank (DeepSeek-V3's
update, skipped with the step when the step is not applied). The row sums give the metrics.

With a capacity every router drops the pairs over it on the tokens of its call (the reference:
on each of the parallel run's token groups, :mod:`.moe_capacity`); the table gains a column,
the dropped pairs, and the metrics the dropped fraction per layer.

Source: DeepSeek-V3 section 2.1.2 (the bias updated at the end of each step from the step's load).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..comm import _c10d
from ..comm._group import resolve_group
from ..expert_parallel.balance import update_router_bias_
from ..expert_parallel.router import BIAS_BUFFER, BalanceState, balance_state, install_balanced_router
from .moe_capacity import reference_groups
from .options import TrainConfig
from .pretrained import read_config

__all__ = ["moe_balance_on", "expert_capacity_options", "install_moe_balance", "MoEBalance", "moe_balance_for"]

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def moe_balance_on(cfg: TrainConfig) -> bool:
    """Whether any of the balancing flags is set."""
    balancing = cfg.moe_bias_update_rate is not None or bool(cfg.moe_z_loss) or bool(cfg.moe_seq_aux_loss)
    return balancing or cfg.moe_capacity_factor is not None


def expert_capacity_options(cfg: TrainConfig) -> dict | None:
    """The capacity keywords of :func:`~shardkit.parallelize.parallelize` (``expert_capacity``), or None."""
    if cfg.moe_capacity_factor is None:
        return None
    return dict(
        capacity_factor=cfg.moe_capacity_factor,
        drop_policy=cfg.moe_drop_policy,
        pad_to_capacity=cfg.moe_pad_to_capacity,
    )


def _routers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, router)`` of every MoE block (a module with ``experts`` and ``gate`` children)."""
    out = []
    for name, m in model.named_modules():
        gate = getattr(m, "gate", None)
        if isinstance(gate, nn.Module) and isinstance(getattr(m, "experts", None), nn.Module):
            out.append((f"{name}.gate" if name else "gate", gate))
    return out


def install_moe_balance(model: nn.Module, cfg: TrainConfig, reference: bool = False) -> int:
    """Install the balanced routers on ``model`` (the full, unparallelized model); how many.

    Nothing happens without the flags (the routers keep their own forward). ``reference``: the
    ``--verify`` reference, whose router calls hold several of the parallel run's token groups.
    """
    if not moe_balance_on(cfg):
        return 0
    routers = _routers(model)
    groups = reference_groups(cfg) if reference and cfg.moe_capacity_factor is not None else None
    for _, router in routers:
        install_balanced_router(
            router,
            bias_rate=cfg.moe_bias_update_rate,
            z_loss=cfg.moe_z_loss,
            seq_aux_loss=cfg.moe_seq_aux_loss,
            token_scale=1.0 / (cfg.batch_size * cfg.seq_len),
            seq_scale=1.0 / cfg.batch_size,
            seq_len=cfg.seq_len,
            capacity_factor=cfg.moe_capacity_factor,
            drop_policy=cfg.moe_drop_policy,
            capacity_groups=groups,
        )
    return len(routers)


@dataclass
class _Router:
    layer: int
    name: str
    module: nn.Module
    state: BalanceState


class MoEBalance:
    """After each step: the global load and losses of every MoE layer, and the bias update.

    Args:
        pm: the :class:`~shardkit.parallelize.ParallelModel` whose routers were installed.
        cfg: the run's options (the flags).
        num_layers: decoder layers of the whole model (rows of the table, the same on every rank).
        num_experts: routed experts ``E``.
    """

    def __init__(self, pm, cfg: TrainConfig, num_layers: int, num_experts: int) -> None:
        self.pm, self.cfg, self.num_layers, self.num_experts = pm, cfg, num_layers, num_experts
        self.routers: list[_Router] = []
        for name, router in _routers(pm.module):
            state = balance_state(router)
            match = _LAYER.search(name)
            if state is not None and match is not None:
                self.routers.append(_Router(int(match.group(1)), name, router, state))
        mesh = pm.mesh
        # tp ranks route copies of the same tokens unless sequence parallelism split them, which it
        # does for expert-parallel blocks only: a tensor-parallel MoE block gathers the sequence first
        own = mesh is not None and pm.sequence_parallel and mesh.dims.ep > 1
        self.counts = mesh is None or own or mesh.local_rank("tp") == 0

    def biases(self) -> dict[str, torch.Tensor]:
        """The bias buffers of this rank's routers, by a layout-free key (checkpoint ``extra`` state)."""
        found = {f"moe_bias/layer_{r.layer}": r.module._buffers.get(BIAS_BUFFER) for r in self.routers}
        return {key: bias for key, bias in found.items() if bias is not None}

    def after_step(self, skipped: bool) -> dict:
        """Collective over the world: reduce the step's table, step the biases (unless ``skipped``),
        reset the accumulators; the metrics (the same on every rank, one host read).

        Returns:
            ``moe_layers`` (indices), ``moe_load`` (per layer, the fraction of (token, slot)
            pairs per expert), ``moe_load_max_over_mean`` (per layer), ``moe_load_counts``
            (per layer, the counts, then with a capacity the dropped pairs: what ``--verify``
            compares), ``moe_z_loss`` / ``moe_seq_aux_loss`` (summed over layers) when on, and
            with a capacity ``moe_dropped_fraction`` (per layer: dropped / routed pairs).
        """
        n_exp = self.num_experts
        device = self.routers[0].state.load.device if self.routers else _device(self.pm.module)
        table = torch.zeros(self.num_layers, n_exp + 3, dtype=torch.float64, device=device)
        if self.counts:
            for r in self.routers:
                table[r.layer, :n_exp] = r.state.load
                table[r.layer, n_exp : n_exp + 2] = r.state.aux
                table[r.layer, n_exp + 2 :] = r.state.dropped
        if self.pm.mesh is not None and dist.get_world_size() > 1:
            world = resolve_group(dist.group.WORLD, "MoEBalance")
            table = _c10d.all_reduce(table.reshape(-1), world, "moe_load", "forward").reshape(table.shape)
        for r in self.routers:
            rate = r.state.bias_rate
            bias = r.module._buffers.get(BIAS_BUFFER)
            if rate is not None and bias is not None and not skipped:
                update_router_bias_(bias, table[r.layer, :n_exp], rate)
            r.state.reset()
        rows = table.tolist()  # the one host read
        layers = [i for i, row in enumerate(rows) if sum(row[:n_exp]) > 0]
        loads = [rows[i][:n_exp] for i in layers]
        capacity = self.cfg.moe_capacity_factor is not None
        out: dict = {
            "moe_layers": layers,
            "moe_load_counts": [load + [rows[i][n_exp + 2]] for load, i in zip(loads, layers)] if capacity else loads,
            "moe_load": [[c / sum(load) for c in load] for load in loads],
            "moe_load_max_over_mean": [max(load) * n_exp / sum(load) for load in loads],
        }
        if self.cfg.moe_z_loss:
            out["moe_z_loss"] = sum(rows[i][n_exp] for i in layers)
        if self.cfg.moe_seq_aux_loss:
            out["moe_seq_aux_loss"] = sum(rows[i][n_exp + 1] for i in layers)
        if capacity:
            out["moe_dropped_fraction"] = [rows[i][n_exp + 2] / sum(load) for load, i in zip(loads, layers)]
        return out


def moe_balance_for(pm, cfg: TrainConfig) -> MoEBalance | None:
    """The run's :class:`MoEBalance` (None without the flags), sized by the whole model's layers
    and experts: the flags' for a built-in model, the checkpoint config's with ``--model-path``."""
    if not moe_balance_on(cfg):
        return None
    layers, experts = cfg.layers, cfg.experts
    if cfg.model_path is not None:
        config = read_config(cfg.model_path)
        layers = config.num_hidden_layers
        experts = getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", None) or experts
    return MoEBalance(pm, cfg, layers, experts)


def _device(module: nn.Module) -> torch.device:
    p = next(module.parameters(), None)
    return p.device if p is not None else torch.device("cpu")
