"""The local experts of an MoE layer: one grouped GEMM per projection against a loop of per-expert GEMMs.

``moe``: 8 experts (SwiGLU, transformers' ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``
layout), rows grouped by expert with uneven counts (a skewed top-2 routing, one expert without
rows), forward + backward, float32. Variants: ``grouped`` (what
:func:`shardkit.expert_parallel.grouped_experts_forward` chooses: ``torch._grouped_mm`` where
this build runs it), ``bmm`` (the zero-padded ``torch.bmm`` fallback, forced) and ``loop`` (one
:func:`~shardkit.expert_parallel.expert_forward` per expert: the implementation they replace).
Checked: output, input gradient and both parameter gradients of each against the loop (rtol
1e-4). Local compute only: every rank runs the same case (per-op time = the slowest rank).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..expert_parallel import expert_forward, grouped_experts_forward
from ._method import Record, Settings, agree, close, time_interleaved

__all__ = ["moe_experts"]

EXPERTS = 8


class _SwiGLUExperts(nn.Module):
    """The parameter layout and gating of a transformers experts module (Qwen3-MoE's)."""

    def __init__(self, hidden: int, inter: int, dev: torch.device) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(7)
        self.num_experts = EXPERTS
        self.gate_up_proj = nn.Parameter(
            (torch.randn(EXPERTS, 2 * inter, hidden, generator=gen) * hidden**-0.5).to(dev)
        )
        self.down_proj = nn.Parameter((torch.randn(EXPERTS, hidden, inter, generator=gen) * inter**-0.5).to(dev))
        self.act_fn = nn.SiLU()


def _counts(tokens: int) -> list[int]:
    """Rows per expert of a skewed top-2 routing of ``tokens`` tokens (expert 7 gets none)."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(tokens, EXPERTS, generator=gen) + torch.linspace(1.0, -1.0, EXPERTS)
    logits[:, -1] = -float("inf")
    top = logits.topk(2, dim=1).indices.reshape(-1)
    return torch.zeros(EXPERTS, dtype=torch.long).scatter_add_(0, top, torch.ones_like(top)).tolist()


def moe_experts(pg, settings: Settings) -> list[Record]:
    world, dev = dist.get_world_size(pg), settings.torch_device
    sizes = [(256, 128, 256)] if settings.quick else [(256, 128, 256), (1024, 256, 512)]
    records = []
    for tokens, hidden, inter in sizes:
        module = _SwiGLUExperts(hidden, inter, dev)
        counts = _counts(tokens)
        rows = sum(counts)
        x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(1)).to(dev).requires_grad_()
        cot = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(2)).to(dev)

        def step(fn):
            def run():
                x.grad = None
                module.zero_grad(set_to_none=True)
                y = fn()
                (y * cot).sum().backward()
                return y.detach(), x.grad, module.gate_up_proj.grad, module.down_proj.grad

            return run

        def loop():
            outs, off = [], 0
            for e, n in enumerate(counts):
                outs.append(expert_forward(module, e, x.narrow(0, off, n)))
                off += n
            return torch.cat(outs)

        fns = dict(
            grouped=step(lambda: grouped_experts_forward(module, x, counts, hidden)),
            bmm=step(lambda: grouped_experts_forward(module, x, counts, hidden, path="bmm")),
            loop=step(loop),
        )
        ref = fns["loop"]()
        failures = [
            f"{name}: {what} differs from the loop"
            for name in ("grouped", "bmm")
            for what, a, b in zip(("output", "x.grad", "gate_up_proj.grad", "down_proj.grad"), fns[name](), ref)
            if not close(a, b, rtol=1e-4, atol=1e-4)
        ]
        agree(failures, pg, "moe")
        label = f"E={EXPERTS} rows={rows} H={hidden} I={inter}"
        rec = Record(
            "moe",
            dict(experts=EXPERTS, rows=rows, hidden=hidden, inter=inter, counts=counts, label=label),
            world,
            time_interleaved(fns, pg, settings),
            checked="output, input and parameter gradients of grouped and bmm against the loop (rtol 1e-4)",
        )
        rec.ratio("grouped/loop", "grouped", "loop", 1.0)
        rec.ratio("bmm/loop", "bmm", "loop")
        records.append(rec)
    return records
