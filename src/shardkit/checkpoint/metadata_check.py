"""The fields of an unpickled DCP ``Metadata``, checked before anything hashes, allocates or reads
with them.

Unpickling builds DCP's dataclasses without running their constructors, so a field holds
whatever the file says: an offset that is a nested tuple, a tensor size of ``[2^20, 2^20]``
(an 8 TiB ``torch.empty`` in the export), an item ``length`` of 2^40 (one ``read`` of a TiB).
:func:`check_metadata` accepts tensor metadata only, each field of its expected type and within
what the save's files can hold:

* shapes and offsets are tuples of at most :data:`MAX_DIMS` plain ints in ``[0, 2^62)``;
* every chunk lies inside its tensor, every stored item in a regular file of the save's own
  directory (no link out of it), ``offset + length`` within that file's size;
* a chunk's elements fit in its stored item's bytes, and a tensor's chunks cover it, so no
  tensor is larger than the files that hold it.

Source: DCP's metadata dataclasses (``torch.distributed.checkpoint.metadata``) and its
file-system ``_StorageInfo``.
"""

from __future__ import annotations

import math
import os

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ..errors import ShardkitError
from .paths import regular_file_inside

__all__ = ["check_metadata", "MAX_DIMS"]

MAX_DIMS = 64
_MAX_EXTENT = 1 << 62


def _shape(value, ndim: int | None = None) -> tuple[int, ...] | None:
    """``value`` as a tuple of ints if it is a small one (of ``ndim`` entries), else None."""
    if not isinstance(value, tuple) or len(value) > MAX_DIMS or (ndim is not None and len(value) != ndim):
        return None
    if not all(type(v) is int and 0 <= v < _MAX_EXTENT for v in value):
        return None
    return tuple(value)


def _tensor(fqn: str, m, file: str) -> tuple[tuple[int, ...], int, dict]:
    """(size, itemsize, {chunk offsets: chunk numel}) of one checked tensor entry."""
    props = getattr(m, "properties", None)
    size = _shape(getattr(m, "size", None))
    chunks = getattr(m, "chunks", None)
    if (
        not isinstance(props, TensorProperties)
        or not isinstance(props.dtype, torch.dtype)
        or size is None
        or not isinstance(chunks, list)
    ):
        raise ShardkitError(f"{file}: tensor {fqn!r} has a malformed entry (dtype, size or chunks)")
    found: dict = {}
    for chunk in chunks:
        offsets = _shape(getattr(chunk, "offsets", None), len(size))
        sizes = _shape(getattr(chunk, "sizes", None), len(size))
        if not isinstance(chunk, ChunkStorageMetadata) or offsets is None or sizes is None:
            raise ShardkitError(f"{file}: tensor {fqn!r} has a chunk whose offsets or sizes are not {len(size)} ints")
        if any(o + s > d for o, s, d in zip(offsets, sizes, size)):
            raise ShardkitError(
                f"{file}: tensor {fqn!r} {list(size)} has a chunk {list(sizes)} at {list(offsets)} outside it"
            )
        found[offsets] = math.prod(sizes)
    return size, props.dtype.itemsize, found


def _items(metadata: Metadata, file: str, directory: str) -> dict:
    """``{(fqn, offsets): stored length}`` of the checked storage records."""
    sizes: dict[str, int] = {}
    items: dict = {}
    for index, info in metadata.storage_data.items():
        fqn = getattr(index, "fqn", None)
        offset = _shape(getattr(index, "offset", None))
        name = getattr(info, "relative_path", None)
        if not isinstance(index, MetadataIndex) or not isinstance(fqn, str) or offset is None:
            raise ShardkitError(f"{file}: a stored item's index is malformed (its offset is not a small tuple of ints)")
        if (
            not isinstance(name, str)
            or os.path.basename(name) != name
            or name in ("", ".", "..")
            or getattr(info, "transform_descriptors", None)
        ):
            raise ShardkitError(f"{file}: item {fqn!r} is stored at {name!r}, not a plain file of the save's directory")
        start, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (type(start) is int and type(length) is int and start >= 0 and length >= 0):
            raise ShardkitError(f"{file}: item {fqn!r} has a malformed byte range ({start!r}, {length!r})")
        if name not in sizes:
            sizes[name] = regular_file_inside(directory, os.path.join(directory, name), "data file")
        if start + length > sizes[name]:
            raise ShardkitError(
                f"{file}: item {fqn!r} at chunk offset {list(offset)} claims bytes {start}..{start + length} "
                f"of {name}, which holds {sizes[name]} (truncated, or a crafted length): refused before reading"
            )
        items[(fqn, offset)] = length
    return items


def check_metadata(metadata, file: str, directory: str) -> None:
    """Refuse DCP metadata that is not tensor metadata within the save's files (see the module).

    Args:
        metadata: what ``file`` unpickled to.
        file: the ``.metadata`` file, named in errors.
        directory: the save's directory, holding every data file.

    Raises:
        ShardkitError: naming ``file`` and the field at fault.
    """
    if (
        not isinstance(metadata, Metadata)
        or not isinstance(metadata.storage_data, dict)
        or not isinstance(metadata.state_dict_metadata, dict)
    ):
        raise ShardkitError(f"{file} is not a DCP metadata file (it holds a {type(metadata).__name__})")
    entries = metadata.state_dict_metadata
    bytes_items = sorted(str(k) for k, m in entries.items() if not isinstance(m, TensorStorageMetadata))
    if bytes_items:
        raise ShardkitError(
            f"{file} holds pickled (non-tensor) items {bytes_items[:3]}, which shardkit never writes and does not load"
        )
    if not all(isinstance(k, str) for k in entries):
        raise ShardkitError(f"{file}: a tensor's name is not a string")
    items = _items(metadata, file, directory)
    for fqn, m in entries.items():
        size, itemsize, chunks = _tensor(fqn, m, file)
        for offsets, numel in chunks.items():
            length = items.get((fqn, offsets))
            if length is None:
                raise ShardkitError(f"{file}: tensor {fqn!r} has a chunk at {list(offsets)} with no stored item")
            if numel * itemsize > length:
                raise ShardkitError(
                    f"{file}: tensor {fqn!r}'s chunk at {list(offsets)} claims {numel} elements "
                    f"({numel * itemsize} bytes), more than its stored {length} bytes"
                )
        if sum(chunks.values()) < math.prod(size):
            raise ShardkitError(
                f"{file}: tensor {fqn!r} claims size {list(size)} ({math.prod(size)} elements), but its "
                f"chunks hold {sum(chunks.values())}: more than the save's files hold"
            )
