"""Load a Hugging Face safetensors checkpoint straight into a tensor-parallel model, slice by slice.

:func:`load_sharded` shards the (ideally meta-device) model with :func:`~shardkit.apply_tp`, then
fills every parameter from the byte ranges of the file that its
:class:`~shardkit.sharding.ShardSpec` names: each rank reads only its own rows / columns of
sharded parameters (a ``safe_open`` slice per range, so packed parts and replicated KV heads are
read directly) and replicated parameters whole. The full model never exists on any rank; the
bytes a rank reads are about ``1 / R`` of the sharded weights plus the replicated ones
(:attr:`SafetensorsCheckpoint.bytes_read`).

Checkpoint keys are the model's ``named_parameters`` names, as ``save_pretrained`` writes them,
with one conversion transformers 5 applies on save: fused MoE experts (``experts.gate_up_proj``
``[E, 2 I, H]``, ``experts.down_proj`` ``[E, H, I]``) are written per expert
(``experts.{e}.gate_proj.weight`` ``[I, H]``, ``up_proj``, ``down_proj``). Both layouts load;
each fused parameter's rows are then read from the per-expert tensors (:class:`Piece`).

Source: the slice-per-rank loading of Megatron-LM / vLLM weight loaders and Hugging Face
``from_pretrained(tp_plan=...)``; safetensors' lazy ``get_slice`` reads.
"""

from __future__ import annotations

import math
import os
import re
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from ..comm._group import resolve_group
from ..comm.fingerprint import maybe_fingerprint
from ..errors import ShardkitError
from ..sharding import shard_spec
from ..tensor_parallel.apply import apply_tp
from ..tensor_parallel.gather import unwrap
from .contents import check_contents
from .meta import materialize_meta
from .safetensors_file import SafetensorsCheckpoint

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from .._types import Group

__all__ = ["SafetensorsCheckpoint", "load_sharded", "materialize_meta", "Piece"]


class Piece(NamedTuple):
    """Checkpoint tensor ``key`` (shape ``shape``) is the block ``box`` (a ``(start, stop)`` per dim)
    of a model parameter; leading box dims beyond ``shape``'s rank are indices (an expert)."""

    key: str
    box: tuple[tuple[int, int], ...]
    shape: tuple[int, ...]


_EXPERTS = re.compile(r"(.+\.experts)\.(gate_up_proj|down_proj)$")


def _expert_pieces(name: str, shape: tuple[int, ...]) -> list[Piece] | None:
    """Per-expert checkpoint tensors of a fused 3-D expert parameter (transformers 5 save format:
    ``MergeModulelist(dim=0)`` then, for ``gate_up_proj``, ``Concatenate(dim=1)`` of gate and up)."""
    m = _EXPERTS.fullmatch(name)
    if m is None or len(shape) != 3:
        return None
    prefix, kind = m.groups()
    E, rows, cols = shape
    if kind == "down_proj":
        return [
            Piece(f"{prefix}.{e}.down_proj.weight", ((e, e + 1), (0, rows), (0, cols)), (rows, cols)) for e in range(E)
        ]
    half = rows // 2
    return [
        Piece(f"{prefix}.{e}.{part}_proj.weight", ((e, e + 1), (lo, lo + half), (0, cols)), (half, cols))
        for e in range(E)
        for part, lo in (("gate", 0), ("up", half))
    ]


def _fused_or_named(name: str, shape: tuple[int, ...], keys: set[str]) -> list[Piece]:
    """The pieces of ``name``: the tensor itself when the checkpoint holds it, else per-expert."""
    if name in keys:
        return [Piece(name, tuple((0, s) for s in shape), tuple(shape))]
    return _expert_pieces(name, shape) or [Piece(name, tuple((0, s) for s in shape), tuple(shape))]


def _ignored(model: nn.Module) -> Callable[[str], bool]:
    """Checkpoint keys that are not "unexpected" for ``model``: any name its state dict or buffers
    hold (a tied ``lm_head.weight``, a non-persistent ``inv_freq`` some files carry) and Hugging
    Face's ``_keys_to_ignore_on_load_unexpected`` patterns."""
    names = set(model.state_dict(keep_vars=True)) | {n for n, _ in model.named_buffers()}
    patterns = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    return lambda key: key in names or any(p.search(key) for p in patterns)


def _fill(dest: torch.Tensor, pieces: list[Piece], box: list[tuple[int, int]], ckpt: SafetensorsCheckpoint) -> None:
    """Write the full-tensor block ``box`` into ``dest`` (shaped like ``box``) from ``pieces``."""
    for piece in pieces:
        inter = [(max(a, pa), min(b, pb)) for (a, b), (pa, pb) in zip(box, piece.box)]
        if any(a >= b for a, b in inter):
            continue
        lead = len(piece.box) - len(piece.shape)  # leading dims the piece is indexed on (experts)
        file_box = tuple((a - pa, b - pa) for (a, b), (pa, _) in zip(inter[lead:], piece.box[lead:]))
        region = tuple(slice(a - ba, b - ba) for (a, b), (ba, _) in zip(inter, box))
        part = ckpt.read(piece.key, file_box)
        dest[region] = part.reshape([b - a for a, b in inter]).to(dest.dtype)


