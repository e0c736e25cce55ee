"""The Ulysses all-to-all case: :func:`shardkit.all_to_all` against the bare call on a pre-laid
buffer and against list all-to-all + ``torch.cat``; uneven head counts against even per byte.

Variants on a local ``[B, S / R, N, D]`` (scatter heads, gather sequence) or ``[B, S, N / R, D]``
(scatter sequence, gather heads) float32 input:

- ``shardkit``: one ``all_to_all_single`` plus at most one layout copy per side;
- ``bare``: ``all_to_all_single`` alone on a send buffer laid out in advance and a preallocated
  receive buffer: the floor for one c10d call moving the same bytes;
- ``floor``: what any implementation of the layout change must do at least: one layout copy of
  the input into a send buffer (``torch.cat`` of the per-destination blocks) and the bare call
  into a freshly allocated output. shardkit makes the same single copy, on whichever side its
  layout needs it (``docs/guides/comm.md``, copies table), so ``shardkit/floor`` is its overhead;
- ``listcat``: MindSpeed-MM's unaligned path: per-destination ``split(...).contiguous()``, list
  all-to-all into fresh outputs, ``torch.cat`` along the gather dim.

Checked bitwise before timing: shardkit equals the expected block and list+cat, issues exactly
one ``all_to_all_single`` whose send buffer and splits equal the pre-laid ones, and the bare call
and the floor receive the same bytes.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.distributed as dist

from .. import all_to_all, balanced_split_sizes
from .._shapes import split_offsets
from ._method import Record, Settings, agree, same_bits, time_interleaved

__all__ = ["all_to_all_case", "fused_projection", "list_all_to_all"]

DIRECTIONS = {"heads": (2, 1), "seq": (1, 2)}  # name -> (scatter_dim, gather_dim) of [B, S, N, D]
HEADS, UNEVEN_HEADS, HEAD_DIM = 16, 15, 64
KIB, MIB = 1 << 10, 1 << 20


def _block(t, dim, rank, world):
    sizes = balanced_split_sizes(t.shape[dim], world)
    return t.narrow(dim, split_offsets(sizes)[rank], sizes[rank]).contiguous()


def _with_dim(shape, dim, size):
    out = list(shape)
    out[dim] = size
    return out


def list_all_to_all(outputs: list, inputs: list, pg, rank: int) -> None:
    """``dist.all_to_all`` where gloo takes it; per-peer send/recv pairs (what NCCL's list
    all-to-all is made of) where the tensors differ in shape, which gloo rejects."""
    if len({t.shape for t in (*inputs, *outputs)}) == 1:
        dist.all_to_all(outputs, inputs, group=pg)
        return
    ops = []
    for peer in range(len(inputs)):
        if peer != rank:
            dst = dist.get_global_rank(pg, peer)
            ops += [dist.P2POp(dist.isend, inputs[peer], dst, pg), dist.P2POp(dist.irecv, outputs[peer], dst, pg)]
    outputs[rank].copy_(inputs[rank])
    for work in dist.batch_isend_irecv(ops) if ops else []:  # (a world of 1: no peers)
        work.wait()


@contextmanager
def _spy_all_to_all_single(calls: list):
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


def _prepare(seq: int, heads: int, direction: str, pg, dev: torch.device):
    """Input, expected output, the three variants and the bare call's buffers on this rank."""
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    s, g = DIRECTIONS[direction]
    gen = torch.Generator().manual_seed(1234 + seq * 31 + heads)
    full = torch.randn(1, seq, heads, HEAD_DIM, generator=gen).to(dev)
    x, expected = _block(full, g, rank, world), _block(full, s, rank, world)
    gather_size = full.shape[g]
    ssz, gsz = balanced_split_sizes(x.shape[s], world), balanced_split_sizes(gather_size, world)
    send = torch.cat([c.reshape(-1) for c in torch.split(x, ssz, dim=s)])  # pre-laid: block j for rank j
    local = _with_dim(x.shape, s, ssz[rank])
    in_splits = [math.prod(_with_dim(x.shape, s, k)) for k in ssz]
    out_splits = [math.prod(_with_dim(local, g, k)) for k in gsz]
    recv = x.new_empty(sum(out_splits))

    def floor():
        laid, out = torch.cat([c.reshape(-1) for c in torch.split(x, ssz, dim=s)]), x.new_empty(sum(out_splits))
        dist.all_to_all_single(out, laid, out_splits, in_splits, group=pg)
        return out

    def listcat():
        inputs = [c.contiguous() for c in torch.split(x, ssz, dim=s)]
        outputs = [x.new_empty(_with_dim(local, g, k)) for k in gsz]
        list_all_to_all(outputs, inputs, pg, rank)
        return torch.cat(outputs, dim=g)

    fns = {
        "shardkit": lambda: all_to_all(x, pg, s, g, gather_size),
        "bare": lambda: dist.all_to_all_single(recv, send, out_splits, in_splits, group=pg),
        "floor": floor,
        "listcat": listcat,
    }
    calls: list[tuple[torch.Tensor, torch.Tensor, list[int], list[int]]] = []
    with _spy_all_to_all_single(calls):
        y = fns["shardkit"]()
    ref = listcat()
    fns["bare"]()
    failures = []
    if not same_bits(y, expected) or not same_bits(y, ref):
        failures.append("shardkit != expected block / list+cat")
    want_calls = 1 if world > 1 else 0  # on one rank shardkit's all_to_all is the identity: no call
    if len(calls) != want_calls:
        failures.append(f"shardkit issued {len(calls)} all_to_all_single calls, expected {want_calls}")
    elif calls and (
        not same_bits(calls[0][0], send)
        or list(calls[0][2:]) != [out_splits, in_splits]
        or not same_bits(calls[0][1], recv)
    ):
        failures.append("shardkit's send buffer, splits or received bytes differ from the bare call's")
    if not same_bits(fns["floor"](), recv):
        failures.append("the floor's received bytes differ from the bare call's")
    agree(failures, pg, f"all_to_all S={seq} N={heads} {direction}")
    total = torch.tensor([x.nbytes], device=dev)
    dist.all_reduce(total, group=pg)
    return fns, list(full.shape), int(total.item())


