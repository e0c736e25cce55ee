"""The model-spec registry of ``shardkit train``: what each ``--model`` is, in one place.

A :class:`ModelSpec` holds the hooks the trainer needs for one model: its own rules (checked by
:func:`.config.validate_config` before launch), how to build it, its task, how to parallelize
it, what describes it in a checkpoint, and what one sample is. :data:`SPECS` maps every
``--model`` name to its spec (an explicit dict, built once at import: nothing registers itself).
The rest of the application asks ``model_spec(cfg.model)`` instead of comparing names.

* ``llama``, ``qwen2``, ``qwen3``, ``moe`` (Qwen3-MoE), ``mla`` (DeepSeek-V2: multi-head latent
  attention + MoE), ``gemma2`` (Gemma 2): the decoder LMs (:mod:`.lm_spec`), built from flags (:mod:`.lm_families`)
  or loaded from ``--model-path`` (the checkpoint's ``model_type`` picks the spec,
  :func:`spec_of_family`);
* ``conv-ae``: the spatially sharded convolutional autoencoder (:mod:`.conv_spec`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from types import MappingProxyType
from typing import Any

from ..errors import ShardkitError
from .conv_ae import CROP
from .conv_spec import build_conv, conv_outputs, conv_task, parallelize_conv_ae, validate_conv
from .lm_families import DEEPSEEK_V2, GEMMA2, LLAMA, QWEN2, QWEN3, QWEN3_MOE, LMFamily
from .lm_spec import build_lm, describe_lm, lm_task, parallelize_lm, validate_lm
from .model_names import MODEL_FACTS, MODEL_SUMMARIES, model_facts
from .options import TrainConfig

__all__ = ["ModelSpec", "SPECS", "MODELS", "model_spec", "spec_of_family"]


@dataclass(frozen=True)
class ModelSpec:
    """One ``--model``: its hooks (each a function of the validated :class:`.options.TrainConfig`).

    Attributes:
        name: the ``--model`` value.
        summary: one line for ``--help``.
        family: the Hugging Face architecture of a decoder LM, None for other models.
        validate: the model's own rules: ``cfg -> cfg`` with its options resolved; raises
            :class:`~shardkit.errors.ShardkitError` naming the flags at fault.
        build: ``cfg -> nn.Module``, the full model, the same on every rank (``cfg.seed``).
        task: ``(cfg, device, corpus) -> task`` for :func:`.trainer.train_step` (``corpus``: the
            LM's token stream, None to read it).
        parallelize: ``(model, mesh, cfg, task) -> (ParallelModel, pipeline loss or None)``;
            ``mesh`` None: one process, the model unchanged.
        describe: ``cfg -> dict``, what fixes the parameters beyond ``model`` and ``dtype``
            (the checkpoint manifest's model description).
        sample_size: ``cfg -> int``, tokens or pixels of one sample of the batch.
        unit: ``(short, long)`` name of what :attr:`sample_size` counts (``("tok", "tokens")``).
        reads_corpus: trains on the text corpus (``--data``), read and checked before launch.
        planned: the planner's memory model covers it (:mod:`.limits` checks the machine).
        default_tp: the tp size when ``--tp`` is not given, without pp, cp or ``--pp-tp``.
        min_nproc: the ranks a run without ``--nproc`` starts at least (data parallelism fills them).
        outputs: ``(cfg, folder, full_params) -> [paths]`` written to ``--report`` after training, or None.
        needs: the optional modules the model cannot be built without, checked before launch;
            ``needs_why`` says why, after the ``--model`` in the message.
    """

    name: str
    summary: str
    family: LMFamily | None
    validate: Callable[[TrainConfig], TrainConfig]
    build: Callable[[TrainConfig], Any]
    task: Callable[..., Any]
    parallelize: Callable[..., tuple[Any, Any]]
    describe: Callable[[TrainConfig], dict]
    sample_size: Callable[[TrainConfig], int]
    unit: tuple[str, str] = ("tok", "tokens")
    reads_corpus: bool = True
    planned: bool = True
    default_tp: int = 2
    min_nproc: int = 4
    outputs: Callable[[TrainConfig, str, dict], list[str]] | None = None
    needs: tuple[str, ...] = ("transformers",)
    needs_why: str = ""

    @property
    def experts(self) -> bool:
        """A mixture-of-experts model (``--ep``, ``--experts``)."""
        return self.family is not None and self.family.experts


def _decoder(name: str, family: LMFamily) -> ModelSpec:
    return ModelSpec(
        name=name,
        summary=MODEL_SUMMARIES[name],
        family=family,
        validate=partial(validate_lm, family=family),
        build=partial(build_lm, family=family),
        task=lm_task,
        parallelize=parallelize_lm,
        describe=partial(describe_lm, family=family),
        sample_size=lambda cfg: cfg.seq_len,
        reads_corpus=MODEL_FACTS[name].reads_corpus,
        default_tp=MODEL_FACTS[name].default_tp,
        min_nproc=MODEL_FACTS[name].min_nproc,
    )


SPECS = MappingProxyType(
    {
        "llama": _decoder("llama", LLAMA),
        "qwen2": _decoder("qwen2", QWEN2),
        "qwen3": _decoder("qwen3", QWEN3),
        "moe": _decoder("moe", QWEN3_MOE),
        "mla": _decoder("mla", DEEPSEEK_V2),
        "gemma2": _decoder("gemma2", GEMMA2),
        "conv-ae": ModelSpec(
            name="conv-ae",
            summary=MODEL_SUMMARIES["conv-ae"],
            family=None,
            validate=validate_conv,
            build=build_conv,
            task=conv_task,
            parallelize=parallelize_conv_ae,
            describe=lambda cfg: {},
            sample_size=lambda cfg: CROP[0] * CROP[1],
            unit=("px", "pixels"),
            reads_corpus=MODEL_FACTS["conv-ae"].reads_corpus,
            planned=False,
            default_tp=MODEL_FACTS["conv-ae"].default_tp,
            min_nproc=MODEL_FACTS["conv-ae"].min_nproc,
            outputs=conv_outputs,
            needs=("matplotlib",),
            needs_why=" (its sample photo)",
        ),
    }
)
MODELS = tuple(SPECS)


def model_spec(name: str) -> ModelSpec:
    """The spec of ``--model name``.

    Raises:
        ShardkitError: not a registered model (the message lists them).
    """
    model_facts(name)  # a registered name, or the error listing them
    return SPECS[name]


def spec_of_family(model_type: str) -> ModelSpec:
    """The decoder spec of a ``--model-path`` checkpoint's ``config.model_type``.

    Raises:
        ShardkitError: no spec has this family (the message lists the supported ones).
    """
    for spec in SPECS.values():
        if spec.family is not None and spec.family.model_type == model_type:
            return spec
    known = ", ".join(s.family.model_type for s in SPECS.values() if s.family is not None)
    raise ShardkitError(f"--model-path: a {model_type!r} model; supported families: {known}")
