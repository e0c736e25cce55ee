"""Context-parallel cases, forward + backward of attention on a float32 ``[B, S, N, D]`` layout:

- ``ring``: ring attention with ``overlap=True`` over ``overlap=False`` where transfers rival
  compute (goal <= 0.93) and where compute dominates (goal <= 1.02); causal zigzag over a
  contiguous ring (goal <= 0.8: per ring step the slowest contiguous rank computes a whole
  block, a zigzag rank half of one).

  Two choices follow from the 2-core CPU. The communication-heavy case is small (``S / R = 32``
  or 64 tokens of ``N x D = 1024``): per ring step a rank moves 256-512 KiB and computes about as
  long as that takes. (Its earlier shape, ``S = 2048, N = 16, D = 8``, moved 512 KiB per step
  against about 100 ms of local attention: ~2 % of its time was communication, so overlap could
  not show.) And the zigzag goal is measured on a 2-rank ring, one rank per core: on 4 ranks
  the 2 cores run the ranks' total work, which is the same for both layouts, so their balance
  cannot show there (reported without a goal: 0.99 where 2 ranks gave 0.75, 2026-11-24).
- ``ulysses``: :func:`ulysses_attention` against the same attention built from DTensor
  ``redistribute`` (``Shard(1)`` -> ``Shard(2)``, SDPA, back; PyTorch's own layout switch);
  uneven ``S`` and ``N`` against even, each time divided by the bytes its all-to-alls move.

Checked before timing: every variant equals full attention (``F.scaled_dot_product_attention``,
float32 rtol 1e-4) on this rank's tokens; overlap on / off are bitwise equal (output and grads).

``--quick``: the ring's long sequence at 1024 (else 4096) without the 4-rank zigzag row, Ulysses
at ``S = 512`` (else 2048).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import balanced_split_sizes
from .._shapes import split_offsets
from ..comm import CommLedger
from ..context_parallel import ring_attention, ulysses_attention, zigzag_positions
from ._method import Record, Settings, agree, close, time_interleaved

__all__ = ["ring", "ulysses"]


def _reference(q, k, v, causal):
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    return t(F.scaled_dot_product_attention(t(q), t(k), t(v), is_causal=causal))


def _inputs(B, S, N, D, pos, seed, dev: torch.device):
    """The full inputs (q, k, v, output gradient) on ``dev`` and this rank's tokens ``pos`` of them."""
    gen = torch.Generator().manual_seed(seed)
    full = [torch.randn(B, S, N, D, generator=gen).to(dev) for _ in range(4)]
    local = [t[:, pos.to(dev)].contiguous().requires_grad_(i < 3) for i, t in enumerate(full)]
    return full, local


def _contiguous(S, R, rank):
    sizes = balanced_split_sizes(S, R)
    return torch.arange(split_offsets(sizes)[rank], split_offsets(sizes)[rank] + sizes[rank])


def _fwd_bwd(attn, q, k, v, dout):
    def fn():
        for t in (q, k, v):
            t.grad = None
        out = attn(q, k, v)
        out.backward(dout)
        return out.detach(), [t.grad.clone() for t in (q, k, v)]

    return fn


def _ring_variant(p, pg, seed, dev: torch.device):

    rank, R = dist.get_rank(pg), dist.get_world_size(pg)
    B, S, N, D = p["B"], p["S"], p["N"], p["D"]
    pos = zigzag_positions(S, R, rank) if p["layout"] == "zigzag" else _contiguous(S, R, rank)
    full, (q, k, v, dout) = _inputs(B, S, N, D, pos, seed, dev)
    fn = _fwd_bwd(
        lambda a, b, c: ring_attention(
            a, b, c, pg, causal=p["causal"], seq_len=S, layout=p["layout"], overlap=p["overlap"]
        ),
        q,
        k,
        v,
        dout,
    )
    return fn, _reference(full[0], full[1], full[2], p["causal"])[:, pos.to(dev)]


def ring(pg, settings: Settings) -> list[Record]:
    s, long = (1, 1024) if settings.quick else (2, 4096)
    world = dist.get_world_size(pg)
    pair = dist.new_group(dist.get_process_group_ranks(pg)[:2])  # collective: every rank creates it
    zigzag = [dict(B=1, S=long, N=4, D=64, causal=True, overlap=True, layout=lay) for lay in ("zigzag", "contiguous")]
    cases: list[tuple] = [  # label, goal, what differs, variants, ranks
        (
            "overlap-comm",
            0.93,
            "overlap",
            [dict(B=1, S=128 * s, N=16, D=64, causal=False, overlap=o, layout="zigzag") for o in (True, False)],
            world,
        ),
        (
            "overlap-compute",
            1.02,
            "overlap",
            [dict(B=1, S=long, N=4, D=64, causal=True, overlap=o, layout="zigzag") for o in (True, False)],
            world,
        ),
        ("zigzag-causal", 0.8, "layout", zigzag, 2),
    ]
    if not settings.quick:  # (no goal: the 2-rank row above is the one --quick keeps)
        cases.append(("zigzag-causal", None, "layout", zigzag, world))
    records = []
    for n, (label, goal, key, variants, R) in enumerate(cases):
        if dist.get_rank(pg) < R:
            records.append(_ring_case(label, goal, key, variants, pg if R == world else pair, 11 + n, settings))
        dist.barrier(group=pg)  # the ranks outside a 2-rank ring wait for it
    return records


