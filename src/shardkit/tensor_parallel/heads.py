"""Whole attention heads per rank: the row / column ranges of an attention block's projections.

Cutting ``q_proj`` rows with ``torch.chunk`` semantics splits a head across ranks whenever the
head count is not a multiple of ``R``, and HF attention then reshapes garbage. Instead the query
heads are split over ranks (balanced: the first ``N % R`` ranks get one more; no rank gets
none), and every projection of the block follows that split in its own unit:

* ``q_proj`` / ``q_b_proj`` rows: ``head_dim`` (``qk_head_dim`` for MLA) per query head;
* ``kv_b_proj`` rows (MLA): ``qk_nope_head_dim + v_head_dim`` per query head;
* ``k_proj`` / ``v_proj`` rows: each rank holds the key/value heads its query heads use
  (query head ``h`` uses KV head ``h // (N / N_kv)``). With ``N_kv >= R`` (and ``R | N_kv``) these
  are disjoint blocks; with fewer KV heads than ranks (GQA, e.g. 8 q / 2 kv heads on 4 ranks)
  a KV head is replicated on every rank that needs it and its gradient is summed over them
  (:class:`~shardkit.sharding.ShardSpec` overlap). When a rank's query heads use their KV heads unevenly
  (9 q / 3 KV heads at tp 2), the rank holds copies of a KV head so that one local
  ``num_key_value_groups`` fits (see :func:`_kv_heads`);
* ``o_proj`` columns: ``v_head_dim`` (or ``head_dim``) per query head.

The block's ``num_key_value_groups`` becomes the local ratio, so HF's ``repeat_kv`` pairs the
local heads correctly.

Source: Megatron-LM's head-partitioned attention (Shoeybi et al., 2019); GQA (Ainslie et al.,
2023); KV-head replication when ``tp > num_kv_heads`` as in Megatron-LM and vLLM.
"""

from __future__ import annotations

import math

from torch import nn

from .._shapes import balanced_split_sizes, split_offsets
from ..errors import ShardkitError

__all__ = ["attention_head_ranges"]

_Q = ("q_proj", "q_b_proj")


def _runs(indices: list[int], unit: int) -> tuple[tuple[int, int], ...]:
    """Merge head indices into ``(start, stop)`` row ranges of ``unit`` rows per head (a repeated
    head gets a range of its own: a rank may hold a KV head twice)."""
    out: list[list[int]] = []
    for h in indices:
        if out and out[-1][1] == h * unit:
            out[-1][1] = (h + 1) * unit
        else:
            out.append([h * unit, (h + 1) * unit])
    return tuple((a, b) for a, b in out)


def _kv_heads(q_heads: list[int], group_size: int) -> tuple[list[int], int]:
    """The local KV heads for ``q_heads`` (in order, repeated where needed) and the local ratio.

    HF attention pairs local query head ``i`` with local KV head ``i // ratio`` (``repeat_kv``).
    Query head ``h`` uses KV head ``h // group_size``; when a rank's query heads use their KV
    heads ``c_j`` times each, ``ratio = gcd(c_j)`` and KV head ``j`` is held ``c_j / ratio`` times
    (e.g. 9 q / 3 KV heads at tp 2: rank 0 has q heads 0-4, uses KV 0 three times and KV 1
    twice: KV heads ``[0, 0, 0, 1, 1]``, ratio 1). The copies' gradients are summed with the
    other holders' (:class:`~shardkit.sharding.ShardSpec` overlap).
    """
    kv = sorted({h // group_size for h in q_heads})
    counts = [sum(1 for h in q_heads if h // group_size == j) for j in kv]
    ratio = math.gcd(*counts)
    return [j for j, c in zip(kv, counts) for _ in range(c // ratio)], ratio


def attention_head_ranges(attn: nn.Module, name: str, world: int) -> dict[str, tuple]:
    """Per-rank ranges of ``attn``'s projections (child name -> ``ranges``), and set its GQA ratio.

    Returns an empty dict for a module that is not an attention block (no ``q_proj`` /
    ``q_b_proj`` child with a ``head_dim`` / ``qk_head_dim`` attribute).

    Raises:
        ShardkitError: fewer query heads than ranks, or ``N`` not a multiple of ``N_kv``.
    """
    q_name = next((n for n in _Q if isinstance(getattr(attn, n, None), nn.Linear)), None)
    unit_q = getattr(attn, "qk_head_dim", None) or getattr(attn, "head_dim", None)
    if q_name is None or not isinstance(unit_q, int):
        return {}
    n_q, rem = divmod(getattr(attn, q_name).out_features, unit_q)
    if rem or n_q < world:
        raise ShardkitError(
            f"apply_tp: {name}: {n_q} query heads cannot be split over tp={world} ranks (whole heads per rank)"
        )
    sizes = balanced_split_sizes(n_q, world)
    heads = [list(range(o, o + s)) for o, s in zip(split_offsets(sizes), sizes)]
    out: dict[str, tuple] = {q_name: tuple(_runs(h, unit_q) for h in heads)}
    if isinstance(getattr(attn, "kv_b_proj", None), nn.Linear):  # MLA: kv_b_proj rows are per query head
        rows = getattr(attn, "qk_nope_head_dim") + getattr(attn, "v_head_dim")  # HF config ints, not submodules
        out["kv_b_proj"] = tuple(_runs(h, rows) for h in heads)
    unit_v = getattr(attn, "v_head_dim", None) or unit_q
    if isinstance(getattr(attn, "o_proj", None), nn.Linear):
        out["o_proj"] = tuple(_runs(h, unit_v) for h in heads)
    k = getattr(attn, "k_proj", None)
    if isinstance(k, nn.Linear):
        unit_kv = getattr(attn, "head_dim", unit_q)
        n_kv = k.out_features // unit_kv
        if n_kv == 0 or n_q % n_kv:
            raise ShardkitError(f"apply_tp: {name}: {n_q} query heads are not a multiple of {n_kv} key/value heads")
        per_rank = [_kv_heads(h, n_q // n_kv) for h in heads]
        kv_ranges = tuple(_runs(kv, unit_kv) for kv, _ in per_rank)
        out["k_proj"] = out["v_proj"] = kv_ranges
        out["_num_key_value_groups"] = tuple(ratio for _, ratio in per_rank)
    return out
