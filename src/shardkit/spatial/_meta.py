"""Small shared helpers of the sharded layers: split-size inference and graph-keeping empties."""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterator

import torch

from ..comm._group import resolve_group
from ..comm._validate import dim_of, gather_sizes  # re-exported: the layers' size inference is the ops' own
from ..comm.checks import checks_enabled
from ..errors import ShardkitError

__all__ = ["gather_sizes", "inferred_sizes", "keep_graph_empty", "layout_key"]

_SHAPES = 8  # the layouts a layer remembers the sizes of
_state = threading.local()


@contextlib.contextmanager
def layout_key(key: Hashable) -> Iterator[None]:
    """Within this context, the layers with ``infer_sizes`` learn their sizes once per ``key``.

    ``key`` must be the same on every rank and fix every rank's local shapes, e.g. the *global*
    input shape of a model that splits it the same way each time (the trainer's crops). Each
    layer then all-gathers its sizes on the first call of a key and its local input shape, and
    reuses them after: every rank finds them or none does. Without a key (and always in the
    check mode) every call all-gathers: a rank's local shape alone does not fix its peers' (a
    stride-2 layer maps ``W = 10`` and ``W = 12`` over 2 ranks to 3 columns on rank 0 both times).
    """
    outer = getattr(_state, "key", None)
    _state.key = (key,)
    try:
        yield
    finally:
        _state.key = outer


def inferred_sizes(layer, x: torch.Tensor, name: str):
    """Every rank's size of ``x`` along ``layer.dim`` (a list; a tuple of lists for tiles, one per
    dim and group): what a layer with ``infer_sizes`` passes as ``sizes=``.

    All-gathered (:func:`gather_sizes`: one tiny collective and one device-to-host read per dim)
    on every call, or once per layout inside :func:`layout_key` with the check mode off (issue
    29). A failing first call of a layout raises on every rank from the agreed sizes, and again
    on every later call of it (the sizes are cached, the checks are not).
    """
    tiles = isinstance(layer.dim, tuple)
    pairs = tuple(zip(layer.dim, layer.group)) if tiles else ((layer.dim, layer.group),)
    outer = getattr(_state, "key", None)
    key = None if outer is None or checks_enabled() else (outer, tuple(x.shape))
    cache = layer.__dict__.setdefault("_shardkit_sizes", OrderedDict())
    if key is not None and key in cache:
        cache.move_to_end(key)
        found = cache[key]
    else:
        found = tuple(tuple(gather_sizes(x, resolve_group(g, name), dim_of(x, d, name), name)) for d, g in pairs)
        if key is not None:  # every rank stores (and evicts) alike: the same keys in the same order
            cache[key] = found
            if len(cache) > _SHAPES:
                cache.popitem(last=False)
    sizes = tuple(list(s) for s in found)
    return sizes if tiles else sizes[0]


def keep_graph_empty(shape, *deps: torch.Tensor) -> torch.Tensor:
    """A zero-size result that still depends on ``deps`` in autograd.

    A rank with no outputs must still run the backward collectives of its inputs (the other
    ranks wait for it), so its empty output is tied to them with a zero-weighted sum.
    """
    base = deps[0].new_zeros(shape)
    tie = sum(d.sum() * 0 for d in deps if d.requires_grad)
    return base + tie if isinstance(tie, torch.Tensor) else base


def channels_first(x: torch.Tensor, d: int, nd: int, channels_last: bool, dim, op: str) -> tuple[torch.Tensor, int]:
    """Check that normalized dim ``d`` is a spatial dim of ``x``; return ``x`` as channels-first
    ``[B, C, *S]`` (a view) and the sharded dim's index in that view.

    Raises:
        ShardkitError: ``d`` is the batch or channel dim.
    """
    spatial = list(range(1, nd + 1)) if channels_last else list(range(2, nd + 2))
    if d not in spatial:
        layout = "channels-last" if channels_last else "channels-first"
        raise ShardkitError(
            f"{op}: dim {dim} is not a spatial dim of a {layout} {nd + 2}-d input (spatial dims {spatial})"
        )
    return (x.movedim(-1, 1), d + 1) if channels_last else (x, d)
