"""The ``--model`` names and their one-line summaries, without the models.

:mod:`.specs` builds one spec per name from here; the command line's flags (``shardkit train
--help``) read the names and summaries from here, so that listing them imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from ..errors import ShardkitError

__all__ = ["MODEL_SUMMARIES", "MODEL_FACTS", "ModelFacts", "model_facts"]

MODEL_SUMMARIES = MappingProxyType(
    {
        "llama": "Llama (GQA)",
        "qwen2": "Qwen2 (GQA, q/k/v biases)",
        "qwen3": "Qwen3 (GQA, q/k norms)",
        "moe": "Qwen3-MoE (routed experts, top-2)",
        "mla": "DeepSeek-V2 (multi-head latent attention + MoE)",
        "gemma2": "Gemma 2 (sliding window on alternate layers, logit softcaps, tied embeddings)",
        "conv-ae": "a convolutional autoencoder on a real photo, sharded with --spatial / --spatial-h",
    }
)
"""``--model`` name -> its summary (``--help``), in the order ``--help`` lists them."""


@dataclass(frozen=True)
class ModelFacts:
    """What the launcher's pure checks need of a ``--model`` (its spec's fields of the same names).

    Attributes:
        reads_corpus: trains on the text corpus (``--data``), read and checked before launch.
        default_tp: the tp size when ``--tp`` is not given, without pp, cp or ``--pp-tp``.
        min_nproc: the ranks a run without ``--nproc`` starts at least (data parallelism fills them).
        decoder: a decoder LM (the spec's ``family`` is not None): without ``--model-path`` its
            shape flags (``--hidden-size``, ``--heads``, ``--kv-heads``, ``--layers``) meet the layout.
        experts: a mixture-of-experts decoder (the spec's ``experts``): ``--ep`` needs one.
        model_type: a decoder's transformers ``model_type`` (its spec's ``family.model_type``):
            the launcher's forkserver imports its modeling code while the launcher checks the
            rest (issue 32); None for a model without one.
    """

    reads_corpus: bool = True
    default_tp: int = 2
    min_nproc: int = 4
    decoder: bool = True
    experts: bool = False
    model_type: str | None = None


_MODEL_TYPES = {"moe": "qwen3_moe", "mla": "deepseek_v2"}  # the others' model_type is their name

MODEL_FACTS = MappingProxyType(
    {
        name: ModelFacts(False, 1, 1, decoder=False)
        if name == "conv-ae"
        else ModelFacts(experts=name in ("moe", "mla"), model_type=_MODEL_TYPES.get(name, name))
        for name in MODEL_SUMMARIES
    }
)
"""``--model`` name -> its :class:`ModelFacts`, here so that the launcher checks the layout and
``--data`` before importing torch (issue 32); :mod:`.specs` copies them into each spec."""


def model_facts(name: str) -> ModelFacts:
    """The facts of ``--model name``.

    Raises:
        ShardkitError: not a registered model (the message lists them).
    """
    if name not in MODEL_FACTS:
        raise ShardkitError(f"--model must be one of {', '.join(MODEL_FACTS)}, got {name!r}")
    return MODEL_FACTS[name]