def all_to_all_case(pg, settings: Settings) -> list[Record]:
    """Every (size, direction): aligned (N=16) and uneven (N=15) heads at the same S, eight
    variants interleaved; sizes are the aligned local input bytes."""
    world, dev = dist.get_world_size(pg), settings.torch_device
    sizes = (64 * KIB, 4 * MIB) if settings.quick else (16 * KIB, 64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB, 8 * MIB)
    records = []
    for size in sizes:
        for direction in DIRECTIONS:
            per_token = HEADS * HEAD_DIM * 4
            seq = max(1, size // per_token) * world if direction == "heads" else max(world, size * world // per_token)
            prepared = {
                lab: _prepare(seq, h, direction, pg, dev) for lab, h in (("even", HEADS), ("uneven", UNEVEN_HEADS))
            }
            fns = {f"{impl}/{lab}": f for lab, (fs, _, _) in prepared.items() for impl, f in fs.items()}
            times = time_interleaved(fns, pg, settings)
            for lab, (_, shape, group_bytes) in prepared.items():
                t = {impl: times[f"{impl}/{lab}"] for impl in ("shardkit", "bare", "floor", "listcat")}
                per_rank = group_bytes // world
                rec = Record(
                    "all_to_all",
                    dict(
                        bytes=size,
                        direction=direction,
                        heads=shape[2],
                        shape_global=shape,
                        label=f"{direction} N={shape[2]}",
                    ),
                    world,
                    t,
                    busbw={k: (per_rank, (world - 1) / world) for k in t},
                    checked="bitwise: expected block, list+cat, the bare call's buffers and splits",
                )
                rec.ratio("shardkit/bare", "shardkit", "bare", 1.5)
                rec.ratio("shardkit/floor", "shardkit", "floor", 1.15)
                rec.ratio("shardkit/listcat", "shardkit", "listcat", 0.6)
                if lab == "uneven":  # time per byte moved, uneven over even, same round
                    even, scale = times["shardkit/even"], prepared["even"][2] / group_bytes
                    rec.ratios["uneven/even per byte"] = ([scale * a / b for a, b in zip(t["shardkit"], even)], 1.1)
                records.append(rec)
    return records


def fused_projection(pg, settings: Settings) -> list[Record]:
    """The Ulysses forward switch with the producer writing straight into the send buffer.

    A projection ``[T, H_in] -> [T, N * D]`` (T = S / R local tokens, B = 1) followed by the
    scatter-heads / gather-sequence all-to-all, three ways: ``unfused`` (``F.linear``, view as
    ``[1, T, N, D]``, :func:`shardkit.all_to_all`: one layout copy), ``fused`` (one batched
    matmul of the input against the weight's per-destination head blocks, whose output
    ``[R, T, N / R * D]`` *is* the pre-laid send buffer, then the bare ``all_to_all_single``: no
    layout copy) and the parts alone, ``proj`` (that batched matmul) and ``bare`` (the
    all-to-all of a pre-laid buffer). A small ``H_in`` keeps the matmul from hiding the copy.
    Checked: fused equals unfused (rtol 1e-5; the GEMMs block differently).
    """
    import torch.nn.functional as F

    world, dev = dist.get_world_size(pg), settings.torch_device
    h_in, nd = 16, HEADS * HEAD_DIM
    records = []
    for size in (4 * MIB,) if settings.quick else (1 * MIB, 4 * MIB, 8 * MIB):
        T = size // (nd * 4)
        gen = torch.Generator().manual_seed(5 + size)
        x, w = torch.randn(T, h_in, generator=gen).to(dev), (torch.randn(nd, h_in, generator=gen) / h_in**0.5).to(dev)
        w_blocks = w.view(world, nd // world, h_in).transpose(1, 2).contiguous()  # [R, H_in, N / R * D]
        send = torch.empty(world, T, nd // world, device=dev)
        recv = torch.empty_like(send)

        def unfused():
            return all_to_all(F.linear(x, w).view(1, T, HEADS, HEAD_DIM), pg, 2, 1)

        def proj():
            return torch.matmul(x, w_blocks, out=send)

        def bare():
            return dist.all_to_all_single(recv, send, group=pg)

        def fused():
            proj()
            bare()
            return recv.view(1, world * T, HEADS // world, HEAD_DIM)  # blocks arrive in sequence order

        want, got = unfused(), fused()
        agree(
            [] if got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-5) else ["fused != unfused"],
            pg,
            f"fused projection {size} B",
        )
        times = time_interleaved(dict(unfused=unfused, fused=fused, proj=proj, bare=bare), pg, settings)
        times["proj+bare"] = [a + b for a, b in zip(times["proj"], times["bare"])]
        rec = Record(
            "all_to_all_fused",
            dict(bytes=size, label=f"projection H_in={h_in} -> N={HEADS} D={HEAD_DIM}", tokens=T),
            world,
            times,
            busbw={"fused": (size, (world - 1) / world), "bare": (size, (world - 1) / world)},
            checked="fused output against projection + shardkit.all_to_all (rtol 1e-5)",
        )
        rec.ratio("fused/(proj+bare)", "fused", "proj+bare", 1.1)
        rec.ratio("unfused/(proj+bare)", "unfused", "proj+bare")
        rec.ratio("fused/unfused", "fused", "unfused", 1.0)
        records.append(rec)
    return records
