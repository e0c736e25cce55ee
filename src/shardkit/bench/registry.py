"""The cases of ``shardkit bench``: name -> where its per-rank body lives and its world size.

A case body is ``fn(pg, settings) -> list[Record]``, run on every rank of a world of ``nproc``
gloo ranks; it checks its variants' results before timing them (:func:`._method.agree`). A case
with ``fake`` world sizes runs instead in one process on torch's fake process group, once per
size (``pg`` of that many ranks whose collectives return at once: host time only).

``worlds`` are the world sizes a case runs on in an existing world (under ``torchrun``, or a
world of 1 on one GPU; default: ``nproc`` only); a world of another size skips it, with the
reason printed and recorded (:func:`skip_reason`). On the CPU without torchrun every case
gets a spawned world of its ``nproc``.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["CaseSpec", "CASES", "QUICK", "skip_reason"]


class CaseSpec(NamedTuple):
    module: str  # relative to shardkit.bench
    function: str
    nproc: int
    what: str
    fake: tuple[int, ...] = ()  # world sizes on torch's fake process group (one process), instead of gloo
    worlds: tuple[int, ...] = ()  # world sizes it runs on in an existing world; () = (nproc,)


ANY = (1, 2, 4, 8)  # a case that adapts to the world's size


CASES = {
    "collectives": CaseSpec(
        ".cases_comm",
        "collectives",
        2,
        "all_reduce / all_gather / reduce_scatter against the bare c10d call",
        worlds=ANY,
    ),
    "all_to_all": CaseSpec(
        ".cases_a2a",
        "all_to_all_case",
        2,
        "Ulysses layouts against bare pre-laid all_to_all_single and list all_to_all + cat; "
        "uneven against even per byte",
        worlds=ANY,
    ),
    "all_to_all_fused": CaseSpec(
        ".cases_a2a",
        "fused_projection",
        2,
        "projection writing straight into the all-to-all send buffer against the "
        "projection + all_to_all and against the parts (projection, bare call)",
        worlds=ANY,
    ),
    "p2p": CaseSpec(".cases_comm", "p2p", 2, "pipeline send/recv (static, negotiated) against bare isend/irecv"),
    "pipeline_bubble": CaseSpec(
        ".cases_pp",
        "bubble",
        4,
        "measured 1F1B bubble against (p-1)/(m+p-1); every schedule's bubble against its theory and 1F1B's",
    ),
    "ring": CaseSpec(
        ".cases_cp", "ring", 4, "ring attention: overlap against none; zigzag against contiguous", worlds=(2, 4, 8)
    ),
    "ulysses": CaseSpec(
        ".cases_cp",
        "ulysses",
        4,
        "Ulysses attention against DTensor redistribute; uneven against even per byte",
        worlds=ANY,
    ),
    "spatial_conv": CaseSpec(
        ".cases_other",
        "spatial_conv",
        2,
        "spatial conv against halo + conv parts and full gather",
        worlds=ANY,
    ),
    "vocab_loss": CaseSpec(".cases_other", "vocab_loss", 2, "vocab-parallel loss against gathered logits", worlds=ANY),
    "moe": CaseSpec(
        ".cases_moe",
        "moe_experts",
        1,
        "8 local experts: one grouped GEMM per projection (and the padded bmm) against a per-expert loop",
        worlds=ANY,
    ),
    "tp_step": CaseSpec(
        ".cases_tp",
        "tp_step",
        2,
        "TP and TP+SP training steps against DTensor parallelize_module and HF tp_plan",
        worlds=(1, 2),
    ),
    "async_tp": CaseSpec(
        ".cases_async_tp",
        "async_tp_step",
        2,
        "TP+SP training step with async TP (collective-matmul rings) against synchronous SP collectives",
        worlds=(2, 4),
    ),
    "fsdp_tp_step": CaseSpec(
        ".cases_fsdp",
        "fsdp_tp_step",
        4,
        "FSDP2 + TP step (dp_shard=2 x tp=2) against fully_shard + DTensor parallelize_module",
    ),
    "host_overhead": CaseSpec(
        ".cases_host",
        "host_overhead",
        1,
        "host time per call of each op above the bare c10d call, forward and backward, with "
        "the flight recorder, the ledger and the check mode each on (fake process group)",
        fake=(4, 8),
    ),
    "checks": CaseSpec(
        ".cases_checks", "ops", 4, "each op with the check mode on against off (sizes given)", worlds=(1, 2, 4)
    ),
    "checks_train": CaseSpec(
        ".cases_checks",
        "train_step",
        4,
        "a default shardkit train step (dp_replicate=2 x tp=2, SP) with --checks against without",
    ),
    "async_checkpoint": CaseSpec(
        ".cases_saving",
        "async_checkpoint",
        2,
        "a training step that saves with --async-checkpoint (staged, written behind) and in the "
        "foreground against a plain step",
        worlds=(1, 2, 4, 8),
    ),
    "startup": CaseSpec(
        ".cases_startup",
        "startup",
        1,
        "time to the first step: shardkit train --steps 1 against a plain torchrun script on the same layout",
        worlds=(1,),
    ),
}
# --quick runs every case at its small sizes but startup: its launches alone take minutes under load
QUICK = tuple(name for name in CASES if name != "startup")


def skip_reason(name: str, world: int) -> str | None:
    """Why case ``name`` cannot run in an existing world of ``world`` ranks (None: it can)."""
    spec = CASES[name]
    if spec.fake:
        return None  # its own fake worlds, in one process
    worlds = spec.worlds or (spec.nproc,)
    if world in worlds:
        return None
    sizes = " or ".join(map(str, worlds)) if len(worlds) < 3 else f"{', '.join(map(str, worlds[:-1]))} or {worlds[-1]}"
    return f"needs {sizes} ranks, this world has {world} (torchrun --nproc-per-node {worlds[0]})"
