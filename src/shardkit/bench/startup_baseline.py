"""The plain torchrun script of ``shardkit bench --cases startup``: no shardkit, only torch and
transformers, the same model and layout as the default ``shardkit train`` (dp_replicate x tp).

``torchrun --standalone --nproc-per-node 4 startup_baseline.py CONFIG.json DP TP`` joins the world,
builds a 2-D mesh ``(dp, tp)`` with ``init_device_mesh``, builds the Hugging Face causal LM of
``CONFIG.json`` (the config ``shardkit train`` builds, written by the case) from seed 0, shards
its attention and MLP projections over tp with torch's own ``parallelize_module``
(column-wise q/k/v/gate/up, row-wise o/down: Megatron-LM's split), runs one AdamW step on random
tokens with the gradients all-reduced over dp, and rank 0 prints ``first step done`` with the
loss. It imports nothing of shardkit on purpose: it is what a user would write by hand.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module
from transformers import AutoConfig, AutoModelForCausalLM

_COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def main(config_path: str, dp: int, tp: int, batch: int, seq: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    with open(config_path) as f:
        config = AutoConfig.for_model(**json.load(f))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).train()
    plan: dict[str, ParallelStyle] = {n: ColwiseParallel() for n in _COLWISE}
    plan.update({n: RowwiseParallel() for n in _ROWWISE})
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(mesh["dp"].get_local_rank())  # each dp rank its own rows
    tokens = torch.randint(0, config.vocab_size, (batch // dp, seq), generator=gen)
    loss = model(input_ids=tokens, labels=tokens).loss  # transformers shifts the labels itself
    loss.backward()
    for p in model.parameters():  # data parallelism by hand: the mean gradient over dp
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        dist.all_reduce(grad, group=mesh["dp"].get_group())
        grad /= dp
    optimizer.step()
    if dist.get_rank() == 0:
        print(f"first step done: loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:6]))
