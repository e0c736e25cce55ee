"""Spatial convolution and vocab-parallel loss cases (forward + backward, float32).

- ``spatial_conv``: :func:`shardkit.spatial.spatial_conv2d` (3x3, padding 1, W sharded, halo
  exchange overlapped with the interior) against ``overlap=False``, against its parts measured
  apart (halo exchange fwd + bwd, local conv fwd + bwd, parameter-gradient all-reduce; summed per
  round) and against all-gathering the full input (full conv, reduce-scatter back). Checked: the
  output and every gradient equal the gather baseline (rtol 1e-4), the parts compute the same.
- ``vocab_loss``: :func:`vocab_parallel_cross_entropy` on ``[T, V / R]`` logits against
  gathering the full ``[T, V]`` logits and ``F.cross_entropy``. Checked: same loss and local
  gradient (rtol 1e-5).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import all_gather, balanced_split_sizes, gather_forward_split_backward
from .._shapes import split_offsets
from ..spatial import halo_exchange, spatial_conv2d
from ..tensor_parallel.loss import vocab_parallel_cross_entropy
from ._method import Record, Settings, agree, close, time_interleaved

__all__ = ["spatial_conv", "vocab_loss"]


def _conv_fns(shape, pg, dev: torch.device):

    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    B, C, H, W = shape
    gen = torch.Generator().manual_seed(7 + W)
    x_full, w0, b0 = (
        torch.randn(shape, generator=gen).to(dev),
        (torch.randn(C, C, 3, 3, generator=gen) / (3 * C**0.5)).to(dev),
        torch.randn(C, generator=gen).to(dev),
    )
    dy_full = torch.randn(shape, generator=gen).to(dev)
    sizes = balanced_split_sizes(W, world)
    off, n = split_offsets(sizes)[rank], sizes[rank]
    x = x_full.narrow(3, off, n).contiguous().requires_grad_()
    dy = dy_full.narrow(3, off, n).contiguous()
    params = {
        k: (w0.clone().requires_grad_(), b0.clone().requires_grad_())
        for k in ("spatial", "sequential", "gather", "conv")
    }
    slab = halo_exchange(x.detach(), pg, 3, 1, 1, sizes=sizes).contiguous().requires_grad_()
    dslab = torch.randn(slab.shape, generator=gen).to(dev)
    flat_grads = torch.cat([w0.reshape(-1), b0])

    def zero(*ts):
        for t in ts:
            t.grad = None

    def conv_sk(name, overlap):
        w, b = params[name]
        zero(x, w, b)
        y = spatial_conv2d(x, w, b, pg, 3, padding=1, sizes=sizes, overlap=overlap)
        y.backward(dy)
        return y.detach()

    def gather():
        w, b = params["gather"]
        zero(x, w, b)
        y = F.conv2d(all_gather(x, pg, 3, sizes=sizes), w, b, padding=1).narrow(3, off, n)
        y.backward(dy)
        flat = torch.cat([w.grad.reshape(-1), b.grad])
        dist.all_reduce(flat, group=pg)
        w.grad.copy_(flat[: w.numel()].view(w.shape))
        b.grad.copy_(flat[w.numel() :])
        return y.detach()

    def halo():
        zero(x)
        h = halo_exchange(x, pg, 3, 1, 1, sizes=sizes)
        h.backward(dslab)
        return h.detach()

    def conv():
        w, b = params["conv"]
        zero(slab, w, b)
        y = F.conv2d(slab, w, b, padding=(1, 0))
        y.backward(dy)
        return y.detach()

    def allreduce():
        return dist.all_reduce(flat_grads.clone(), group=pg)

    fns = dict(
        spatial=lambda: conv_sk("spatial", True),
        sequential=lambda: conv_sk("sequential", False),
        gather=gather,
        halo=halo,
        conv=conv,
        allreduce=allreduce,
    )
    return fns, x, params, slab


def spatial_conv(pg, settings: Settings) -> list[Record]:
    world = dist.get_world_size(pg)
    sizes = ((1, 32, 64, 256),) if settings.quick else ((1, 32, 64, 256), (1, 32, 128, 512))
    records = []
    for shape in sizes:
        fns, x, params, slab = _conv_fns(shape, pg, settings.torch_device)
        outs, gx = {}, {}
        for k in ("sequential", "spatial", "gather", "conv"):
            outs[k] = fns[k]()
            gx[k] = torch.full_like(x, float("nan")) if x.grad is None else x.grad.clone()  # missing: never `close`
        ok = {
            "output": close(outs["spatial"], outs["gather"]),
            "sequential output": close(outs["sequential"], outs["gather"]),
            "input grad": close(gx["spatial"], gx["gather"]),
            "sequential input grad": close(gx["sequential"], gx["gather"]),
            "parts output": close(outs["conv"], outs["spatial"]),
        }
        for k in ("spatial", "sequential"):
            ok[f"{k} weight/bias grads"] = all(close(a.grad, b.grad) for a, b in zip(params[k], params["gather"]))
        agree([k for k, v in ok.items() if not v], pg, f"spatial_conv {shape}")
        times = time_interleaved(fns, pg, settings)
        times["parts"] = [h + c + a for h, c, a in zip(times["halo"], times["conv"], times["allreduce"])]
        rec = Record(
            "spatial_conv",
            dict(shape=list(shape), label="x".join(map(str, shape))),
            world,
            times,
            checked="output and all gradients against the full-gather baseline (rtol 1e-4)",
        )
        rec.ratio("spatial/sequential", "spatial", "sequential", 1.0)
        rec.ratio("spatial/parts", "spatial", "parts", 1.05)
        rec.ratio("spatial/gather", "spatial", "gather", 1.0)
        records.append(rec)
    return records


def vocab_loss(pg, settings: Settings) -> list[Record]:

    rank, world, dev = dist.get_rank(pg), dist.get_world_size(pg), settings.torch_device
    tokens, vocab = (128, 32000) if settings.quick else (2048, 32000)
    sizes = [c.numel() for c in torch.arange(vocab).chunk(world)]
    labels = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(11))
    labels[::7] = -100
    labels = labels.to(dev)
    local = torch.randn(tokens, sizes[rank], generator=torch.Generator().manual_seed(100 + rank)) * 3
    local = local.to(dev).requires_grad_()

    def parallel():
        local.grad = None
        loss = vocab_parallel_cross_entropy(local, labels, pg, vocab_sizes=sizes)
        loss.backward()
        return loss.detach(), local.grad.clone()

    def gathered():
        local.grad = None
        loss = F.cross_entropy(gather_forward_split_backward(local, pg, -1, sizes), labels)
        loss.backward()
        return loss.detach(), local.grad.clone()

    (lp, gp), (lg, gg) = parallel(), gathered()
    ok = torch.allclose(lp, lg, rtol=1e-5, atol=0) and bool((gp - gg).norm() <= 1e-5 * gg.norm())
    agree([] if ok else ["parallel and gathered losses or gradients differ"], pg, "vocab_loss")
    rec = Record(
        "vocab_loss",
        dict(tokens=tokens, vocab=vocab, label=f"T={tokens} V={vocab}"),
        world,
        time_interleaved(dict(parallel=parallel, gathered=gathered), pg, settings),
        checked="loss (rtol 1e-5) and local gradient (norm rtol 1e-5) against the gathered logits",
    )
    return [rec.ratio("parallel/gathered", "parallel", "gathered", 1.0)]
