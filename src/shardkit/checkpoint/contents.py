"""Refuse a checkpoint that does not match the model, on every rank, before anything is read.

Every load path (:func:`~shardkit.load_sharded_checkpoint`, :func:`~shardkit.load_sharded`, the
trainer's resume) describes what it expects (``{key: (full shape, dtype)}``) and what the
checkpoint holds, and calls :func:`check_contents`. A load that casts would lose precision
silently (a float32 checkpoint in a bfloat16 model loses up to 3.9e-3 relative) and a load that
skips keys leaves parameters at their initial values, so both are errors, as in PyTorch's
``load_state_dict(strict=True)``.

The verdict is agreed: one :func:`~shardkit.comm.agree.agree` gathers each rank's problems and keys.
"Unexpected" means in the checkpoint and expected by *no* rank of the group (a pipeline stage
holds only its own layers), so every rank computes the same set and raises the same error.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from ..comm._group import resolve_group
from ..comm.agree import agree, by_ranks

if TYPE_CHECKING:
    import torch

    from .._types import Group

__all__ = ["Entry", "check_contents"]

# (full shape, dtype); dtype None: not a tensor (DCP bytes) or not known
Entry = tuple[tuple[int, ...], "torch.dtype | None"]

_SHOWN = 6  # keys named per kind of problem in a message


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _shown(keys: list[str]) -> str:
    more = f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
    return ", ".join(keys[:_SHOWN]) + more


def _local_problems(expected: Mapping[str, Entry], saved: Mapping[str, Entry]) -> list[str]:
    problems = []
    missing = sorted(k for k in expected if k not in saved)
    if missing:
        problems.append(f"{len(missing)} key(s) of the model are not in the checkpoint: {_shown(missing)}")
    shapes = sorted(
        f"{k} (checkpoint {list(saved[k][0])}, model {list(e[0])})"
        for k, e in expected.items()
        if k in saved and saved[k][1] is not None and tuple(saved[k][0]) != tuple(e[0])
    )
    if shapes:
        problems.append(f"full shapes differ: {_shown(shapes)}")
    dtypes = sorted(
        f"{k} (checkpoint {_name(saved[k][1])}, model {_name(e[1])})"
        for k, e in expected.items()
        if k in saved and None not in (saved[k][1], e[1]) and saved[k][1] != e[1]
    )
    if dtypes:
        problems.append(f"dtypes differ (a load never casts): {_shown(dtypes)}")
    return problems


def check_contents(
    expected: Mapping[str, Entry],
    saved: Mapping[str, Entry] | None,
    group: Group,
    op: str,
    *,
    read_error: str | None = None,
    ignored: Callable[[str], bool] | None = None,
) -> None:
    """Collective over ``group``: raise the same :class:`ShardkitError` on every rank when any
    rank's checkpoint does not match its model.

    Args:
        expected: this rank's keys, each ``(full shape, dtype)``.
        saved: the checkpoint's keys, the same way (None when ``read_error`` is set).
        group: every rank loading (a ``ProcessGroup`` or 1-D ``DeviceMesh``).
        op: the loading function, named in the message.
        read_error: this rank could not read the checkpoint.
        ignored: keys of the checkpoint that no model is expected to hold (never "unexpected").

    Raises:
        ShardkitError: on every rank of ``group``: a rank could not read the checkpoint, keys
            missing from it, keys no rank expects, full shapes or dtypes that differ.
    """
    g = resolve_group(group, op)
    problems = [read_error] if read_error else _local_problems(expected, saved or {})

    def judge(everyone: list) -> list[str]:
        wanted = {k for _, keys, _ in everyone for k in keys}
        stored = {k for _, _, keys in everyone for k in keys}
        unexpected = sorted(k for k in stored - wanted if ignored is None or not ignored(k))
        lines = by_ranks([ps for ps, _, _ in everyone])  # the same problem on several ranks is said once
        if unexpected:
            lines.append(f"{len(unexpected)} key(s) of the checkpoint are in no rank's model: {_shown(unexpected)}")
        return lines

    mine = [problems, sorted(expected), sorted(saved or {})]
    agree(
        g, op, None, mine, judge=judge, gather=True, headline="checkpoint refused on every rank of the group of {size}"
    )
