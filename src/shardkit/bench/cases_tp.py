"""Tensor-parallel training steps: shardkit against PyTorch DTensor and Hugging Face.

One step = ``zero_grad``, forward with ``labels`` (HF's causal-LM loss), backward, ``AdamW.step``
on a transformers ``LlamaForCausalLM`` (float32, sdpa) loaded by every rank from the same
``save_pretrained`` checkpoint, on the same token batch. Variants:

- TP: ``shardkit`` (:func:`shardkit.apply_tp` with the model's own HF plan), ``dtensor``
  (``parallelize_module``: q/k/v/gate/up ``ColwiseParallel``, o/down ``RowwiseParallel``,
  lm_head ``ColwiseParallel(output_layouts=Replicate())``, as torchtitan) and ``hf``
  (``from_pretrained(..., tp_plan="auto")``, transformers' DTensor tensor parallelism; needs
  ``accelerate``, left out without it);
- TP+SP: ``shardkit`` (:func:`shardkit.apply_tp` with ``sequence_parallel=True``: sequence-sharded norms and residuals)
  and ``dtensor`` (torchtitan's plan: ``SequenceParallel`` norms, ``PrepareModuleInput``
  all-gathers before attention and MLP, o/down ``RowwiseParallel(output_layouts=Shard(1))``,
  the sequence split at the first layer's input).

Checked before timing: the first step's losses agree (rtol 1e-4) and gathered gradients and
updated parameters of a few weights agree (rtol 1e-3; sums run in different orders).
``--quick``: TP only, at the tiny shape (the full run: TP and TP+SP at the small and large shapes).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist

from .. import apply_tp
from ..comm._group import resolve_group
from ..comm.agree import agree as agree_all
from ..tensor_parallel import gather_full_grads, gather_full_state_dict
from ._method import Record, Settings, agree, close, time_interleaved

__all__ = ["tp_step", "dtensor_tp", "load_llama", "save_llama", "SHAPES", "CHECKED"]

SHAPES: dict[str, tuple[dict[str, Any], tuple[int, int]]] = {  # LlamaConfig keywords, (batch, seq)
    "tiny": (
        dict(
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=344,
            vocab_size=2048,
        ),
        (2, 64),
    ),
    "small": (
        dict(
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            intermediate_size=688,
            vocab_size=4096,
        ),
        (4, 128),
    ),
    "large": (
        dict(
            hidden_size=512,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            intermediate_size=1408,
            vocab_size=8192,
        ),
        (2, 256),
    ),
}
CHECKED = (
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.1.self_attn.o_proj.weight",
    "model.layers.1.mlp.down_proj.weight",
    "model.norm.weight",
    "model.layers.1.post_attention_layernorm.weight",
    "lm_head.weight",
)


def load_llama(path, **kw):
    import transformers as tf

    return tf.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa", **kw)


def dtensor_tp(model, mesh, sp: bool):
    """PyTorch's own tensor parallelism of a Llama model on the 1-D ``mesh`` (torchtitan's plan)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )
    from torch.distributed.tensor.parallel.style import ParallelStyle

    out = Shard(1) if sp else Replicate()
    plan: dict[str, ParallelStyle] = {f"self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")}
    plan.update(
        {
            "self_attn.o_proj": RowwiseParallel(output_layouts=out),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=out),
        }
    )
    if sp:
        plan.update(
            {
                "input_layernorm": SequenceParallel(),
                "post_attention_layernorm": SequenceParallel(),
                "self_attn": PrepareModuleInput(
                    input_kwarg_layouts={"hidden_states": Shard(1)},
                    desired_input_kwarg_layouts={"hidden_states": Replicate()},
                ),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            }
        )
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)
    top: dict[str, ParallelStyle] = {
        "lm_head": ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(), output_layouts=Replicate())
    }
    if sp:
        top.update(
            {
                "model.norm": SequenceParallel(),
                "model.layers.0": PrepareModuleInput(
                    input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
                ),
            }
        )
    parallelize_module(model, mesh, top)
    return model


def _build(variant: str, path: str, pg, dev: torch.device):
    mode, impl = variant.split("/")
    if impl == "shardkit":
        return apply_tp(load_llama(path).to(dev), pg, sequence_parallel=mode == "tp+sp", check="off")
    if impl == "hf":  # transformers places it (cuda:LOCAL_RANK under torchrun)
        return load_llama(path, tp_plan="auto")
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh.from_group(pg, dev.type, mesh_dim_names=("tp",))
    return dtensor_tp(load_llama(path).to(dev), mesh, mode == "tp+sp")


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _gathered(variant, model, grads: bool):
    if variant.endswith("shardkit"):
        full = gather_full_grads(model) if grads else gather_full_state_dict(model)
        return {n: full[n] for n in CHECKED}
    params = dict(model.named_parameters())
    return {n: _full(params[n].grad if grads else params[n]).detach().clone() for n in CHECKED}


