"""Where the time of a shardkit call goes above the bare c10d call, on gloo with 2 ranks (issue 24).

Every variant of a size runs in the same rounds, interleaved with alternating order after a
barrier (as ``shardkit bench``); reported: the median time per call (max over ranks), the median
[p10, p90] of per-round ratios to ``bare``, and the median main-thread CPU time per call on each
rank (``time.thread_time``: the host work, less sensitive to other processes than wall time).

p2p (``send_forward`` / ``recv_forward`` stage 0 -> 1, float32):
  bare    isend / irecv into a fresh buffer (the bench's floor)
  two     the header protocol's floor as two messages: a 64-byte header and the payload, posted together
  packed  its floor as one message: header + payload copied into a reused buffer, one receive
  static  shardkit with declared shape and dtype (no header)
  cached  shardkit with a ShapeCache (a repeated shape: header + payload, packed up to PACK_MAX_BYTES)

all_gather (dim 0, sizes given, float32 rows of 64):
  bare      all_gather_into_tensor into a preallocated output (the bench's floor)
  fresh     the same into a new output per call (shardkit's contract: it returns a new tensor)
  shardkit  all_gather(x, pg, 0, sizes)

Run: ``PYTHONPATH=src python scripts/comm_floor.py --case p2p --sizes 256,1024 --rounds 200``.
"""

from __future__ import annotations

import argparse
import os
import socket
import time


def _p2p_fns(rank: int, nbytes: int, pg):
    import torch
    import torch.distributed as dist

    from shardkit.pipeline_parallel import ShapeCache, recv_forward, send_forward

    shape = (nbytes // 256, 64)
    x = torch.arange(shape[0] * 64, dtype=torch.float32).reshape(shape)
    hdr = torch.zeros(8, dtype=torch.int64)
    packed = torch.empty(64 + nbytes, dtype=torch.uint8)
    cache = ShapeCache()

    def bare():
        if rank == 0:
            return dist.isend(x, 1, group=pg).wait()
        buf = torch.empty(shape)
        dist.irecv(buf, 0, group=pg).wait()
        return buf

    def two():
        if rank == 0:
            works = [dist.isend(hdr, 1, group=pg), dist.isend(x, 1, group=pg)]
        else:
            works = [
                dist.irecv(torch.empty(8, dtype=torch.int64), 0, group=pg),
                dist.irecv(torch.empty(shape), 0, group=pg),
            ]
        for w in works:
            w.wait()

    def one():
        if rank == 0:
            packed[64:].view(torch.float32).view(shape).copy_(x)
            return dist.isend(packed, 1, group=pg).wait()
        buf = torch.empty(64 + nbytes, dtype=torch.uint8)
        dist.irecv(buf, 0, group=pg).wait()
        return buf[64:].view(torch.float32).view(shape)

    def static():
        if rank == 0:
            return send_forward(x, pg, shape=shape, dtype=torch.float32)
        return recv_forward(pg, shape=shape, dtype=torch.float32)

    def cached():
        return send_forward(x, pg, shape_cache=cache) if rank == 0 else recv_forward(pg, shape_cache=cache)

    reps = max(1, min(20, (32 << 20) // (nbytes * 8)))  # as the bench's p2p case
    return dict(bare=bare, two=two, packed=one, static=static, cached=cached), reps


def _all_gather_fns(rank: int, nbytes: int, pg):
    import torch
    import torch.distributed as dist

    from shardkit import all_gather

    rows = nbytes // 256
    x = torch.randn(rows, 64) + rank
    out = torch.empty(2 * rows, 64)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return dict(
        bare=lambda: gather(out, x, group=pg),
        fresh=lambda: gather(torch.empty(2 * rows, 64), x, group=pg),
        shardkit=lambda: all_gather(x, pg, 0, [rows, rows]),
    ), 1


def _worker(rank: int, case: str, sizes: list[int], rounds: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # as the bench: 2 ranks on few cores
    dist.init_process_group("gloo", rank=rank, world_size=2)
    pg = dist.group.WORLD
    for nbytes in sizes:
        fns, reps = (_p2p_fns if case == "p2p" else _all_gather_fns)(rank, nbytes, pg)
        for fn in fns.values():  # warm-up; a ShapeCache negotiates here
            fn()
        names = list(fns)
        wall = torch.zeros(rounds, len(names), dtype=torch.float64)
        cpu = torch.zeros_like(wall)
        for i in range(rounds):
            for j in range(len(names)) if i % 2 == 0 else reversed(range(len(names))):
                dist.barrier(group=pg)
                t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
                for _ in range(reps):
                    fns[names[j]]()
                wall[i, j] = (time.perf_counter_ns() - t0) / 1e3 / reps
                cpu[i, j] = (time.thread_time_ns() - c0) / 1e3 / reps
        cpus = [torch.zeros_like(cpu) for _ in range(2)]
        dist.all_gather(cpus, cpu, group=pg)
        dist.all_reduce(wall, op=dist.ReduceOp.MAX, group=pg)
        if rank == 0:
            print(f"{case} {nbytes >> 10} KiB, {reps} call(s) per round, {rounds} rounds")
            for j, name in enumerate(names):
                r = wall[:, j] / wall[:, 0]
                q = [r.quantile(p).item() for p in (0.5, 0.1, 0.9)]
                c = "/".join(f"{t[:, j].median().item():.0f}" for t in cpus)
                t = wall[:, j].median().item()
                print(f"  {name:9s} {t:8.0f} us  x{q[0]:.3f} [{q[1]:.2f}, {q[2]:.2f}]  cpu {c} us")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=("p2p", "all_gather"), default="p2p")
    parser.add_argument("--sizes", default=None, help="KiB per rank, comma-separated (default 256,1024 / 16,64)")
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    import torch.multiprocessing as mp

    sizes = args.sizes or ("256,1024" if args.case == "p2p" else "16,64")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(args.case, [int(k) * 1024 for k in sizes.split(",")], args.rounds, port), nprocs=2)


if __name__ == "__main__":
    main()
