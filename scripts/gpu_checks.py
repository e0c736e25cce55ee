"""The checks of ``scripts/gpu_first_checks.sh`` that run in Python, one subcommand each.

Each subcommand writes one JSON report (``--out FILE``) and prints a short table; none needs more
than one GPU. They are bounded by the caller (``timeout``), sized to finish in a minute or two on
one H100/H200.

* ``env``: the machine's torch, CUDA, GPU and transformers; shardkit imports.
* ``blocks``: ring attention's fused CUDA blocks against a float64 reference: one process (a ring
  of 1: the diagonal and off-diagonal blocks of a zigzag layout, merged), every kernel the block
  picker can choose (flash bf16/fp16, memory-efficient fp32 and masked packed documents, the math
  fallback for float64), causal and not, GQA; forward output and q/k/v gradients, relative error.
* ``attention``: time (CUDA events, median) and peak memory of ring attention (ring of 1, zigzag,
  causal, bf16) with the fused blocks against the math path and against one fused SDPA call, at
  ``S`` in 2k..8k.
* ``syncs``: ``torch.cuda.set_sync_debug_mode("warn")`` around a one-GPU ``shardkit train`` (run
  under torchrun by the shell script): every synchronizing op, by the source line that caused it.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path


def _write(path: str | None, report: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(report, indent=2, default=str))


def cmd_env(args) -> dict:
    import torch

    report: dict = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    report["cuda_available"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        report |= {
            "gpus": torch.cuda.device_count(),
            "name": p.name,
            "capability": list(torch.cuda.get_device_capability(0)),
            "memory_gib": round(p.total_memory / 2**30, 1),
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        }
    try:
        import transformers

        report["transformers"] = transformers.__version__
    except ImportError as e:
        report["transformers"] = f"missing: {e}"
    try:
        import shardkit
        import shardkit.cli.main  # noqa: F401  the command's whole import graph
        import shardkit.train.run  # noqa: F401

        report["shardkit_import"] = f"ok ({shardkit.__file__})"
    except Exception as e:  # report, do not stop: the rest of the script says what else runs
        report["shardkit_import"] = f"FAILED: {type(e).__name__}: {e}"
    for k, v in report.items():
        print(f"{k:16s} {v}")
    return report


def _reference(q, k, v, causal, cu):
    """Attention in float64 math with a document (and causal) mask: ``[B, S, N, D]`` in and out."""
    import torch

    rep = q.shape[2] // k.shape[2]
    q, k, v = (t.double() for t in (q, k, v))
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    S = q.shape[1]
    doc = torch.repeat_interleave(torch.arange(len(cu) - 1, device=q.device), torch.tensor(cu).diff().to(q.device))
    keep = doc[:, None] == doc[None, :]
    if causal:
        keep &= torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
    s = torch.einsum("bqnd,bknd->bnqk", q, k) / math.sqrt(q.shape[-1])
    p = torch.softmax(s.masked_fill(~keep, float("-inf")), -1)
    return torch.einsum("bnqk,bknd->bqnd", p, v)


def _one_rank_group():
    """A world of one (gloo; CUDA tensors never travel in a ring of 1)."""
    import tempfile

    import torch.distributed as dist

    if not dist.is_initialized():
        store = dist.FileStore(tempfile.mktemp(prefix="shardkit-gpu-checks-"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    return dist.group.WORLD


def cmd_blocks(args) -> dict:
    import torch

    from shardkit.context_parallel import _blocks, ring_attention

    group = _one_rank_group()
    dev = torch.device(args.device)
    torch.manual_seed(0)
    rows = []
    cases = [  # (dtype, packed, tolerance on the relative error)
        (torch.bfloat16, False, 2e-2),
        (torch.float16, False, 5e-3),
        (torch.float32, False, 1e-4),
        (torch.bfloat16, True, 2e-2),
        (torch.float32, True, 1e-4),
        (torch.float64, False, 1e-10),
    ]
    S, N, NKV, D = 1000, 8, 2, 64  # uneven on purpose; GQA 4:1
    for dtype, packed, tol in cases:
        for causal in (True, False):
            cu = [0, 300, 364, 400, 407, S] if packed else [0, S]  # short documents share masked tiles
            q = torch.randn(1, S, N, D, device=dev, dtype=dtype, requires_grad=True)
            k = torch.randn(1, S, NKV, D, device=dev, dtype=dtype, requires_grad=True)
            v = torch.randn(1, S, NKV, D, device=dev, dtype=dtype, requires_grad=True)
            kernels: list[str] = []
            pick = _blocks.block_kernel

            def spy(q_, v_, masked, _pick=pick, _seen=kernels):
                _seen.append(_pick(q_, v_, masked))
                return _seen[-1]

            _blocks.block_kernel = spy
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    out = ring_attention(
                        q, k, v, group, causal=causal, layout="zigzag", seq_len=S, cu_seqlens=cu if packed else None
                    )
                    dout = torch.randn_like(out)
                    out.backward(dout)
            finally:
                _blocks.block_kernel = pick
            qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
            ref = _reference(qr, kr, vr, causal, cu)
            ref.backward(dout.double())
            err = {
                name: float((a.double() - b).norm() / b.norm())
                for name, a, b in (
                    ("out", out.detach(), ref.detach()),
                    ("dq", q.grad, qr.grad),
                    ("dk", k.grad, kr.grad),
                    ("dv", v.grad, vr.grad),
                )
            }
            ok = all(math.isfinite(e) and e <= tol for e in err.values())
            rows.append(
                {
                    "dtype": str(dtype).removeprefix("torch."),
                    "packed": packed,
                    "causal": causal,
                    "kernels": sorted(set(kernels)),
                    "rel_err": err,
                    "tol": tol,
                    "ok": ok,
                }
            )
            r = rows[-1]
            print(
                f"{r['dtype']:9s} packed={packed!s:5s} causal={causal!s:5s} {','.join(r['kernels']):22s} "
                + " ".join(f"{n}={e:.1e}" for n, e in err.items())
                + ("  ok" if ok else "  FAIL")
            )
    return {"cases": rows, "all_ok": all(r["ok"] for r in rows)}


def _timed(fn, reps: int) -> tuple[float, int]:
    """Median milliseconds of ``fn`` over ``reps`` runs (CUDA events) and its peak extra bytes."""
    import torch

    fn()  # warm-up: kernels loaded, caches filled
    torch.cuda.synchronize()
    times = []
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), torch.cuda.max_memory_allocated() - base


def cmd_attention(args) -> dict:
    import torch
    import torch.nn.functional as F

    from shardkit.context_parallel import _blocks, ring_attention

    group = _one_rank_group()
    rows = []
    B, N, NKV, D = 1, 16, 4, 128
    for S in args.seq:
        q = torch.randn(B, S, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(B, S, NKV, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn_like(k, requires_grad=True)
        dout = torch.randn_like(q)

        def ring(q=q, k=k, v=v, dout=dout, S=S):
            ring_attention(q, k, v, group, causal=True, seq_len=S).backward(dout)

        def sdpa(q=q, k=k, v=v, dout=dout):
            t = lambda x: x.transpose(1, 2)  # noqa: E731
            out = F.scaled_dot_product_attention(t(q), t(k), t(v), is_causal=True, enable_gqa=True)
            out.backward(t(dout))

        row: dict = {"S": S}
        row["sdpa_ms"], row["sdpa_peak_mib"] = _timed(sdpa, args.reps)
        row["ring_fused_ms"], row["ring_fused_peak_mib"] = _timed(ring, args.reps)
        pick = _blocks.block_kernel
        _blocks.block_kernel = lambda *a: "math"  # the path every CUDA block took before
        try:
            row["ring_math_ms"], row["ring_math_peak_mib"] = _timed(ring, max(3, args.reps // 3))
        except torch.OutOfMemoryError as e:
            row["ring_math_ms"], row["ring_math_peak_mib"] = None, f"OOM: {e}"[:120]
        finally:
            _blocks.block_kernel = pick
        for key in [k for k in row if k.endswith("_peak_mib") and isinstance(row[k], int)]:
            row[key] = round(row[key] / 2**20, 1)
        flops = 4 * B * N * S * S * D / 2 * 3.5  # causal fwd (2 matmuls) + bwd (5 matmuls): 3.5x fwd
        row["ring_fused_tflops"] = round(flops / row["ring_fused_ms"] / 1e9, 1)
        rows.append(row)
        print(json.dumps(row))
    return {"shape": {"B": B, "N": N, "N_kv": NKV, "D": D, "dtype": "bfloat16", "causal": True}, "rows": rows}


def cmd_syncs(args) -> dict:
    """Run ``shardkit train ARGS`` in this process with CUDA's sync debug mode on; count by line."""
    import torch

    from shardkit.cli.main import main

    counts: collections.Counter = collections.Counter()
    original = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if "synchroniz" not in text:
            return original(message, category, filename, lineno, file, line)
        frames = [
            f for f in traceback.extract_stack()[:-1] if "torch/" not in f.filename and "warnings" not in f.filename
        ]
        where = next(
            (f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames) if "shardkit" in f.filename),
            f"{filename}:{lineno}",
        )
        counts[where] += 1

    warnings.showwarning = record
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    t0 = time.perf_counter()
    rc = main(["train", *args.train_args])
    torch.cuda.set_sync_debug_mode(0)
    report = {"rc": rc, "seconds": round(time.perf_counter() - t0, 1), "syncs_by_line": counts.most_common()}
    print(f"rc={rc}; {sum(counts.values())} synchronizing ops in the whole run, by line:")
    for where, n in counts.most_common(40):
        print(f"{n:6d}  {where}")
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the JSON report here")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("env").set_defaults(func=cmd_env)
    b = sub.add_parser("blocks")
    b.add_argument("--device", default="cuda", help="cpu checks the script itself (the CPU kernels)")
    b.set_defaults(func=cmd_blocks)
    a = sub.add_parser("attention")
    a.add_argument("--seq", type=int, nargs="+", default=[2048, 4096, 8192])
    a.add_argument("--reps", type=int, default=10)
    a.set_defaults(func=cmd_attention)
    s = sub.add_parser("syncs")
    s.add_argument("train_args", nargs=argparse.REMAINDER)
    s.set_defaults(func=cmd_syncs)
    args = p.parse_args(argv)
    report = args.func(args)
    _write(args.out, report)
    return 0 if report.get("all_ok", True) and report.get("rc", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