def lm_step(variant: str, model, ids):
    """The timed AdamW step of an LM ``model`` on ``ids``, after one such step whose loss and
    the checked parameters' gradients and updated values it returns for the parity check."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        return loss.detach()

    opt.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = _gathered(variant, model, True)
    opt.step()
    return step, (_full(loss.detach()).item(), grads, _gathered(variant, model, False))


def _steps(variants, path, ids, pg):
    """Each variant's step callable, after checking the first step against the first variant."""
    steps, seen = {}, {}
    for v in variants:
        steps[v], seen[v] = lm_step(v, _build(v, path, pg, ids.device), ids)
    ref = variants[0]
    bad = []
    for v in variants[1:]:
        if abs(seen[v][0] - seen[ref][0]) > 1e-4 * abs(seen[ref][0]):
            bad.append(f"loss {v} {seen[v][0]} vs {ref} {seen[ref][0]}")
        for kind, k in (("grad", 1), ("param", 2)):
            for n in CHECKED:
                a, b = seen[ref][k][n], seen[v][k][n]
                if not close(a, b, rtol=1e-3, atol=1e-5 * b.abs().max().item()):
                    bad.append(f"{kind} {n}: {v} vs {ref}")
    agree(bad, pg, "tp_step variants disagree")
    return steps, seen[ref][0]


def tp_step(pg, settings: Settings) -> list[Record]:
    import transformers as tf

    rank, n = dist.get_rank(pg), dist.get_world_size(pg)
    for key, value in dict(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=n).items():  # read by transformers' TP
        os.environ.setdefault(key, str(value))  # (torchrun's are kept: LOCAL_RANK is not the rank there)
    tf.logging.set_verbosity_error()
    tf.utils.logging.disable_progress_bar()
    hf = importlib.util.find_spec("accelerate") is not None  # transformers' TP loading needs it
    records = []
    for shape in ("tiny",) if settings.quick else ("small", "large"):
        cfg_kw, (batch, seq) = SHAPES[shape]
        with save_llama(cfg_kw, pg) as path:
            ids = torch.randint(0, cfg_kw["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(1))
            ids = ids.to(settings.torch_device)
            modes = [
                ("tp", ["tp/shardkit", "tp/dtensor"] + (["tp/hf"] if hf else [])),
                ("tp+sp", ["tp+sp/shardkit", "tp+sp/dtensor"]),
            ]
            for mode, variants in modes[:1] if settings.quick else modes:  # --quick: tp only (half the time)
                steps, loss = _steps(variants, path, ids, pg)
                times = time_interleaved({v.split("/")[1]: f for v, f in steps.items()}, pg, settings)
                rec = Record(
                    "tp_step",
                    dict(label=f"{mode} {shape}", mode=mode, shape=shape, batch=batch, seq=seq, loss=loss, **cfg_kw),
                    n,
                    times,
                    checked="first-step loss (rtol 1e-4), gathered grads and updated params (rtol 1e-3)",
                )
                for other in times:
                    if other != "shardkit":
                        rec.ratio(f"shardkit/{other}", "shardkit", other, 1.0)
                records.append(rec)
                del steps
    return records


@contextlib.contextmanager
def save_llama(cfg_kw: dict, pg):
    """A random ``LlamaForCausalLM`` of ``cfg_kw`` (seed 0) saved by rank 0 in a temporary folder
    every rank reads; yields its path; removed once every rank is done with it."""
    import transformers as tf

    rank = dist.get_rank(pg)
    with tempfile.TemporaryDirectory(prefix="shardkit-bench-llama-") as tmp:
        mine = os.path.join(tmp, "model")
        g = resolve_group(pg, "bench")
        path = agree_all(g, "bench", None, mine if rank == 0 else None, gather=True)[:1]  # rank 0's folder
        if rank == 0:
            torch.manual_seed(0)
            tf.LlamaForCausalLM(tf.LlamaConfig(**cfg_kw, use_cache=False, tie_word_embeddings=False)).save_pretrained(
                mine
            )
        dist.barrier(group=pg)
        try:
            yield str(path[0])
        finally:
            dist.barrier(group=pg)  # nobody reads the checkpoint any more
