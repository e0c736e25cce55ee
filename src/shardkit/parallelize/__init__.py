"""Compose the parallel axes on a model: one ``parallelize`` (tp -> cp -> ep -> dp), one for stages.

* :func:`parallelize`: apply tensor (with sequence parallelism as an option), context, expert
  and data parallelism (FSDP2 / HSDP, or the replicated path) to a Hugging Face decoder.
* :func:`parallelize_stage`: cut the decoder into pipeline stages first, then the same
  :func:`parallelize` on this rank's stage.
* :func:`parallelize_conv`: spatial x dp on a convolutional model (frames sharded along H / W).
* :class:`DecoderStageModule`: one pipeline stage of a Hugging Face decoder (its share of the
  layers under the full model's names), :func:`decoder_stage_layers`, :func:`check_pp` and
  :func:`sum_tied_embedding_grads` (the tied embedding's two copies).
* :func:`gather_full_parameters`: the full parameters back, for checks and reports.
* :class:`ACPolicy`: activation checkpointing as a policy (ops to save, per-module overrides,
  every N-th block), for ``activation_checkpoint=``.
"""

from .ac_policy import ACPolicy
from .conv import parallelize_conv
from .decoder import ParallelModel, decoder_layers, parallelize
from .decoder_stages import DecoderStageModule, check_pp, decoder_stage_layers, sum_tied_embedding_grads
from .gather import gather_full_parameters
from .pipeline import parallelize_stage

__all__ = [
    "ACPolicy",
    "ParallelModel",
    "parallelize",
    "parallelize_conv",
    "parallelize_stage",
    "gather_full_parameters",
    "decoder_layers",
    "DecoderStageModule",
    "decoder_stage_layers",
    "check_pp",
    "sum_tied_embedding_grads",
]
