"""``parallelize(..., activation_checkpoint=...)``: same numbers, and exactly the communication it claims.

On each layout every rank runs one forward and backward of the tiny float64 decoder three times,
with ``none``, ``full`` and ``selective``, from the same weights and batch: the loss and every
local gradient must be the same in the three runs (measured: bitwise). Then the communication:

* the ledger of the ``full`` run holds, in phase ``recompute``, exactly the collectives the
  blocks issued in their forward (a ledger opened around each block call of the ``none`` run),
  and everything else as the ``none`` run;
* the ``selective`` run's ledger equals the ``none`` run's: the replay serves every collective;
* independently of the ledger, a dispatch mode under the whole step counts the c10d ops that
  really reach the process group: ``selective`` issues as many as ``none``, ``full`` that many
  plus the blocks' forward calls. (The ring attention's point-to-point exchanges are not
  replayed; see tests/train/test_ac_layouts.py.)
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harness.helpers import all_true
from harness.tiny_lm import tiny_decoder, token_ids
from shardkit.comm import checks
from shardkit.comm.ledger import CommLedger
from shardkit.errors import ShardkitError
from shardkit.parallelize import decoder_layers, parallelize
from shardkit.sharding import ParallelDims

BATCH = 2
MODES = ("none", "full", "selective")


class _IssuedCollectives(TorchDispatchMode):
    """Counts the c10d ops that reach the dispatcher below every checkpoint mode (really issued)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.namespace == "c10d"
        return func(*args, **(kwargs or {}))


def _key(r) -> tuple:
    return (r.op, r.api, r.group_size, r.bytes_sent, r.bytes_received)  # each run has its own groups


def _block_ledgers(blocks) -> tuple[list[CommLedger], list]:
    """A ledger open around every block call (forward only: the recompute calls the block's
    forward function, not the module)."""
    ledgers: list[CommLedger] = []

    def pre(module, args):
        ledgers.append(CommLedger().__enter__())

    def post(module, args, out):
        ledgers[-1].__exit__(None, None, None)

    return ledgers, [h for b in blocks for h in (b.register_forward_pre_hook(pre), b.register_forward_hook(post))]


def _step(layout: dict, sequence_parallel: bool, mode: str):
    mesh = ParallelDims(**layout).build_mesh("cpu")
    # the claims below are the replay's; the shard layout's regathers are tests/parallelize/test_sp_activation.py's
    pm = parallelize(
        tiny_decoder(), mesh, sequence_parallel=sequence_parallel, activation_checkpoint=mode, sp_activation="gathered"
    )
    ids = token_ids(BATCH)
    inputs = pm.cp.shard_batch(ids, ids).inputs if pm.cp is not None else dict(input_ids=ids)
    blocks, handles = _block_ledgers(decoder_layers(pm.module)) if mode == "none" else ([], [])
    issued = _IssuedCollectives()
    with CommLedger() as ledger, issued:
        loss = pm.module(**inputs).logits.pow(2).sum()
        loss.backward()
    for h in handles:
        h.remove()
    grads = {n: p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for n, p in pm.module.named_parameters()}
    return loss.detach(), grads, ledger.records, issued.count, [b.records for b in blocks]


LAYOUTS = {
    "tp=2": (dict(tp=2), False),
    "tp=2, sequence parallel": (dict(tp=2), True),
    "cp_ulysses=2": (dict(cp_ulysses=2), False),
    "dp_shard=2 (FSDP2)": (dict(dp_shard=2), False),
}


@pytest.mark.world(2, timeout=120)
@pytest.mark.parametrize("layout,sequence_parallel", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_checkpointing_keeps_losses_gradients_and_the_claimed_communication(layout, sequence_parallel):
    runs = {mode: _step(layout, sequence_parallel, mode) for mode in MODES}
    loss, grads, records, issued, per_block = runs["none"]
    again = [r for r in runs["full"][2] if r.phase == "recompute"]
    k = len(again) // max(len(per_block), 1)  # every block of the tiny decoder is alike
    # the recompute stops after the block's last tensor backward needs (torch's early stop), so
    # each block re-issues the first k of its forward calls; backward visits the blocks last first
    prefixes = [_key(r) for b in reversed(per_block) for r in [r for r in b if r.phase == "forward"][:k]]
    full_records, full_issued = runs["full"][2], runs["full"][3]
    sel_records, sel_issued = runs["selective"][2], runs["selective"][3]
    checks = {
        "same loss and gradients": all(
            torch.equal(loss, runs[m][0]) and all(torch.equal(grads[n], runs[m][1][n]) for n in grads)
            for m in ("full", "selective")
        ),
        # full = none + a prefix of each block's forward calls, in phase recompute
        "full recomputes the blocks' collectives": [_key(r) for r in again] == prefixes,
        # FSDP2's gathers are outside the blocks; every other layout recomputes some inside them
        "blocks communicate again": (k > 0) == (layout != dict(dp_shard=2)),
        # ... and the dispatcher sees exactly the ledger's extra calls (metadata gathers included)
        "full issues them again": full_issued - issued == len(full_records) - len(records) >= len(again),
        "selective issues nothing more": sorted(map(_key, sel_records)) == sorted(map(_key, records))
        and sel_issued == issued,
    }
    for name, ok in checks.items():
        assert all_true(ok), (name, issued, full_issued, sel_issued, len(records), len(again))


@pytest.mark.world(1, timeout=60)
def test_unknown_mode_is_refused():
    with pytest.raises(ShardkitError, match="activation checkpointing must be one of none, full, selective"):
        parallelize(tiny_decoder(), None, activation_checkpoint="offload")


@pytest.mark.world(1, timeout=60)
def test_selective_is_refused_in_check_mode():
    with checks(True), pytest.raises(ShardkitError, match="selective.*check mode"):
        parallelize(tiny_decoder(), None, activation_checkpoint="selective")


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_a_block_back_propagated_twice_as_the_zero_bubble_split_does(mode):
    """I (a backward to the input that keeps the graph), then W (to the weights): each recomputes
    the block; with ``selective`` the second recompute gets the kept outputs from the first
    (torch's SAC hands them back once). Gradients equal the unchecked block's (float64, bitwise)."""
    from torch import nn

    from shardkit.parallelize.checkpointing import apply_ac
    from shardkit.pipeline_parallel.split_backward import input_grad, weight_grad

    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.o_proj = nn.Linear(4, 8, dtype=torch.float64), nn.Linear(8, 4, dtype=torch.float64)

        def forward(self, x):
            return x + self.o_proj(torch.tanh(self.up(x)))

    plain = Block()
    checked = Block()
    checked.load_state_dict(plain.state_dict())
    apply_ac([checked], mode)
    x0 = torch.randn(3, 4, dtype=torch.float64)
    grads = []
    for block in (plain, checked):
        x = x0.clone().requires_grad_(True)
        y = block(x)
        dx, pending = input_grad(x, y, block.parameters(), torch.ones_like(y))
        weight_grad(pending)
        grads.append([dx] + [p.grad for p in block.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