def _ring_case(label, goal, key, variants, g, seed, settings: Settings) -> Record:
    names = [("overlap" if p["overlap"] else "no-overlap") if key == "overlap" else str(p["layout"]) for p in variants]
    preps = [_ring_variant(p, g, seed, settings.torch_device) for p in variants]
    results = [fn() for fn, _ in preps]
    failures = [
        f"{nm} != full attention" for nm, (out, _), (_, want) in zip(names, results, preps) if not close(out, want)
    ]
    if key == "overlap" and not (
        torch.equal(results[0][0], results[1][0])
        and all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))
    ):
        failures.append("overlap changed the result")
    agree(failures, g, f"ring {label}")
    times = time_interleaved({nm: fn for nm, (fn, _) in zip(names, preps)}, g, settings)
    p = variants[0]
    rec = Record(
        "ring",
        dict(label=label, B=p["B"], S=p["S"], N=p["N"], D=p["D"], causal=p["causal"]),
        dist.get_world_size(g),
        times,
        checked="outputs against full SDPA (rtol 1e-4); overlap on/off bitwise equal",
    )
    return rec.ratio(f"{names[0]}/{names[1]}", names[0], names[1], goal)


def _dtensor_attention(pg, causal, device_type: str):
    """Ulysses from PyTorch's DTensor: redistribute ``Shard(1)`` (sequence) to ``Shard(2)``
    (heads), SDPA on local heads over the whole sequence, redistribute back."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = DeviceMesh.from_group(pg, device_type, mesh_dim_names=("cp",))

    def attn(q, k, v):
        heads = [DTensor.from_local(t, mesh, [Shard(1)]).redistribute(mesh, [Shard(2)]).to_local() for t in (q, k, v)]
        out = _reference(*heads, causal)
        return DTensor.from_local(out, mesh, [Shard(2)]).redistribute(mesh, [Shard(1)]).to_local()

    return attn


def ulysses(pg, settings: Settings) -> list[Record]:

    rank, R, dev = dist.get_rank(pg), dist.get_world_size(pg), settings.torch_device
    S = 512 if settings.quick else 2048
    records = []
    # Against DTensor redistribute: even S and N (DTensor's all-to-all needs even shards).
    pos = _contiguous(S, R, rank)
    full, (q, k, v, dout) = _inputs(1, S, 8, 64, pos, 5, dev)
    fns = {
        "shardkit": _fwd_bwd(lambda a, b, c: ulysses_attention(a, b, c, pg, causal=True, seq_len=S), q, k, v, dout),
        "dtensor": _fwd_bwd(_dtensor_attention(pg, True, dev.type), q, k, v, dout),
    }
    want = _reference(full[0], full[1], full[2], True)[:, pos.to(dev)]
    results = {nm: fn() for nm, fn in fns.items()}
    failures = [f"{nm} != full attention" for nm, (out, _) in results.items() if not close(out, want)]
    failures += [
        f"dtensor grad {i} != shardkit's"
        for i, (a, b) in enumerate(zip(results["shardkit"][1], results["dtensor"][1]))
        if not close(a, b)
    ]
    agree(failures, pg, "ulysses vs dtensor")
    rec = Record(
        "ulysses",
        dict(label="vs DTensor redistribute", B=1, S=S, N=8, D=64, causal=True),
        R,
        time_interleaved(fns, pg, settings),
        checked="outputs against full SDPA, grads against each other",
    )
    records.append(rec.ratio("shardkit/dtensor", "shardkit", "dtensor", 1.0))
    # Uneven (S and N not divisible by R) against even, per byte moved.
    preps, moved = {}, {}
    for nm, (s_len, n) in (("uneven", (S - 3, 7)), ("even", (S, 8))):
        pos = _contiguous(s_len, R, rank)
        full, (q, k, v, dout) = _inputs(1, s_len, n, 64, pos, 6, dev)
        preps[nm] = _fwd_bwd(
            lambda a, b, c, s_len=s_len: ulysses_attention(a, b, c, pg, causal=True, seq_len=s_len), q, k, v, dout
        )
        with CommLedger() as ledger:
            out, _ = preps[nm]()
        failures = (
            []
            if close(out, _reference(full[0], full[1], full[2], True)[:, pos.to(dev)])
            else [f"{nm} != full attention"]
        )
        agree(failures, pg, f"ulysses {nm}")
        total = torch.tensor([float(ledger.bytes_sent())], device=dev)
        dist.all_reduce(total, group=pg)
        moved[nm] = total.item()
    rec = Record(
        "ulysses",
        dict(label="uneven S-3, N=7 vs even", S=S, D=64, causal=True, bytes_moved=moved),
        R,
        time_interleaved(preps, pg, settings),
        checked="outputs against full SDPA",
    )
    if moved["uneven"] > 0:
        records.append(rec.ratio("uneven/even per byte", "uneven", "even", 1.1, scale=moved["even"] / moved["uneven"]))
    else:  # one rank: nothing moves, no per-byte ratio
        records.append(rec.ratio("uneven/even", "uneven", "even"))
    return records
