"""Catalogue cases of the vocab-parallel cross entropy (shardkit.tensor_parallel.loss).

The logits are ``[B, S, V]`` with the vocabulary cut in rank order (torch.chunk's layout, empty
trailing shards allowed); the reference is ``F.cross_entropy`` on the full logits, a scalar that
every rank must return. The labels must be the logits' leading shape and identical on every rank:
issue 19 (row 13) found a rank passing labels ``[2, 4]`` for logits ``[2, 5, V / R]`` aborting the
process in both modes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from bad_input_cases_comm import block, per_rank
from bad_input_rank import Registry, rank, world

from shardkit import vocab_parallel_cross_entropy

CASES = Registry(__name__)


def _chunk_sizes(vocab, n):
    sizes = [c.numel() for c in torch.arange(vocab).chunk(n)]
    return sizes + [0] * (n - len(sizes))


def _loss(n, vocab=7, lead=(2, 5), labels=None, dtype=torch.float64, **kw):
    """This rank's vocabulary block of fixed logits, the loss over the world, and the reference
    (``None`` when ``labels`` replaces the valid ones: then no answer is right)."""
    gen = torch.Generator().manual_seed(11)  # identical on every rank: the full problem
    full = torch.randn(*lead, vocab, generator=gen, dtype=torch.float64)
    valid = torch.randint(0, vocab, lead, generator=gen)
    local = block(full, -1, _chunk_sizes(vocab, n)).to(dtype)
    got = vocab_parallel_cross_entropy(local, valid if labels is None else labels, world(), **kw)
    want = F.cross_entropy(full.reshape(-1, vocab), valid.reshape(-1), **kw) if labels is None else None
    return got, want


for _n in (1, 2, 3):
    CASES.add(
        f"vocab_parallel_cross_entropy_control_r{_n}",
        _n,
        "vocab_parallel_cross_entropy",
        "control",
        lambda n=_n: _loss(n),
    )
CASES.add(
    "vocab_parallel_cross_entropy_control_empty_shard_r3",
    3,
    "vocab_parallel_cross_entropy",
    "control",
    lambda: _loss(3, vocab=4),
)  # torch.chunk: 2, 2, 0

_BAD = {
    # row 13: one rank's labels are not the logits' leading shape ([2, 4] for logits [2, 5, V / R])
    "labels_shape_differs_one_rank_r2": (
        2,
        lambda: _loss(2, labels=torch.zeros(2, per_rank([5, 4]), dtype=torch.long)),
    ),
    "labels_shape_wrong_one_rank_r3": (
        3,
        lambda: _loss(3, labels=torch.zeros(per_rank([(2, 5), (2, 5), (10,)]), dtype=torch.long)),
    ),
    "labels_shape_wrong_r2": (2, lambda: _loss(2, labels=torch.zeros(2, 4, dtype=torch.long))),
    "labels_not_integer_one_rank_r2": (
        2,
        lambda: _loss(2, labels=per_rank([torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 5)])),
    ),
    "labels_not_a_tensor_one_rank_r2": (
        2,
        lambda: _loss(2, labels=per_rank([torch.zeros(2, 5, dtype=torch.long), [[0] * 5] * 2])),
    ),
    "labels_differ_r2": (2, lambda: _loss(2, labels=torch.full((2, 5), rank(), dtype=torch.long))),
    "ignore_index_differs_r2": (
        2,
        lambda: _loss(2, labels=torch.zeros(2, 5, dtype=torch.long), ignore_index=per_rank([0, -100])),
    ),
    "logits_dtype_differs_r2": (
        2,
        lambda: _loss(2, labels=torch.zeros(2, 5, dtype=torch.long), dtype=per_rank([torch.float64, torch.float32])),
    ),
}
for _name, (_n, _body) in _BAD.items():
    CASES.add(f"vocab_parallel_cross_entropy_{_name}", _n, "vocab_parallel_cross_entropy", "arg", _body)
