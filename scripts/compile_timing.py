"""Compile time and step time of ``parallelize(..., compile=BACKEND)`` against eager, at tp 2 on CPU (issue 22).

Two gloo ranks (spawned here) build the same small float32 Llama (the trainer's builder), parallelize
it at tp 2 with sequence parallelism, eagerly and then with each backend, and time forward +
backward + an SGD step. The first compiled step pays for the compilation: ``compile s`` is that
step minus the backend's median step. ``ratio`` is the backend's median step over eager's (below
1: compiled is faster). Rank 0 prints the table and the machine's load average (the numbers on a
loaded machine are noisy: read the ratio, not the milliseconds).

Usage: ``python scripts/compile_timing.py [--backends aot_eager inductor] [--steps 10] [--hidden 128]``.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch and shardkit are imported where they are used, so that --help answers before torch is
# imported (seconds of CPU; tests/test_scripts.py checks the imports)


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", nargs="+", default=["aot_eager", "inductor"], help="torch.compile backends")
    p.add_argument("--steps", type=int, default=10, help="timed steps per backend after the first (default 10)")
    p.add_argument("--hidden", type=int, default=128, help="hidden size (default 128; intermediate 4x)")
    p.add_argument("--layers", type=int, default=4, help="decoder blocks (default 4)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--batch", type=int, default=4, help="sequences per step (default 4)")
    return p.parse_args(argv)


def _step(pm, ids: torch.Tensor, opt: torch.optim.Optimizer) -> float:
    t0 = time.perf_counter()
    pm.module(input_ids=ids).logits.float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def _run(backend: str | bool, args: argparse.Namespace) -> tuple[float, float]:
    """(first step s, median step s) of one backend (False: eager)."""
    import torch
    import torch.distributed as dist

    from shardkit.parallelize import parallelize
    from shardkit.sharding import ParallelDims
    from shardkit.train.config import TrainConfig
    from shardkit.train.specs import model_spec

    cfg = TrainConfig(
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        layers=args.layers,
        heads=4,
        kv_heads=2,
        seq_len=args.seq_len,
        dtype="float32",
    )
    mesh = ParallelDims(tp=2).build_mesh("cpu")
    pm = parallelize(model_spec("llama").build(cfg), mesh, sequence_parallel=True, compile=backend)
    ids = torch.randint(0, 256, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.SGD(pm.module.parameters(), lr=1e-3)
    dist.barrier()
    first = _step(pm, ids, opt)
    times = []
    for _ in range(args.steps):
        dist.barrier()
        times.append(_step(pm, ids, opt))
    # the slower rank sets the step
    out = torch.tensor([first, statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out[0].item(), out[1].item()


def _worker(rank: int, port: int, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        rows = [("eager", *_run(False, args))]
        for backend in args.backends:
            torch._dynamo.reset()
            rows.append((backend, *_run(backend, args)))
        if rank == 0:
            eager = rows[0][2]
            print(f"tp 2 (SP), llama hidden {args.hidden} x {args.layers} blocks, batch {args.batch} x {args.seq_len}")
            print(f"load average (1, 5, 15 min): {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
            print("| backend | first step s | compile s | median step ms | ratio compiled / eager |")
            print("|---|---|---|---|---|")
            for name, first, med in rows:
                compile_s = f"{first - med:.1f}" if name != "eager" else "-"
                print(f"| {name} | {first:.2f} | {compile_s} | {1e3 * med:.1f} | {med / eager:.2f} |")
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, args), nprocs=2)


if __name__ == "__main__":
    main()
