"""Activation checkpointing as a policy (:class:`shardkit.parallelize.ACPolicy`): an op save
list, per-module-name overrides and every N-th block.

The first tests are our own port of torchtitan's AC unit test (its tests/unit_tests/
test_activation_checkpoint.py: a toy block gate -> wq -> output whose backward FLOPs and kept
activations tell which matmuls were saved); it needs both an op save list by module name and
forced recomputes. Units: ``2 n^3`` FLOPs (one ``[n, n] @ [n, n]`` matmul) and ``n^2`` elements.
The block's backward needs gate's output and wq's output (the inputs of the next matmuls);
torch's checkpoint stops recomputing once it has them (early stop), so the ``output`` matmul is
never recomputed and full AC costs 2 units here (torchtitan's test turns early stop off: 4).
Kept activations are what :class:`~shardkit.parallelize.saved_bytes.SavedBytesMeter` counts,
the block's input ``x`` included (torchtitan's allocator delta leaves it out: theirs are ours
minus one).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from harness.tiny_lm import tiny_decoder, token_ids
from shardkit import ShardkitError
from shardkit.parallelize import ACPolicy, decoder_layers, parallelize
from shardkit.parallelize.checkpointing import apply_ac
from shardkit.parallelize.saved_bytes import SavedBytesMeter
from shardkit.plan.activations import BlockLayout, stage_saved_bytes
from shardkit.plan.model import ModelShape

N = 64


class _Block(nn.Module):
    """gate [n, n] -> wq [n, n] -> output [n, 2n], as torchtitan's toy block (names nested alike)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Module()
        self.router.gate = nn.Linear(N, N, bias=False)
        self.attention = nn.Module()
        self.attention.wq = nn.Linear(N, N, bias=False)
        self.output = nn.Linear(N, 2 * N, bias=False)

    def forward(self, x):
        return self.output(self.attention.wq(self.router.gate(x)))


def _blocks(k: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[_Block() for _ in range(k)]).double()


SAVE_GATE_AND_OUTPUT = ACPolicy(save_ops=frozenset(), overrides={"router.gate": "save", "output": "save"})
CASES = {  # name -> (policy or None, backward FLOPs units, kept n^2 units)
    "no AC": (None, 8, 3),  # saved: x, gate's output, wq's output
    "save list: gate, output": (SAVE_GATE_AND_OUTPUT, 9, 4),  # wq recomputed; keeps x, gate's and output's outputs
    "force recompute gate": (
        ACPolicy(save_ops=frozenset(), overrides={"router.gate": "recompute", "output": "save"}),
        10,
        3,
    ),
    "force recompute output": (
        ACPolicy(save_ops=frozenset(), overrides={"router.gate": "save", "output": "recompute"}),
        9,
        2,
    ),
    "full": ("full", 10, 1),
}


class _MatmulFlops(TorchDispatchMode):
    """FLOPs of the matmuls that run (``2 m k n`` each). Not torch's FlopCounterMode: its module
    tracker calls ``view_as`` inside the recompute, which SAC then finds missing from its cache."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default:
            (m, k), n = args[0].shape, args[1].shape[1]
            self.flops += 2 * m * k * n
        return func(*args, **(kwargs or {}))


def _run(model: nn.Module, mode) -> tuple[float, list[int], torch.Tensor, list[torch.Tensor]]:
    x = torch.randn(N, N, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    with SavedBytesMeter(list(model), "none" if mode is None else mode) as meter:
        out = sum(block(x).sum() for block in model)  # the blocks side by side on one input
    with _MatmulFlops() as flops:
        out.backward()
    return flops.flops / (2 * N**3), meter.per_block, x.grad, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("name", list(CASES))
def test_torchtitan_toy_block_flops_memory_and_gradients(name):
    policy, want_flops, want_kept = CASES[name]
    reference = _run(_blocks(1), None)
    model = _blocks(1)
    if policy is not None:
        apply_ac(list(model), policy)
    flops, kept, gx, grads = _run(model, policy)
    assert flops == want_flops
    assert kept == [want_kept * N * N * 8]
    assert torch.equal(gx, reference[2]) and all(torch.equal(a, b) for a, b in zip(grads, reference[3], strict=True))


def test_every_second_block_checkpointed():
    reference = _run(_blocks(4), None)
    model = _blocks(4)
    apply_ac(list(model), "selective:2")  # = ACPolicy(save_ops=frozenset(), overrides={}, every=2)
    flops, kept, gx, grads = _run(model, "selective:2")
    assert [b.shardkit_ac_mode for b in model] == ["none", "full", "none", "full"]
    assert flops == 4 * 8 + 2 * 2  # blocks 1 and 3 recompute gate and wq
    assert kept == [n * N * N * 8 for n in (3, 1, 3, 1)]
    assert torch.equal(gx, reference[2]) and all(torch.equal(a, b) for a, b in zip(grads, reference[3], strict=True))


def _decoder_bytes(mode, layers: int = 2) -> list[int]:
    model = parallelize(tiny_decoder(layers=layers), None, activation_checkpoint=mode).module
    ids = token_ids(2)
    with SavedBytesMeter(decoder_layers(model), mode) as meter:
        model(input_ids=ids).logits.pow(2).sum().backward()
    return meter.per_block


def test_the_presets_are_policies():
    assert _decoder_bytes("selective") == _decoder_bytes(ACPolicy())
    assert _decoder_bytes("full") == _decoder_bytes(ACPolicy(save_ops=frozenset(), overrides={}))


def test_the_planner_prices_every_nth_block():
    shape = ModelShape("llama", vocab=256, hidden=32, layers=4, heads=4, kv_heads=2, head_dim=8, ffn=64)
    where = BlockLayout(2, 8)
    for mode in ("none", "full", "selective", "selective:2", "selective:3"):
        assert sum(_decoder_bytes(mode, layers=4)) == stage_saved_bytes(shape, where, mode, 8, 4), mode


def test_bad_policies_are_refused():
    with pytest.raises(ShardkitError, match="'save' or 'recompute'"):
        ACPolicy(overrides={"o_proj": "keep"})
    with pytest.raises(ShardkitError, match="every must be an int >= 1"):
        ACPolicy(every=0)
    with pytest.raises(TypeError, match="op overloads"):
        ACPolicy(save_ops={"mm"})
    with pytest.raises(ShardkitError, match="selective:N"):
        apply_ac([], "selective:x")
