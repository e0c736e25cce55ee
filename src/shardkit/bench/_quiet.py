"""The known warnings of the bench's peer variants, filtered by their exact text in bench processes.

The bench times torch's own implementations beside shardkit's, and they warn on every run where
nothing is wrong and nothing can be changed: a ``shardkit bench`` printed FSDP2's view warning
four times and DTensor's notices once per rank. Only these three messages are dropped, and only
in the processes that run the cases (the spawned ranks, the fake-world process, a torchrun world
joined by the bench); any other warning still prints.

* FSDP2 (``torch.distributed.fsdp``, ``_register_pre_backward_hook``) warns with a
  ``UserWarning`` "FSDP2-wrapped module (...) returned a view tensor" when a wrapped module's
  output is a view: the ``fsdp_tp_step`` case's peer, ``fully_shard`` over DTensor's
  ``parallelize_module``, returns one by design (shardkit's own path returns none:
  tests/parallelize/test_quiet_fsdp_view.py).
* DTensor (``torch.distributed.tensor._collective_utils``, ``shard_dim_alltoall``) logs a
  warning "CPU process group does not support alltoall yet, falling back with allgather +
  chunk!" on every rank on gloo: the ``ulysses`` case's peer redistributes ``Shard(1)`` to
  ``Shard(2)``. What the fallback costs is what the case measures.
* DTensor (``torch.distributed.tensor._redistribute``) logs "While redistributing from ... to
  ..., N sequential all_reduce (all_gather) operations will be performed. This is suboptimal"
  on every rank: the ``fsdp_tp_step`` case's peer clips by the global norm of gradients that
  are DTensors on the 2-D dp x tp mesh, as torchtitan does.
"""

from __future__ import annotations

import logging
import warnings

__all__ = ["FSDP_VIEW", "DTENSOR_NOTICES", "quiet_known_warnings"]

FSDP_VIEW = r"FSDP2-wrapped module \(.*\) returned a view tensor"  # regex, matched from the start
# logger -> the start of the notice's format string (record.msg, before its %-arguments)
DTENSOR_NOTICES = {
    "torch.distributed.tensor._collective_utils": "CPU process group does not support alltoall yet",
    "torch.distributed.tensor._redistribute": "While redistributing from %s to %s, %d sequential %s operations",
}


class _DropNotice(logging.Filter):
    """Drops one logger's records whose format string starts with ``prefix``; passes the rest."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


_FILTERS = {name: _DropNotice(prefix) for name, prefix in DTENSOR_NOTICES.items()}


def quiet_known_warnings() -> None:
    """Install the three filters in this process (idempotent: a second call adds nothing)."""
    warnings.filterwarnings("ignore", message=FSDP_VIEW, category=UserWarning)
    for name, drop in _FILTERS.items():
        logger = logging.getLogger(name)
        if drop not in logger.filters:
            logger.addFilter(drop)
