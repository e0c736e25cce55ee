"""The flags of ``shardkit train`` (:func:`add_train_flags`), apart from what runs them
(:mod:`.train`). They read only :mod:`shardkit.train.options` and
:mod:`shardkit.train.model_names`: no torch, so ``shardkit train --help`` stays fast."""

from __future__ import annotations

import argparse

from .._rules import ac_rule
from ..train.model_names import MODEL_SUMMARIES
from ..train.options import AC_MODES, CP_LAYOUTS, DTYPES, MIXED_PRECISION, MOE_DROP_POLICIES, SCHEDULES, TrainConfig
from .commands import COMMANDS

__all__ = ["add_train_flags"]


def add_train_flags(subparsers) -> argparse.ArgumentParser:
    """Register the ``train`` subcommand. Every flag defaults to None ("not given"), so the
    TOML file's value or the built-in default applies (see :func:`config_from_args`)."""
    d = TrainConfig()
    p = subparsers.add_parser(
        "train",
        help=COMMANDS["train"],
        description="Train a Hugging Face causal LM (Llama, Qwen2, Qwen3, Qwen3-MoE, DeepSeek-V2) on real text with "
        "any composition of data (replicated and FSDP2-sharded), pipeline, context (Ulysses, ring, USP), tensor "
        "(+ sequence) and expert parallelism, or a convolutional autoencoder with spatial x data parallelism. One "
        "trainer for every layout; --verify reruns the same steps in one process and checks parity.",
    )
    p.add_argument("--config", metavar="FILE.toml", help="TOML file of options (keys: option names with underscores)")
    p.add_argument(
        "--model",
        choices=tuple(MODEL_SUMMARIES),
        help=f"what to train (default {d.model}): " + "; ".join(f"{n}: {s}" for n, s in MODEL_SUMMARIES.items()),
    )
    p.add_argument(
        "--nproc",
        type=int,
        help="local processes to start (default: the product of the degrees, "
        "at least 4 for an LM; torchrun: its world)",
    )
    p.add_argument("--spatial", type=int, help=f"conv-ae: ranks sharing each frame along W (default {d.spatial})")
    p.add_argument(
        "--spatial-h",
        type=int,
        help=f"conv-ae: ranks sharing each frame along H (default {d.spatial_h}; with --spatial > 1: H x W tiles)",
    )
    p.add_argument("--tp", type=int, help="tensor-parallel degree (default 2 for an LM without pp and cp, else 1)")
    p.add_argument(
        "--dp-replicate",
        type=int,
        help="data-parallel replicas, gradients all-reduced (default: what --nproc leaves after every other degree)",
    )
    p.add_argument("--dp", type=int, help="alias of --dp-replicate")
    p.add_argument(
        "--dp-shard",
        type=int,
        help=f"FSDP2 ranks sharding parameters, gradients and optimizer state "
        f"(default {d.dp_shard}; with --dp-replicate > 1: HSDP)",
    )
    p.add_argument(
        "--zero",
        type=int,
        choices=(0, 1, 2),
        help="ZeRO over the data ranks (--dp-replicate x cp; experts over their edp ranks), parameters "
        "replicated: 1 shards the optimizer state, 2 the reduced gradients too; not with --dp-shard > 1 "
        f"(FSDP2 is ZeRO-3) (default {d.zero}: off)",
    )
    p.add_argument(
        "--cp-ulysses",
        type=int,
        help=f"context parallel: Ulysses ranks sharing each sequence, all-to-all over heads (default {d.cp_ulysses})",
    )
    p.add_argument(
        "--cp-ring",
        type=int,
        help=f"context parallel: ring-attention ranks sharing each sequence, zigzag "
        f"layout (default {d.cp_ring}; with --cp-ulysses > 1: USP, Ulysses inside, ring across)",
    )
    p.add_argument(
        "--cp-layout",
        choices=CP_LAYOUTS,
        help=f"token placement of ring cp alone: zigzag, contiguous (Llama 3's slice per rank) or stripe "
        f"(every R-th token; no --packed, no sliding window) (default {d.cp_layout})",
    )
    p.add_argument("--pp", type=int, help=f"pipeline-parallel stages (default {d.pp})")
    p.add_argument(
        "--ep",
        type=int,
        help="moe / mla: expert-parallel ranks, borrowed from dp-shard x cp x tp, or whole such blocks of "
        "several --dp-replicate replicas "
        "(experts dispatched all-to-all; default 1: tensor-parallel experts)",
    )
    p.add_argument(
        "--packed",
        action=argparse.BooleanOptionalAction,
        help="treat each window as documents (the corpus files) packed along the sequence; "
        "tokens attend and predict only within their file",
    )
    p.add_argument(
        "--loss-parallel",
        action=argparse.BooleanOptionalAction,
        help="keep the logits vocab-sharded and use the vocab-parallel cross entropy",
    )
    p.add_argument(
        "--sequence-parallel",
        action=argparse.BooleanOptionalAction,
        help="shard hidden states between blocks over tp (default: on for llama with tp > 1)",
    )
    p.add_argument("--max-norm", type=float, help=f"clip the global gradient norm (default {d.max_norm}; 0: off)")
    p.add_argument(
        "--skip-nonfinite",
        type=int,
        metavar="N",
        help="skip up to N steps whose global loss or gradient "
        "norm is NaN or infinite (not applied; the lr schedule still advances); one more stops the run "
        f"(default {d.skip_nonfinite}: the first one stops it)",
    )
    p.add_argument("--experts", type=int, help=f"moe / mla: routed experts, top-2 (default {d.experts})")
    p.add_argument(
        "--moe-bias-update-rate",
        type=float,
        metavar="RATE",
        help="moe / mla: DeepSeek-V3 auxiliary-loss-free balancing: a per-expert bias on the routing scores "
        "(top-k selection only), after each step += RATE * sign(mean load - load) (default: off)",
    )
    p.add_argument(
        "--moe-z-loss", type=float, metavar="COEF", help="moe / mla: router z-loss (ST-MoE) coefficient (default 0)"
    )
    p.add_argument(
        "--moe-seq-aux-loss",
        type=float,
        metavar="COEF",
        help="moe / mla: DeepSeek-V3 sequence-wise balance loss coefficient (default 0; not with cp or "
        "sequence parallelism)",
    )
    p.add_argument(
        "--moe-capacity-factor",
        type=float,
        metavar="F",
        help="moe / mla: expert capacity (Megatron-LM): each expert takes at most ceil(T * k / E * F) (token, slot) "
        "pairs of the T tokens a rank routes at once, the rest dropped (default: dropless)",
    )
    p.add_argument(
        "--moe-drop-policy",
        choices=MOE_DROP_POLICIES,
        help="with --moe-capacity-factor: drop the lowest routing weights (probs, default) or the latest tokens",
    )
    p.add_argument(
        "--moe-pad-to-capacity",
        action=argparse.BooleanOptionalAction,
        help="with --moe-capacity-factor: fill every expert to its capacity with zero-weight pairs (fixed sizes)",
    )
    p.add_argument(
        "--pp-tp", metavar="T0,T1,...", help="per-stage tp sizes, e.g. 2,1,1 (pp = their count; sum * dp = nproc)"
    )
    p.add_argument(
        "--microbatches",
        type=int,
        help=f"microbatches per step and dp rank: the pipeline's, or "
        f"gradient accumulation without one (default {d.microbatches})",
    )
    p.add_argument(
        "--ac",
        type=ac_value,
        metavar="{" + ",".join(AC_MODES) + ",selective:N}",
        help="activation checkpointing of each decoder block: none, full (recompute the block in backward), "
        "selective (keep matmul, attention and collective outputs; recompute the rest) or selective:N (every "
        f"N-th block recomputed whole, the others keep everything: torchtitan's layer-level option) (default {d.ac})",
    )
    p.add_argument(
        "--sp-activation",
        choices=("shard", "gathered"),
        help="with sequence parallelism, what the column-parallel projections keep for backward: shard (the "
        "norm's sequence block, all-gathered again in backward, Megatron's layout) or gathered (the all-gather's "
        "output) (default: shard, gathered with --compile)",
    )
    p.add_argument(
        "--async-tp",
        action="store_true",
        default=None,
        help="with sequence parallelism over --tp > 1: issue each all-gather and reduce-scatter as ring steps "
        "overlapping the matmuls that read or produce it (collective matmul, torchtitan's async TP)",
    )
    p.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        metavar="BACKEND",
        help="torch.compile each decoder block with BACKEND (inductor when given alone; aot_eager, ...)",
    )
    p.add_argument("--schedule", choices=SCHEDULES, help=f"pipeline schedule (default {d.schedule})")
    p.add_argument(
        "--virtual-stages",
        type=int,
        help="chunks (virtual stages) per pipeline rank: the layers are cut into pp x V chunks "
        f"(interleaved-1f1b, interleaved-zb, looped-bfs: V >= 2 or looped-bfs 1; zbv, dualpipev: 2) "
        f"(default {d.virtual_stages})",
    )
    p.add_argument(
        "--steps", type=int, help=f"training steps in all; a resumed run continues up to it (default {d.steps})"
    )
    p.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="save the training state (model, optimizer, step, "
        "data position, RNG) here with DCP; it resumes on any layout",
    )
    p.add_argument("--save-every", type=int, help="save every N steps (default: after the last step only)")
    p.add_argument("--keep", type=int, help="keep only the newest N complete saves in --checkpoint-dir (default: all)")
    p.add_argument(
        "--async-checkpoint",
        action=argparse.BooleanOptionalAction,
        help="write each save in the background: the state is copied to CPU memory (pinned on CUDA) and DCP "
        "writes it while the next steps run; the next save and the end of the run wait for it (torchtitan's option)",
    )
    p.add_argument(
        "--resume",
        action=argparse.BooleanOptionalAction,
        help="continue from the latest complete save in --checkpoint-dir (none yet: start at step 0, "
        "for requeued jobs)",
    )
    p.add_argument(
        "--resume-from",
        metavar="PATH",
        help="continue from this save: a checkpoint directory (its latest save) or one save's directory "
        "(step_*); fails if PATH holds no save. New saves go to --checkpoint-dir, which must hold none",
    )
    p.add_argument(
        "--allow-unverified",
        action=argparse.BooleanOptionalAction,
        help="resume from a save whose manifest has no checksums (one of an earlier shardkit); without it "
        "such a save is refused, its bytes being unverifiable",
    )
    p.add_argument(
        "--save-hf",
        metavar="DIR",
        help="after the last step, write the model as a Hugging Face directory (config.json, safetensors, "
        "tokenizer) into DIR, a new or empty directory; `shardkit export` does the same from a save",
    )
    p.add_argument("--seq-len", type=int, help=f"tokens per sequence (default {d.seq_len})")
    p.add_argument("--batch-size", type=int, help=f"global batch, split over dp (default {d.batch_size})")
    p.add_argument("--dtype", choices=DTYPES, help=f"parameter and compute dtype (default {d.dtype})")
    p.add_argument(
        "--mixed-precision",
        choices=MIXED_PRECISION,
        help="bf16: forward and backward in bfloat16 on float32 master parameters and optimizer state, "
        f"every gradient reduction in float32 (needs --dtype float32) (default {d.mixed_precision})",
    )
    p.add_argument("--seed", type=int, help=f"model init and data sampling seed (default {d.seed})")
    p.add_argument("--lr", type=float, help="AdamW peak learning rate (default 1e-3; 1e-4 with --model-path)")
    p.add_argument(
        "--lr-schedule",
        choices=("constant", "warmup-cosine"),
        help="constant, or linear warm-up then cosine decay (default: warmup-cosine with --model-path)",
    )
    p.add_argument(
        "--verify",
        action=argparse.BooleanOptionalAction,
        help="rerun the steps in one process and check losses and final parameters",
    )
    p.add_argument(
        "--checks",
        action=argparse.BooleanOptionalAction,
        help="run with the cross-rank check mode on: every collective first agrees on its metadata, and the "
        "model's plan and replicated weights are fingerprinted at parallelize (a rank disagreement becomes the "
        "same error on every rank instead of a hang; measured cost: docs/reliability.md)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        metavar="SECONDS",
        help=f"how long any collective waits for a rank "
        f"before the job fails; a stopped rank ends the job after about this long and is named as the "
        f"suspect (default {d.timeout:g})",
    )
    p.add_argument(
        "--report",
        metavar="DIR",
        help="write metrics.jsonl (per step; TensorBoard "
        "scalars in DIR/tb with the tb extra), report.json, loss.png (and conv-ae's reconstruction.png) "
        "into DIR",
    )
    p.add_argument(
        "--wandb",
        metavar="PROJECT",
        help="log the per-step scalars to this Weights & Biases project too (the wandb extra; offline into "
        "DIR/wandb or ./wandb unless WANDB_MODE is set: upload later with `wandb sync`)",
    )
    p.add_argument(
        "--profile-steps",
        metavar="A:B",
        help="torch.profiler trace of steps A to B (1-based, both included): one Chrome-trace JSON per rank "
        "(rank{R}.trace.json, for Perfetto) in --profile-dir, else DIR/profile of --report",
    )
    p.add_argument("--profile-dir", metavar="DIR", help="where --profile-steps and --memory-snapshot write")
    p.add_argument(
        "--memory-snapshot",
        action=argparse.BooleanOptionalAction,
        help="CUDA ranks (torchrun on GPUs) only: record the caching allocator over the profiled steps (all "
        "steps without --profile-steps) into rank{R}.memory.pickle, for pytorch.org/memory_viz",
    )
    p.add_argument(
        "--eval-every",
        type=int,
        metavar="N",
        help="validation loss on a held-out split (the corpus's last tenth, never trained on) every N steps and "
        f"after the last, into the summary, metrics.jsonl, TensorBoard and loss.png (default {d.eval_every}: none)",
    )
    p.add_argument(
        "--eval-batches",
        type=int,
        metavar="K",
        help=f"global batches of held-out windows per validation (default {d.eval_batches})",
    )
    p.add_argument(
        "--log-every",
        type=int,
        metavar="N",
        help="when stdout is not a terminal (nohup, SLURM, a pipe): a line every N steps with the step, the mean "
        "loss since the last line, lr and tokens/s (default: every step up to 20 steps, else every 10)",
    )
    p.add_argument(
        "--data",
        metavar="PATH",
        help="text file or folder; *.jsonl lines and *.parquet rows are documents; hf:NAME[:SPLIT]: a Hugging "
        "Face dataset, a save_to_disk folder or one in the local datasets cache, read offline (the datasets extra; "
        "SPLIT default train) (default: the Python stdlib's sources)",
    )
    p.add_argument(
        "--data-column",
        metavar="NAME",
        help=f"the text field of *.jsonl lines, *.parquet rows and hf: rows in --data (default {d.data_column!r})",
    )
    p.add_argument(
        "--model-path",
        metavar="DIR_OR_GGUF",
        help="a local Hugging Face causal-LM checkpoint directory or "
        "GGUF file (llama, qwen2, qwen3, qwen3-moe, deepseek-v2), trained on its own tokenizer "
        "(default: random init of the built-in config, byte-level tokens)",
    )
    p.add_argument(
        "--tokenizer",
        metavar="DIR_OR_GGUF",
        help="a local Hugging Face tokenizer directory or GGUF file encoding --data for the built-in model "
        "(its vocabulary becomes the model's; not with --model-path, which has its own; default: byte-level tokens)",
    )
    model = p.add_argument_group("built-in model (ignored with --model-path)")
    model.add_argument("--hidden-size", type=int, help=f"default {d.hidden_size}")
    model.add_argument("--layers", type=int, help=f"default {d.layers}")
    model.add_argument("--heads", type=int, help=f"query heads (default {d.heads})")
    model.add_argument("--kv-heads", type=int, help=f"key/value heads (default {d.kv_heads})")
    model.add_argument("--intermediate-size", type=int, help=f"default {d.intermediate_size}")
    return p


def ac_value(text: str) -> str:
    """An ``--ac`` value (argparse ``type``); raises ``argparse.ArgumentTypeError`` where ``ac_rule`` refuses it."""
    why = ac_rule(text)
    if why is not None:
        raise argparse.ArgumentTypeError(why.removeprefix("--ac "))
    return text
