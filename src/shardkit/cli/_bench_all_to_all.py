"""Per-rank body of the paired, interleaved ``all_to_all`` benchmark (docs/design.md, Benchmarks).

Runs inside an initialized process group. For every (size, direction) it builds six variants,
shardkit / bare / list+cat at aligned and unaligned head counts, checks them bitwise, then times
them interleaved in one loop so that every round yields paired ratios. Nothing here prints or
formats; :mod:`shardkit.cli.bench` launches the ranks and reports.

Variants (the local input is ``[B, S / R, N, D]`` or ``[B, S, N / R, D]``):

- ``shardkit``: :func:`shardkit.all_to_all` (one ``all_to_all_single`` plus at most one layout
  copy per side).
- ``bare``: ``all_to_all_single`` alone on a send buffer laid out in advance and a
  preallocated receive buffer: the floor for one c10d call moving the same bytes.
- ``listcat``: the MindSpeed-MM unaligned path: per-destination chunks from
  ``torch.split(...).contiguous()``, list ``all_to_all`` into fresh outputs, ``torch.cat`` along
  the gather dim, ``.contiguous()``.
"""

from __future__ import annotations

import math
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from .. import all_to_all, balanced_split_sizes
from .._shapes import split_offsets

__all__ = ["DIRECTIONS", "BenchConfig", "Case", "run_cases"]

# name -> (scatter_dim, gather_dim) on a [B, S, N, D] layout.
DIRECTIONS = {
    "heads": (2, 1),  # scatter heads / gather sequence: [B, S/R, N, D] -> [B, S, N/R, D]
    "seq": (1, 2),  # scatter sequence / gather heads:  [B, S, N/R, D] -> [B, S/R, N, D]
}
IMPLS = ("shardkit", "bare", "listcat")
ELEMENT_BYTES = 4  # float32


@dataclass(frozen=True)
class BenchConfig:
    """Everything the ranks need; picklable so it crosses the process boundary."""

    sizes: tuple[int, ...]  # target bytes of the local input at the aligned head count
    directions: tuple[str, ...]
    rounds: int
    warmup: int
    nproc: int
    heads: int  # aligned head count (divisible by nproc)
    unaligned_heads: int
    head_dim: int = 64
    batch: int = 1
    progress: bool = True


@dataclass(frozen=True)
class Case:
    """One benchmarked layout switch: global ``[B, S, N, D]``, scattered and gathered dims."""

    size: int
    direction: str
    batch: int
    seq: int
    heads: int
    head_dim: int

    @property
    def dims(self) -> tuple[int, int]:
        return DIRECTIONS[self.direction]

    @property
    def global_shape(self) -> list[int]:
        return [self.batch, self.seq, self.heads, self.head_dim]