def load_sharded(
    model: nn.Module,
    path: str | os.PathLike[str],
    tp_mesh: Group,
    plan: dict | None = None,
    *,
    device: torch.device | str | None = None,
    init_buffers: Callable[[nn.Module], None] | None = None,
    **apply_tp_kwargs: Any,
) -> nn.Module:
    """Shard ``model`` with :func:`~shardkit.apply_tp` and fill it from a safetensors checkpoint,
    each rank reading only its own slices.

    This reads a *Hugging Face* checkpoint (the full, unsharded ``*.safetensors`` files a model
    is published with): the way to start from pretrained weights. To save and resume a model
    that is already sharded, use :func:`~shardkit.checkpoint.save_sharded_checkpoint` /
    :func:`~shardkit.checkpoint.load_sharded_checkpoint` (shardkit's own DCP checkpoint) instead.

    Build the model on the meta device so the full model is never allocated::

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        load_sharded(model, "ckpt_dir", mesh["tp"], device="cuda")

    Sharded parameters ``[..., N, ...]`` (``N`` the full size of their ShardSpec dim) become
    ``[..., N_r, ...]``, read range by range; replicated ones are read whole. Meta buffers are
    read from the checkpoint when persistent, else recomputed by ``init_buffers`` (see below).

    Args:
        model: the unsharded model (meta or real tensors); every rank of the group passes the
            same architecture.
        path: a checkpoint directory (``model.safetensors`` or ``model.safetensors.index.json``),
            a ``.safetensors`` file, or an open :class:`SafetensorsCheckpoint` (to count bytes).
        tp_mesh: the tp ``ProcessGroup`` or 1-D ``DeviceMesh``.
        plan: the tp plan (None: the model's own), as for :func:`~shardkit.apply_tp`.
        device: where parameters are materialized; default the device of the model's first
            non-meta parameter, else CPU.
        init_buffers: ``fn(module)`` recomputing the non-persistent buffers of ``module``
            (rotary ``inv_freq``) in place; default ``model._init_weights`` (Hugging Face).
        **apply_tp_kwargs: ``loss_parallel``, ``styles``, ``check`` of :func:`~shardkit.apply_tp`.

    Returns:
        ``model``, sharded and loaded (the file's dtypes must be the model's: a load never casts).

    Raises:
        ShardkitError: on every rank of the group (agreed by one ``all_gather_object``, before
            the model is touched): no checkpoint, a parameter missing from it, a tensor of it that
            no rank's model holds, a shape or a dtype that differs from the model's (a bfloat16
            model does not take a float32 file: build the model in the file's dtype); buffers
            that cannot be recomputed.
    """
    owns = not isinstance(path, SafetensorsCheckpoint)
    ckpt: SafetensorsCheckpoint | None = None
    error, saved, expected, sources = None, None, {}, {}
    root = unwrap(model)
    try:
        ckpt = path if isinstance(path, SafetensorsCheckpoint) else SafetensorsCheckpoint(path)
        keys = ckpt.keys()
        params = dict(root.named_parameters())
        # persistent buffers (BatchNorm statistics) are read when the checkpoint has them
        buffers = {
            n: b for n, b in root.state_dict(keep_vars=True).items() if not isinstance(b, nn.Parameter) and n in keys
        }
        for name, t in {**params, **buffers}.items():
            sources[name] = _fused_or_named(name, tuple(t.shape), keys)
            expected.update({piece.key: (piece.shape, t.dtype) for piece in sources[name]})
        saved = {k: (ckpt.shape(k), ckpt.dtype(k)) for k in keys}
    except ShardkitError as exc:
        error = str(exc)
    except Exception as exc:  # noqa: BLE001 - a corrupt file on one rank must fail every rank, not hang them
        error = f"cannot read the checkpoint at {path}: {type(exc).__name__}: {exc}"
    try:
        check_contents(expected, saved, tp_mesh, "load_sharded", read_error=error, ignored=_ignored(root))
        assert ckpt is not None  # opened, or check_contents raised on every rank
        if device is None:
            device = next((p.device for p in params.values() if not p.is_meta), torch.device("cpu"))
        apply_tp(root, tp_mesh, plan, **apply_tp_kwargs)
        materialize_meta(root, device, set(buffers), init_buffers)
        rank = resolve_group(tp_mesh, "load_sharded").rank
        tensors = {**dict(root.named_parameters()), **{n: root.get_buffer(n) for n in buffers}}
        with torch.no_grad():
            for name, t in tensors.items():
                _load_param(t, sources[name], ckpt, rank)
        # check mode: the replicated tensors were read whole, so every rank must hold the same
        replicated = {n: t for n, t in tensors.items() if shard_spec(t) is None}
        maybe_fingerprint(replicated, tp_mesh, "load_sharded", [f"{n} {_layout(t)}" for n, t in tensors.items()])
    finally:
        if owns and ckpt is not None:
            ckpt.close()
    return model


def _layout(t: torch.Tensor) -> str:
    spec = shard_spec(t)
    return "replicated" if spec is None else f"dim {spec.dim} of {spec.full_size}: {spec.ranges}"


def _load_param(p: torch.Tensor, pieces: list[Piece], ckpt: SafetensorsCheckpoint, rank: int) -> None:
    spec = shard_spec(p)
    if spec is None:
        _fill(p.data, pieces, [(0, s) for s in p.shape], ckpt)
        return
    full = list(p.shape)
    full[spec.dim] = spec.full_size
    pos = 0
    for a, b in spec.ranges[rank]:
        box = [(0, s) for s in full]
        box[spec.dim] = (a, b)
        if b > a and math.prod(full) > 0:
            _fill(p.data.narrow(spec.dim, pos, b - a), pieces, box, ckpt)
        pos += b - a
