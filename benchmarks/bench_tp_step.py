"""Paired, interleaved benchmark of a tensor-parallel training step (docs/design.md, Benchmarks).

``python benchmarks/bench_tp_step.py [--nproc 2,4] [--shapes small,large] [--rounds 40] [--warmup 5]
[--quick] [--json PATH] [--profile]``

One step = ``zero_grad``, forward with ``labels`` (HF's causal-LM loss), backward, ``AdamW.step``
on a transformers ``LlamaForCausalLM`` (float32, sdpa attention) sharded three ways over the
same local gloo world of R ranks (FileStore rendezvous, one intra-op thread per rank):

- ``shardkit``: :func:`shardkit.apply_tp` with the model's own HF plan (vocab-parallel
  embedding, q/k/v/gate/up colwise, o/down rowwise, lm_head colwise with gathered logits);
- ``hf``: transformers' own tensor parallelism, ``from_pretrained(dir, distributed_config=
  DistributedConfig(tp_size=R))`` (the same plan, DTensor parameters, its own DeviceMesh built
  over the already-initialised world);
- ``dtensor``: PyTorch ``parallelize_module`` with ``ColwiseParallel`` (q/k/v/gate/up),
  ``RowwiseParallel`` (o/down), lm_head ``ColwiseParallel(output_layouts=Replicate())``,
  embedding and norms replicated (as torchtitan; local outputs, so attention sees local heads).

All three load the same ``save_pretrained`` checkpoint and train on the same token batch. Before
timing, the first step's losses must agree (float32, rtol 1e-4) and a few gathered gradients
(after step 1) and parameters (after the optimizer step) must agree (rtol 1e-3; the sums run in
different orders). Each round runs the variants in alternating order with a barrier before each
step; per-step time = max over ranks. Reported: medians of the absolute step times and the
median [p10, p90] of the per-round ratios shardkit/hf and shardkit/dtensor.
``--profile`` adds a torch.profiler table (stderr) of one step of each variant on rank 0.

The ``hf`` variant needs ``accelerate`` (transformers 5.23's ``check_and_set_device_map`` in
``integrations/accelerate.py`` raises ``ValueError`` without it, because TP loading sets a
``device_map``); without it the ``hf`` column is left out. Not a shardkit dependency, so e.g.::

    pip install --no-deps --target /tmp/hf_accel accelerate
    PYTHONPATH=/tmp/hf_accel python benchmarks/bench_tp_step.py            # R = 2, 4; both shapes
    PYTHONPATH=/tmp/hf_accel python benchmarks/bench_tp_step.py --quick    # small shape, R = 2, 4
``--quick``: 10 rounds after 2 warm-up rounds (not a docs/design.md result), the small shape unless ``--shapes``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from _paired import (
    DECILES, add_timing_args, cell, dump_json, print_row, quantiles, ratio_q, run_ranks, time_interleaved
)

SHAPES = {
    # name: (LlamaConfig kwargs, (batch, seq))
    "small": (dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                   intermediate_size=688, vocab_size=4096), (4, 128)),
    "large": (dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                   intermediate_size=1408, vocab_size=8192), (2, 256)),
}
# transformers' TP loading path requires accelerate (see the module docstring).
VARIANTS = ("shardkit", "hf", "dtensor") if importlib.util.find_spec("accelerate") else ("shardkit", "dtensor")
CHECKED = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
           "model.layers.1.self_attn.o_proj.weight", "model.layers.3.mlp.down_proj.weight",
           "model.layers.2.mlp.up_proj.weight", "model.norm.weight", "lm_head.weight")


def _config(shape: str):
    import transformers as tf

    cfg = tf.LlamaConfig(**SHAPES[shape][0], use_cache=False, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    return cfg


def _load(path: str, **kwargs):
    import transformers as tf

    return tf.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa", **kwargs)


def _build(variant: str, path: str, pg):
    """This rank's sharded model for ``variant`` (every rank loads the same checkpoint)."""
    if variant == "shardkit":
        from shardkit import apply_tp

        return apply_tp(_load(path), pg, check="off")  # the norms stay replicated by design
    if variant == "hf":
        from transformers.distributed import DistributedConfig

        return _load(path, distributed_config=DistributedConfig(tp_size=dist.get_world_size(pg)))
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _load(path)
    mesh = DeviceMesh.from_group(pg, "cpu", mesh_dim_names=("tp",))
    layer_plan = {f"self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")}
    layer_plan.update({"self_attn.o_proj": RowwiseParallel(), "mlp.gate_proj": ColwiseParallel(),
                       "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()})
    for layer in model.model.layers:
        parallelize_module(layer, mesh, layer_plan)
    parallelize_module(model, mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
    return model


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _gathered(variant: str, model, grads: bool) -> dict[str, torch.Tensor]:
    if variant == "shardkit":
        from shardkit.tensor_parallel import gather_full_grads, gather_full_state_dict

        full = gather_full_grads(model) if grads else gather_full_state_dict(model)
        return {n: full[n] for n in CHECKED}
    params = dict(model.named_parameters())
    return {n: _full(params[n].grad if grads else params[n]).detach().clone() for n in CHECKED}


def _prepare(shape: str, path: str, pg):
    """The three variants' step callables; checks their first step agrees."""
    rank = dist.get_rank(pg)
    batch, seq = SHAPES[shape][1]
    ids = torch.randint(0, SHAPES[shape][0]["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(1))
    models, opts, steps = {}, {}, {}
    for v in VARIANTS:
        models[v] = _build(v, path, pg)
        models[v].train()
        opts[v] = torch.optim.AdamW(models[v].parameters(), lr=1e-4, foreach=False)

    def make_step(v):
        model, opt = models[v], opts[v]

        def step():
            opt.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            return loss.detach()
        return step

    losses, grads, params = {}, {}, {}
    for v in VARIANTS:
        opt, model = opts[v], models[v]
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses[v] = _full(loss.detach()).item()
        grads[v] = _gathered(v, model, True)
        opt.step()
        params[v] = _gathered(v, model, False)
        steps[v] = make_step(v)
    bad = []
    for v in VARIANTS[1:]:
        if abs(losses[v] - losses["shardkit"]) > 1e-4 * abs(losses["shardkit"]):
            bad.append(f"loss {v} {losses[v]} vs shardkit {losses['shardkit']}")
        for kind, d in (("grad", grads), ("param", params)):
            for n in CHECKED:
                a, b = d["shardkit"][n], d[v][n]
                if a.shape != b.shape or not torch.allclose(a, b, rtol=1e-3, atol=1e-5 * b.abs().max().item()):
                    bad.append(f"{kind} {n}: shardkit vs {v} max diff "
                               f"{(a - b).abs().max().item() if a.shape == b.shape else (a.shape, b.shape)}")
    ok = torch.tensor([0 if bad else 1])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=pg)
    if bad or ok.item() == 0:
        raise AssertionError(f"rank {rank}: {shape}: variants disagree: {bad or 'on another rank'}")
    return steps, losses["shardkit"]


def _profile(fns: dict, pg, shape: str, rank: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    for v in VARIANTS:
        dist.barrier(group=pg)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fns[v]()
        if rank == 0:
            print(f"\n=== profile {shape} {v} (rank 0, one step) ===", file=sys.stderr)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), file=sys.stderr, flush=True)


def _body(rank: int, pg, args, ckpts: dict) -> list[dict]:
    nproc = dist.get_world_size(pg)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc))  # read by transformers' TP
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    results = []
    for shape in args.shapes:
        t0 = time.perf_counter()
        steps, loss = _prepare(shape, ckpts[shape], pg)
        if args.profile:
            _profile(steps, pg, shape, rank)
        times = time_interleaved(steps, pg, args.warmup, args.rounds)
        results.append(dict(shape=shape, loss=loss, times_s=times))
        if rank == 0:
            print(f"R={nproc} {shape}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        del steps
    return results


def summarize(nproc: int, results: list[dict]) -> list[dict]:
    rows = []
    for res in results:
        t = res["times_s"]
        rows.append(dict(
            nproc=nproc, shape=res["shape"], loss=res["loss"],
            ms={v: quantiles([1e3 * x for x in t[v]], DECILES)["median"] for v in VARIANTS},
            **{f"shardkit_over_{v}": ratio_q(t["shardkit"], t[v], DECILES) for v in VARIANTS[1:]},
        ))
    return rows


def render(rows: list[dict], args, elapsed: float) -> None:
    print(f"TP training step (fwd + bwd + AdamW), LlamaForCausalLM float32, gloo, {args.rounds} rounds after "
          f"{args.warmup} warm-up, median [p10, p90] of per-round ratios, {elapsed:.0f} s")
    for name in args.shapes:
        (cfg, (b, s)) = SHAPES[name]
        print(f"  {name}: hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, heads "
              f"{cfg['num_attention_heads']}/{cfg['num_key_value_heads']}, intermediate {cfg['intermediate_size']}, "
              f"vocab {cfg['vocab_size']}, batch {b} x seq {s}")
    if "hf" not in VARIANTS:
        print("  (hf column left out: transformers' tp_plan loading needs accelerate, see the docstring)")
    print_row("R", "shape", *(f"{v} ms" for v in VARIANTS), *(f"shardkit/{v}" for v in VARIANTS[1:]))
    for r in rows:
        print_row(str(r["nproc"]), r["shape"], *(f"{r['ms'][v]:.1f}" for v in VARIANTS),
                  *(cell(r[f"shardkit_over_{v}"]) for v in VARIANTS[1:]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", default="2,4", help="comma-separated world sizes, e.g. 2,4")
    p.add_argument("--shapes", help=f"comma-separated, of {list(SHAPES)} (default: all; small with --quick)")
    add_timing_args(p)
    p.add_argument("--quick", action="store_true", help="10 rounds after 2 warm-up, small shape by default")
    p.add_argument("--profile", action="store_true", help="print a torch.profiler table of one step per variant")
    p.add_argument("--json", metavar="PATH", help="write the per-round times and the summary as JSON")
    args = p.parse_args(argv)
    args.shapes = args.shapes.split(",") if args.shapes else (["small"] if args.quick else list(SHAPES))
    if args.quick:
        args.rounds, args.warmup = 10, 2
    elif args.rounds < 40 or args.warmup < 5:
        p.error("docs/design.md, Benchmarks: at least 40 rounds after at least 5 warm-up rounds (or --quick)")
    if any(s not in SHAPES for s in args.shapes):
        p.error(f"--shapes: choose from {list(SHAPES)}")
    import transformers as tf

    tf.utils.logging.disable_progress_bar()
    t0 = time.perf_counter()
    rows, raw = [], []
    with tempfile.TemporaryDirectory(prefix="shardkit-bench-tp-") as tmp:
        ckpts = {}
        for shape in args.shapes:  # one checkpoint per shape: every variant on every rank loads it
            torch.manual_seed(0)
            ckpts[shape] = os.path.join(tmp, shape)
            tf.LlamaForCausalLM(_config(shape)).save_pretrained(ckpts[shape])
        for nproc in (int(n) for n in args.nproc.split(",")):
            results = run_ranks(_body, nproc, args, ckpts, prefix="shardkit-bench-tp-", timeout_s=600)
            rows += summarize(nproc, results)
            raw.append(dict(nproc=nproc, results=results))
    render(rows, args, time.perf_counter() - t0)
    dump_json(args.json, dict(rounds=args.rounds, warmup=args.warmup, summary=rows, raw=raw))
    return 0


if __name__ == "__main__":  # spawned ranks re-import this file; only the parent runs
    sys.exit(main())