def global_seq(cfg: BenchConfig, size: int, direction: str) -> int:
    """Global sequence length whose aligned local input has ``size`` bytes (at least R)."""
    per_token = cfg.batch * cfg.heads * cfg.head_dim * ELEMENT_BYTES  # one full-heads row
    if direction == "heads":  # local [B, S/R, N, D]
        return max(1, size // per_token) * cfg.nproc
    return max(cfg.nproc, size * cfg.nproc // per_token)  # local [B, S, N/R, D]


def make_cases(cfg: BenchConfig, size: int, direction: str) -> tuple[Case, Case]:
    """The aligned and unaligned case of one (size, direction), at the same sequence length."""
    seq = global_seq(cfg, size, direction)
    return tuple(Case(size, direction, cfg.batch, seq, n, cfg.head_dim) for n in (cfg.heads, cfg.unaligned_heads))


def _block(t: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    """Block ``rank`` of ``t`` along ``dim`` under the balanced split, contiguous."""
    sizes = balanced_split_sizes(t.shape[dim], world)
    return t.narrow(dim, split_offsets(sizes)[rank], sizes[rank]).contiguous()


def _with_dim(shape, dim: int, size: int) -> list[int]:
    out = list(shape)
    out[dim] = size
    return out


def list_all_to_all(outputs: list, inputs: list, pg, rank: int) -> None:
    """List all-to-all: ``dist.all_to_all`` where gloo takes it, grouped send/recv otherwise.

    gloo rejects a list all-to-all whose tensors differ in shape (every unaligned case), so there
    it runs as the per-peer send/recv pairs that NCCL's list all-to-all is made of, with the
    block for this rank copied locally.
    """
    if len({t.shape for t in (*inputs, *outputs)}) == 1:
        dist.all_to_all(outputs, inputs, group=pg)
        return
    ops = []
    for peer in range(len(inputs)):
        if peer != rank:
            dst = dist.get_global_rank(pg, peer)
            ops += [dist.P2POp(dist.isend, inputs[peer], dst, pg), dist.P2POp(dist.irecv, outputs[peer], dst, pg)]
    outputs[rank].copy_(inputs[rank])
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def list_all_to_all_cat(x, pg, rank, scatter_dim, gather_dim, scatter_sizes, gather_sizes) -> torch.Tensor:
    """Reference (b): MindSpeed-MM's unaligned path, list all-to-all then ``torch.cat``."""
    inputs = [c.contiguous() for c in torch.split(x, scatter_sizes, dim=scatter_dim)]
    local = _with_dim(x.shape, scatter_dim, scatter_sizes[rank])
    outputs = [x.new_empty(_with_dim(local, gather_dim, n)) for n in gather_sizes]
    list_all_to_all(outputs, inputs, pg, rank)
    return torch.cat(outputs, dim=gather_dim).contiguous()


@dataclass
class Prepared:
    """A case on this rank: its input, the expected output and the three timed callables."""

    case: Case
    x: torch.Tensor
    expected: torch.Tensor
    group_bytes: int  # local input bytes summed over ranks
    fns: dict[str, Callable[[], object]]
    bare_send: torch.Tensor
    bare_recv: torch.Tensor
    bare_splits: tuple[list[int], list[int]]  # (output, input) split sizes in elements
    listcat_transport: str  # what list_all_to_all runs on gloo for this case


def prepare(case: Case, pg, rank: int, world: int) -> Prepared:
    """Input, expected output, pre-laid buffers and the three variants of ``case`` on this rank.

    The input is block ``rank`` of a seeded global tensor along the gather dim; the expected
    output is block ``rank`` of the same tensor along the scatter dim.
    """
    s, g = case.dims
    gen = torch.Generator().manual_seed(1234 + case.seq * 31 + case.heads)
    full = torch.randn(case.global_shape, generator=gen)
    x, expected = _block(full, g, rank, world), _block(full, s, rank, world)
    del full
    gather_size = case.global_shape[g]
    scatter_sizes, gather_sizes = balanced_split_sizes(x.shape[s], world), balanced_split_sizes(gather_size, world)
    # Pre-laid send buffer: block j (along the scatter dim) for rank j, one after another.
    send = torch.cat([c.reshape(-1) for c in torch.split(x, scatter_sizes, dim=s)])
    local = _with_dim(x.shape, s, scatter_sizes[rank])
    in_splits = [math.prod(_with_dim(x.shape, s, n)) for n in scatter_sizes]
    out_splits = [math.prod(_with_dim(local, g, n)) for n in gather_sizes]
    recv = x.new_empty(sum(out_splits))
    total = torch.tensor([x.nbytes], dtype=torch.int64)
    dist.all_reduce(total, group=pg)
    fns = {
        "shardkit": lambda: all_to_all(x, pg, s, g, gather_size),
        "bare": lambda: dist.all_to_all_single(recv, send, out_splits, in_splits, group=pg),
        "listcat": lambda: list_all_to_all_cat(x, pg, rank, s, g, scatter_sizes, gather_sizes),
    }
    even = len(set(scatter_sizes)) == len(set(gather_sizes)) == 1  # then every list chunk has one shape
    transport = "all_to_all" if even else "batch_isend_irecv"
    return Prepared(case, x, expected, int(total.item()), fns, send, recv, (out_splits, in_splits), transport)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (``torch.equal`` would accept ``-0.0 == 0.0``)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
    )


@contextmanager
def _capture_all_to_all_single(calls: list):
    """Record ``(send copy, recv, output_splits, input_splits)`` of every ``all_to_all_single``."""
    original = dist.all_to_all_single

    def spy(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        work = original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
        calls.append((input.clone(), output, list(output_split_sizes or []), list(input_split_sizes or [])))
        return work

    dist.all_to_all_single = spy
    try:
        yield calls
    finally:
        dist.all_to_all_single = original


def check(p: Prepared, pg) -> None:
    """Bitwise checks before timing, agreed across ranks so that all raise together.

    shardkit must equal the expected block and reference (b); it must issue exactly one
    ``all_to_all_single``, whose send buffer and split sizes equal the pre-laid ones of (a),
    and (a) must receive exactly what shardkit received.
    """
    calls: list = []
    with _capture_all_to_all_single(calls):
        y = p.fns["shardkit"]()
    ref = p.fns["listcat"]()
    p.fns["bare"]()
    failures = []
    if not _same_bits(y, p.expected):
        failures.append("shardkit != expected block")
    if not _same_bits(y, ref):
        failures.append("shardkit != list+cat reference")
    if len(calls) != 1:
        failures.append(f"shardkit issued {len(calls)} all_to_all_single calls, expected 1")
    else:
        sent, received, out_splits, in_splits = calls[0]
        if not _same_bits(sent, p.bare_send):
            failures.append("shardkit send buffer != bare pre-laid buffer")
        if (out_splits, in_splits) != p.bare_splits:
            failures.append(f"split sizes {(out_splits, in_splits)} != bare {p.bare_splits}")
        if not _same_bits(received, p.bare_recv):
            failures.append("bare receive buffer != shardkit receive buffer")
    ok = torch.tensor([0 if failures else 1], dtype=torch.int64)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=pg)
    if failures or ok.item() == 0:
        raise AssertionError(f"rank {dist.get_rank(pg)}: {p.case}: {'; '.join(failures) or 'another rank failed its check'}")


def time_interleaved(fns: dict[str, Callable[[], object]], pg, warmup: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per op and round, max over ranks; variants interleaved, order alternating."""
    names = list(fns)
    times = torch.zeros(rounds, len(names), dtype=torch.float64)
    for i in range(warmup + rounds):
        order = range(len(names)) if i % 2 == 0 else reversed(range(len(names)))
        for j in order:
            fn = fns[names[j]]
            dist.barrier(group=pg)
            t0 = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - t0
            if i >= warmup:
                times[i - warmup, j] = elapsed
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=pg)  # per-op time = slowest rank
    return {name: times[:, j].tolist() for j, name in enumerate(names)}


def run_pair(cfg: BenchConfig, size: int, direction: str, pg) -> dict:
    """Check and time the aligned and unaligned cases of one (size, direction) together."""
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    prepared = [prepare(c, pg, rank, world) for c in make_cases(cfg, size, direction)]
    for p in prepared:
        check(p, pg)
    labels = ("aligned", "unaligned")
    fns = {f"{impl}/{label}": p.fns[impl] for label, p in zip(labels, prepared) for impl in IMPLS}
    times = time_interleaved(fns, pg, cfg.warmup, cfg.rounds)
    return {
        "size": size,
        "direction": direction,
        "scatter_dim": DIRECTIONS[direction][0],
        "gather_dim": DIRECTIONS[direction][1],
        "nproc": world,
        **{
            label: {
                "shape_global": p.case.global_shape,
                "shape_local": list(p.x.shape),  # this rank's (rank 0's) input
                "bytes_local": p.x.nbytes,
                "bytes_group": p.group_bytes,
                "listcat_transport": p.listcat_transport,
                "times_s": {impl: times[f"{impl}/{label}"] for impl in IMPLS},
            }
            for label, p in zip(labels, prepared)
        },
    }


def run_cases(cfg: BenchConfig, pg) -> list[dict]:
    """Every (size, direction) pair in turn; rank 0 reports progress on stderr."""
    pairs = [(size, d) for size in cfg.sizes for d in cfg.directions]
    results = []
    for k, (size, direction) in enumerate(pairs, 1):
        t0 = time.perf_counter()
        results.append(run_pair(cfg, size, direction, pg))
        if cfg.progress and dist.get_rank(pg) == 0:
            print(f"[{k}/{len(pairs)}] {size / 1024:g} KiB, scatter {direction}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return results
