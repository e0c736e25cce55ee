"""Optional dependencies: say which extra to install, in one line, before anything starts.

shardkit's core needs only torch. The Hugging Face paths need the ``hf`` extra (transformers,
safetensors), the conv-ae photo and ``loss.png`` need the ``plot`` extra (matplotlib) and the
TensorBoard scalars of ``--report`` the ``tb`` extra (tensorboard), ``--wandb`` the ``wandb`` extra
and ``--data hf:NAME`` the ``datasets`` extra. A
missing one is reported up front, by name, instead of as an ``ImportError`` traceback from a
worker process after the launch.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Sequence

from .errors import ShardkitError

__all__ = ["EXTRAS", "MissingExtraError", "missing", "require", "install_hint", "check_train"]

EXTRAS: dict[str, str] = {
    "transformers": "hf",
    "safetensors": "hf",
    "matplotlib": "plot",
    "tensorboard": "tb",
    "wandb": "wandb",
    "datasets": "datasets",
}
"""Import name of each optional dependency -> the shardkit extra that installs it."""


class MissingExtraError(ShardkitError):
    """An optional dependency that the requested feature needs is not installed."""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module without a spec
        return False


def missing(modules: Iterable[str]) -> list[str]:
    """The modules of ``modules`` that cannot be imported, in the order given."""
    return [m for m in modules if not _installed(m)]


def install_hint(modules: Iterable[str]) -> str:
    """``pip install 'shardkit[hf,plot]'`` for the extras that provide ``modules``."""
    extras = sorted({EXTRAS[m] for m in modules})
    return f"pip install 'shardkit[{','.join(extras)}]'"


def require(modules: Iterable[str], feature: str) -> None:
    """Raise :class:`MissingExtraError` in one line if any of ``modules`` is absent.

    Args:
        modules: import names, each a key of :data:`EXTRAS`.
        feature: what needs them, for the message (e.g. ``"shardkit train --model llama"``).

    Raises:
        MissingExtraError: e.g. ``shardkit train --model llama needs transformers, which is
            not installed: pip install 'shardkit[hf]'``.
    """
    absent = missing(modules)
    if absent:
        raise MissingExtraError(
            f"{feature} needs {', '.join(absent)}, which {'is' if len(absent) == 1 else 'are'} not installed: "
            f"{install_hint(absent)}"
        )


def check_train(needs: Sequence[str], what: str, report: str | None) -> list[str]:
    """Check the extras ``shardkit train`` needs before any process starts.

    Args:
        needs: the modules the model cannot be built without (its spec's
            :attr:`~shardkit.train.specs.ModelSpec.needs`: transformers for the language models,
            matplotlib for conv-ae's sample photo).
        what: what needs them, for the message (``shardkit train --model llama``).
        report: the ``--report`` folder, or None.

    Returns:
        One-line notes for optional outputs that will be skipped: ``loss.png`` without
        matplotlib, the TensorBoard scalars (``DIR/tb``) without tensorboard.

    Raises:
        MissingExtraError: a module of ``needs`` is not installed.
    """
    require(list(needs), what)
    if report is None:
        return []
    skipped = {"matplotlib": "loss.png", "tensorboard": "TensorBoard scalars (DIR/tb)"}
    return [
        f"{what} will not be written ({module} is not installed): {install_hint([module])}"
        for module, what in skipped.items()
        if missing([module])
    ]
