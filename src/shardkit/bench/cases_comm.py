"""Communication cases: collectives and pipeline P2P, each against the bare c10d call moving the
same bytes (docs/design.md (Benchmarks))."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from .. import all_gather, reduce_scatter
from ..comm import all_reduce_forward
from ..comm._compat import all_gather_single, reduce_scatter_single
from ..pipeline_parallel import ShapeCache, recv_forward, send_forward
from ._method import Record, Settings, agree, same_bits, time_interleaved

__all__ = ["collectives", "p2p"]

KIB, MIB = 1 << 10, 1 << 20


def _sizes(settings: Settings, quick, full):
    return quick if settings.quick else full


def collectives(pg, settings: Settings) -> list[Record]:
    """all_reduce / all_gather / reduce_scatter (dim 0, float32) against the bare c10d call on
    preallocated buffers. Bytes = the per-rank input; nccl-tests factors 2(n-1)/n and (n-1)/n.

    ``all_gather`` is timed with its sizes given (what shardkit's layers pass: no metadata) and,
    as ``learned``, without them: every rank's size is then learned by one small metadata
    all-gather per call (``learned/bare``, no goal)."""
    rank, n, dev = dist.get_rank(pg), dist.get_world_size(pg), settings.torch_device
    records = []
    for nbytes in _sizes(settings, (16 * KIB, 1 * MIB), (16 * KIB, 64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB)):
        rows = nbytes // 4 // 64
        base = torch.arange(rows * 64, dtype=torch.float32, device=dev).reshape(rows, 64)
        x = base + 1000 * rank
        full = torch.cat([base + 1000 * r for r in range(n)])
        gathered, scattered = torch.empty_like(full), torch.empty(rows, 64, device=dev)
        big = full.clone()  # reduce_scatter input: n blocks of the local size
        ar_buf = x.clone()
        fns = {
            "all_reduce/shardkit": lambda: all_reduce_forward(x, pg),
            "all_reduce/bare": lambda: dist.all_reduce(ar_buf.copy_(x), group=pg),
            "all_gather/shardkit": lambda: all_gather(x, pg, 0, [rows] * n),
            "all_gather/learned": lambda: all_gather(x, pg, 0),
            "all_gather/bare": lambda: all_gather_single(gathered, x, group=pg),
            "reduce_scatter/shardkit": lambda: reduce_scatter(big, pg, 0),
            "reduce_scatter/bare": lambda: reduce_scatter_single(scattered, big, group=pg),
        }
        failures = []
        if not torch.equal(fns["all_reduce/shardkit"](), functools.reduce(torch.add, full.chunk(n))):
            failures.append("all_reduce != sum of the inputs")
        if not (same_bits(fns["all_gather/shardkit"](), full) and same_bits(fns["all_gather/learned"](), full)):
            failures.append("all_gather != concatenated inputs")
        rs = fns["reduce_scatter/shardkit"]()
        fns["reduce_scatter/bare"]()
        if not torch.equal(rs, full.chunk(n)[rank] * n) or not torch.equal(rs, scattered):
            failures.append("reduce_scatter != n x this rank's block / bare reduce_scatter_tensor")
        agree(failures, pg, f"collectives {nbytes} B")
        times = time_interleaved(fns, pg, settings)
        for op, factor in (
            ("all_reduce", 2 * (n - 1) / n),
            ("all_gather", (n - 1) / n),
            ("reduce_scatter", (n - 1) / n),
        ):
            sub = {k.split("/")[1]: v for k, v in times.items() if k.startswith(op + "/")}
            # nccl-tests sizes: all_gather counts the gathered output, reduce_scatter its input.
            size = {"all_reduce": nbytes, "all_gather": nbytes * n, "reduce_scatter": nbytes * n}[op]
            rec = Record(
                op,
                dict(bytes=nbytes, shape=list(x.shape)),
                n,
                sub,
                busbw={"shardkit": (size, factor), "bare": (size, factor)},
                checked="bitwise against the expected sum / concatenation / bare reduce_scatter_tensor",
            )
            records.append(rec.ratio("shardkit/bare", "shardkit", "bare", 1.1))
            if "learned" in sub:
                rec.ratio("learned/bare", "learned", "bare")
    return records


def p2p(pg, settings: Settings) -> list[Record]:
    """Pipeline ``send_forward`` / ``recv_forward`` stage 0 -> 1 against bare ``isend`` /
    ``irecv``: ``static`` (shape and dtype declared on both ends), ``dynamic`` (negotiated every
    time: a header round trip) and ``cached`` (negotiated once per distinct shape: a
    :class:`~shardkit.pipeline_parallel.ShapeCache` on each end).
    An op is ``reps`` transfers in a row (reported per transfer); send/recv bus factor 1."""

    rank, n, dev = dist.get_rank(pg), dist.get_world_size(pg), settings.torch_device
    records = []
    for nbytes in _sizes(settings, (16 * KIB, 1 * MIB), (16 * KIB, 256 * KIB, 1 * MIB, 8 * MIB)):
        shape = (nbytes // 4 // 64, 64)
        x = torch.arange(shape[0] * shape[1], dtype=torch.float32, device=dev).reshape(shape)

        def bare():
            if rank == 0:
                return dist.isend(x, 1, group=pg).wait()
            buf = torch.empty(shape, dtype=torch.float32, device=dev)
            dist.irecv(buf, 0, group=pg).wait()
            return buf

        def static():
            if rank == 0:
                return send_forward(x, pg, shape=shape, dtype=torch.float32)
            return recv_forward(pg, shape=shape, dtype=torch.float32)

        def dynamic():
            return send_forward(x, pg) if rank == 0 else recv_forward(pg)

        cache = ShapeCache()

        def cached():
            return send_forward(x, pg, shape_cache=cache) if rank == 0 else recv_forward(pg, shape_cache=cache)

        fns = dict(bare=bare, static=static, dynamic=dynamic, cached=cached)
        failures = []
        for k, fn in fns.items():
            got = fn()
            if rank == 1 and not same_bits(got, x):
                failures.append(f"{k}: the received tensor differs from the sent one")
        agree(failures, pg, f"p2p {nbytes} B")
        reps = max(1, min(20, (32 * MIB) // (nbytes * 8)))
        times = time_interleaved(fns, pg, settings, reps)
        rec = Record(
            "p2p",
            dict(bytes=nbytes, reps=reps, shape=list(shape)),
            n,
            times,
            busbw={k: (nbytes, 1.0) for k in fns},
            checked="received tensors bitwise equal to the sent one",
        )
        rec.ratio("static/bare", "static", "bare", 1.25 if nbytes <= 64 * KIB else 1.05)
        rec.ratio("cached/bare", "cached", "bare", 1.3 if nbytes <= 64 * KIB else 1.1)  # issue 24: 1.1 from 256 KiB
        rec.ratio("dynamic/bare", "dynamic", "bare")
        records.append(rec)
    return records
