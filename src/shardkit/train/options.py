"""The options of ``shardkit train`` (:class:`TrainConfig`) and their fixed vocabularies.

The bottom of :mod:`shardkit.train`: no other module of the application is imported here, so the
models, tasks and the spec registry (:mod:`.specs`) take :class:`TrainConfig` from here while
:mod:`.config` (files, flags, checks) sits above them all.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ShardkitError

__all__ = [
    "MOE_DROP_POLICIES",
    "TrainConfig",
    "FINETUNE_LR",
    "parse_pp_tp",
    "AC_MODES",
    "MIXED_PRECISION",
    "DTYPES",
    "SCHEDULES",
    "LR_SCHEDULES",
    "SIZE_FLAGS",
]

# Peak AdamW rate for fine-tuning a pretrained checkpoint, the upper end of the usual 1e-5..1e-4
# so that a short run visibly learns. Measured on SmolLM2-135M-Instruct (stdlib corpus in its own
# tokens, float32, 20 steps of 4 x 32 tokens, the same batches for both, benchmarks/finetune_lr.py):
# this schedule at 1e-4 had a lower training loss than a constant 1e-3 at each of steps 2-20
# (mean 3.55 vs 4.41; steps 16-20 mean 3.30 vs 4.22, from 3.87 at step 1).
FINETUNE_LR = 1e-4

DTYPES = ("float32", "float64", "bfloat16")  # torch's names: getattr(torch, name) is the dtype
# shardkit.parallelize.checkpointing.AC_MODES, .mixed_precision.MIXED_PRECISION and
# shardkit.pipeline_parallel.tables.SCHEDULES (tests/cli/test_main.py checks they agree), here so
# that the flags (`shardkit train --help`) import no torch
AC_MODES = ("none", "full", "selective")
MIXED_PRECISION = ("none", "bf16")
SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b", "looped-bfs", "zb-h1", "zbv", "interleaved-zb", "dualpipev")
LR_SCHEDULES = ("constant", "warmup-cosine")
CP_LAYOUTS = ("zigzag", "contiguous", "stripe")  # shardkit.context_parallel.ring.LAYOUTS
MOE_DROP_POLICIES = ("probs", "position")  # shardkit.expert_parallel.capacity.DROP_POLICIES
SIZE_FLAGS = (
    "nproc",
    "tp",
    "pp",
    "cp_ulysses",
    "cp_ring",
    "dp_shard",
    "dp_replicate",
    "ep",
    "spatial",
    "spatial_h",
    "microbatches",
    "batch_size",
    "seq_len",
    "hidden_size",
    "layers",
    "heads",
    "kv_heads",
    "intermediate_size",
    "experts",
)


@dataclass(frozen=True)
class TrainConfig:
    """Options of ``shardkit train``; field names are the flags with underscores.

    The default model is small enough that the default run (4 CPU processes, 20 steps) takes
    well under 3 minutes on 2 cores: about 0.1 M parameters, GQA with 4 query and 2 key/value
    heads (head dim 16), so tp=2 keeps whole heads per rank.
    """

    model: str = "llama"  # a name of the spec registry (shardkit.train.specs.SPECS)
    nproc: int | None = None  # None: the product of the degrees (4 by default)
    spatial: int = 1  # conv-ae only: ranks sharing each frame along W
    spatial_h: int = 1  # conv-ae only: ranks sharing each frame along H (both > 1: H x W tiles)
    tp: int | None = None  # None: 2 for an LM without pp, cp and pp_tp; else 1
    pp_tp: str | None = None  # per-stage tp sizes "2,1,1" (VTP): pp = their count, sum * dp = nproc
    dp: int | None = None  # alias of dp_replicate (kept for old command lines)
    dp_replicate: int | None = None  # None: what nproc leaves after every other degree
    dp_shard: int = 1  # FSDP2 ranks (ZeRO-3 sharding of parameters, gradients, optimizer state)
    zero: int = 0  # ZeRO over dp_replicate x cp: 1 shards the optimizer state, 2 the gradients too; 0: off
    pp: int = 1
    cp_ulysses: int = 1  # context parallel: ranks sharing each sequence, all-to-all over heads (Ulysses)
    cp_ring: int = 1  # context parallel: ranks sharing each sequence, zigzag ring attention (both > 1: USP)
    cp_layout: str = "zigzag"  # ring-only cp token placement: a name of CP_LAYOUTS
    packed: bool = False  # each window is documents (corpus files) packed along S, no cross-file attention
    ep: int = 1  # moe / mla: expert-parallel ranks, borrowed from dp_shard x cp x tp (or whole blocks of replicas)
    loss_parallel: bool = False  # vocab-sharded logits and loss (never the full [B, S, V] logits)
    sequence_parallel: bool | None = None  # None: on for llama with tp > 1 (Megatron-SP)
    experts: int = 4  # moe / mla: routed experts (top-2)
    moe_bias_update_rate: float | None = None  # moe / mla: DeepSeek-V3's aux-loss-free bias, stepped by this rate
    moe_z_loss: float = 0.0  # moe / mla: router z-loss coefficient (ST-MoE) added to the loss
    moe_seq_aux_loss: float = 0.0  # moe / mla: sequence-wise balance loss coefficient (DeepSeek-V3)
    moe_capacity_factor: float | None = None  # moe / mla: Megatron's expert capacity factor; None: dropless
    moe_drop_policy: str = "probs"  # with a capacity: drop the lowest weights ("probs") or latest tokens ("position")
    moe_pad_to_capacity: bool = False  # with a capacity: fill every expert to it (fixed all-to-all sizes with --ep)
    microbatches: int = 1  # per step and dp rank: pipeline microbatches, or gradient accumulation
    schedule: str = "1f1b"  # pipeline schedule: a name of SCHEDULES
    virtual_stages: int = 1  # chunks per pipeline rank (interleaved-1f1b, -zb, looped-bfs: >= 2; zbv, dualpipev: 2)
    ac: str = "none"  # activation checkpointing of each decoder block: "none", "full", "selective" or "selective:N"
    sp_activation: str | None = None  # with SP: "shard" (keep the norm's block, regather in backward) or "gathered"
    async_tp: bool = False  # with SP over tp > 1: collective-matmul rings for SP's gathers and reduce-scatters
    compile: str | None = None  # torch.compile each decoder block with this backend ("inductor", "aot_eager", ...)
    max_norm: float | None = 1.0  # clip the global gradient norm (None / 0: no clipping)
    skip_nonfinite: int = 0  # skip up to N steps whose global loss or grad norm is NaN/inf; one more stops the run
    steps: int = 20  # total steps: a resumed run continues up to this count
    checkpoint_dir: str | None = None  # save the training state here (DCP, one directory per save)
    save_every: int = 0  # save every N steps (and after the last); 0: only after the last step
    keep: int | None = None  # keep the newest N complete saves (None: all)
    async_checkpoint: bool = False  # stage each save to CPU memory and write it while the next steps run
    resume: bool = False  # continue from the latest save in --checkpoint-dir (any layout)
    save_hf: str | None = None  # after the last step, write the model as a Hugging Face directory here
    resume_from: str | None = None  # continue from this save (a checkpoint root or one save's directory)
    allow_unverified: bool = False  # resume from a save without checksums (an earlier shardkit's)
    seq_len: int = 128
    batch_size: int = 8  # global, split over dp
    dtype: str = "float32"
    mixed_precision: str = "none"  # "bf16": bf16 compute on float32 masters, fp32 gradient reductions (dtype float32)
    seed: int = 0
    lr: float | None = None  # None: 1e-3 from scratch, 1e-4 (FINETUNE_LR) with --model-path
    lr_schedule: str | None = None  # "constant" or "warmup-cosine"; None: warmup-cosine with --model-path
    eval_every: int = 0  # validation loss on the held-out split every N steps (and after the last); 0: none
    eval_batches: int = 4  # global batches per validation
    verify: bool = False
    checks: bool = False  # run with shardkit's cross-rank check mode on (shardkit.comm.checks)
    timeout: float = 300.0  # seconds any collective (every process group) waits for a rank before failing
    report: str | None = None
    wandb: str | None = None  # log the per-step scalars to this Weights & Biases project too (offline by default)
    profile_steps: str | None = None  # "A:B": torch.profiler traces of steps A..B (1-based), one per rank
    profile_dir: str | None = None  # where the traces go; None: --report DIR/profile
    memory_snapshot: bool = False  # CUDA only: the caching allocator's history over the profiled steps
    log_every: int | None = (
        None  # a plain line every N steps when stdout is no terminal; None: 1 up to 20 steps, else 10
    )
    data: str | None = None  # a file or folder, or hf:NAME[:SPLIT]; None: the Python standard library's source tree
    data_column: str = "text"  # the text field of *.jsonl lines, *.parquet rows and hf: dataset rows in --data
    model_path: str | None = None  # a local HF checkpoint directory or *.gguf file; None: the built-in config
    tokenizer: str | None = None  # a HF tokenizer directory or *.gguf file encoding --data; None: byte tokens
    hidden_size: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate_size: int = 128
    config: str | None = None  # the TOML file these values came from, if any

    @property
    def cp_size(self) -> int:
        """Context-parallel ranks per replica: ``cp_ring * cp_ulysses``."""
        return self.cp_ring * self.cp_ulysses

    @property
    def stage_tp_sizes(self) -> tuple[int, ...]:
        """The tp size of every pipeline stage: ``--pp-tp``, else ``tp`` in each of ``pp`` stages."""
        if self.pp_tp is not None:
            return parse_pp_tp(self.pp_tp)
        return (self.tp or 1,) * self.pp


def parse_pp_tp(text) -> tuple[int, ...]:
    """``"2,1,1"`` -> ``(2, 1, 1)``: the tp size of each pipeline stage (pure).

    Raises:
        ShardkitError: not a comma-separated list of at least two ints >= 1.
    """
    try:
        sizes = tuple(int(t) for t in str(text).split(","))
    except ValueError:
        sizes = ()
    if len(sizes) < 2 or any(t < 1 for t in sizes):
        raise ShardkitError(
            f"--pp-tp must list the tp size (>= 1) of each of at least 2 pipeline stages, e.g. 2,1,1; got {text!r}"
        )
    return sizes
