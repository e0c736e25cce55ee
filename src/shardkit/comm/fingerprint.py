"""Fingerprints of a model's plan and replicated weights, agreed over a group (check mode).

The per-op checks see shapes and arguments, never values: ranks that built the model from
different seeds, or applied different plans, run every collective with agreeing metadata and
train silently wrong. So the transforms (:func:`~shardkit.apply_tp`, :func:`~shardkit.apply_spatial`,
:func:`~shardkit.load_sharded`, :func:`~shardkit.parallelize.parallelize`) fingerprint what must
be identical on every rank of their group whenever the check mode is on (``shardkit.comm.checks``,
``SHARDKIT_CHECKS=1``, ``shardkit train --checks``): no argument, so that turning checks on is
the one switch, and the decision is the same process setting on every rank.

A fingerprint is two small all-gathers:

1. int64 ``[plan digest, names digest, tensor count]``: the plan (one line per module style or
   parameter layout, CRC-32) and the names and full shapes of the fingerprinted tensors;
2. float64 ``[sum, sum(x_i * (i + 1))]`` per tensor (flat index ``i``, accumulated in float64):
   the plain sum misses permutations, the index-weighted sum catches them. Compared bitwise
   (same data, same kernels, same bits; NaNs compare equal to themselves).

Every rank inspects the same gathered tables and raises the same :class:`RankMismatchError`,
naming the ranks that differ from rank 0 and the first differing tensor. Meta tensors (a model
not loaded yet) are left out. Cost: a pass over the fingerprinted tensors, once per transform.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist

from ..errors import RankMismatchError
from . import ledger
from ._compat import all_gather_single
from ._group import resolve_group
from .checks import checks_enabled

__all__ = ["fingerprint", "maybe_fingerprint", "describe_style", "group_device"]


def _crc(lines: Iterable[str]) -> int:
    crc = 0
    for line in lines:
        crc = zlib.crc32(line.encode() + b"\n", crc)
    return crc


def describe_style(style) -> str:
    """A rank-independent line for a style object: its class and its plain-valued attributes."""
    plain = (bool, int, float, str, type(None))
    items = sorted(
        (k, v)
        for k, v in vars(style).items()
        if isinstance(v, plain) or (isinstance(v, tuple) and all(isinstance(e, plain) for e in v))
    )
    return f"{type(style).__name__}{items}"


def group_device(g, tensors: Iterable[torch.Tensor] = ()) -> torch.device:
    """Where the metadata tensors of a collective over ``g`` live: the CPU on gloo, else the
    device of the first non-CPU, non-meta tensor given, else the current accelerator."""
    if dist.get_backend(g.pg) == "gloo":
        return torch.device("cpu")
    found = next((t.device for t in tensors if t.device.type not in ("cpu", "meta")), None)
    return found or torch.accelerator.current_accelerator(check_available=True) or torch.device("cpu")


def _checksums(tensors: list[torch.Tensor], device) -> torch.Tensor:
    out = torch.zeros(2 * len(tensors), dtype=torch.float64, device=device)
    for i, t in enumerate(tensors):
        flat = t.detach().reshape(-1).to(device=device, dtype=torch.float64)
        idx = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=device)
        out[2 * i] = flat.sum()
        out[2 * i + 1] = (flat * idx).sum()
    return out


def _gather(mine: torch.Tensor, g, api: str) -> torch.Tensor:
    table = mine.new_empty(g.size * mine.numel())
    ledger.record(
        "metadata_all_gather", api, "check", g.size, mine.nbytes, table.nbytes, pg=g.pg, shape=tuple(mine.shape)
    )
    all_gather_single(table, mine, group=g.pg)
    return table.view(g.size, -1)


def fingerprint(
    tensors: Mapping[str, torch.Tensor],
    group,
    api: str,
    plan: Iterable[str] = (),
    hint: str = "a per-rank seed or checkpoint?",
) -> None:
    """Raise on every rank unless every rank of ``group`` holds the same ``plan`` and ``tensors``.

    Args:
        tensors: ``{name: tensor}`` that must be bitwise identical on every rank (replicated
            parameters, a broadcast input); meta tensors are skipped.
        group: ``ProcessGroup`` or 1-D ``DeviceMesh`` of ``R`` ranks.
        api: the calling transform, for messages.
        plan: lines describing the plan (module styles, parameter layouts, options).
        hint: the likely cause, ending the message of a value mismatch.

    Raises:
        RankMismatchError: on every rank: the plans, the tensor names/shapes, or a tensor's
            checksum differ, naming the offending ranks and the first differing tensor.

    Collective over ``group`` (two all-gathers; none when ``R == 1``).
    """
    g = resolve_group(group, api)
    if g.size == 1:
        return
    named = [(n, t) for n, t in tensors.items() if not t.is_meta]
    device = group_device(g, (t for _, t in named))
    head = torch.tensor(
        [_crc(plan), _crc(f"{n} {tuple(t.shape)} {t.dtype}" for n, t in named), len(named)],
        dtype=torch.int64,
        device=device,
    )
    rows = _gather(head, g, api).tolist()
    for what, col, why in (
        ("plan (module styles and parameter layouts)", 0, "every rank must apply the same plan"),
        ("tensor names, shapes and dtypes", 1, hint),
    ):
        bad = [r for r in range(g.size) if rows[r][col] != rows[0][col]]
        if bad:
            raise RankMismatchError(
                f"{api}: ranks {bad} differ from rank 0 in the {what} in a group of {g.size} "
                f"(digests {[row[col] for row in rows]}); {why}"
            )
    if not named:  # the same on every rank: the names digests agreed
        return
    sums = _gather(_checksums([t for _, t in named], device), g, api).cpu()
    bits = sums.view(torch.int64)
    differs = (bits != bits[0]).any(dim=0).nonzero().flatten().tolist()
    if differs:
        i = differs[0] // 2
        bad = [r for r in range(g.size) if not torch.equal(bits[r, 2 * i : 2 * i + 2], bits[0, 2 * i : 2 * i + 2])]
        raise RankMismatchError(
            f"{api}: replicated values differ across the {g.size} ranks of the group: ranks {bad} differ from rank 0, "
            f"first at {named[i][0]!r} (sum {sums[0, 2 * i].item():.9g} on rank 0, "
            f"{', '.join(f'{sums[r, 2 * i].item():.9g} on rank {r}' for r in bad)}); "
            f"{len({d // 2 for d in differs})} of {len(named)} tensors differ ({hint})"
        )


def maybe_fingerprint(tensors: Mapping[str, torch.Tensor], group, api: str, plan: Iterable[str] = ()) -> None:
    """:func:`fingerprint` when the check mode is on, else nothing (no collective)."""
    if checks_enabled():
        fingerprint(tensors, group, api, plan)
