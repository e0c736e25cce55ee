"""The known warnings of the bench's peer variants, filtered by their exact text in bench processes.

The bench times torch's own implementations beside shardkit's, and two of them warn on every
run where nothing is wrong and nothing can be changed: a ``shardkit bench`` printed FSDP2's
view warning four times and DTensor's all-to-all fallback once per rank. Only those two
messages are dropped, and only in the processes that run the cases (the spawned ranks, the
fake-world process, a torchrun world joined by the bench); any other warning still prints.

* FSDP2 (``torch.distributed.fsdp``, ``_register_pre_backward_hook``) warns with a
  ``UserWarning`` "FSDP2-wrapped module (...) returned a view tensor" when a wrapped module's
  output is a view: the ``fsdp_tp_step`` case's peer, ``fully_shard`` over DTensor's
  ``parallelize_module``, returns one by design (shardkit's own path returns none:
  tests/parallelize/test_quiet_fsdp_view.py).
* DTensor (``torch.distributed.tensor._collective_utils``, ``shard_dim_alltoall``) logs a
  warning "CPU process group does not support alltoall yet, falling back with allgather +
  chunk!" on every rank on gloo: the ``ulysses`` case's peer redistributes ``Shard(1)`` to
  ``Shard(2)``. What the fallback costs is what the case measures.
"""

from __future__ import annotations

import logging
import warnings

__all__ = ["FSDP_VIEW", "DTENSOR_LOGGER", "DTENSOR_ALLTOALL", "quiet_known_warnings"]

FSDP_VIEW = r"FSDP2-wrapped module \(.*\) returned a view tensor"  # regex, matched from the start
DTENSOR_LOGGER = "torch.distributed.tensor._collective_utils"
DTENSOR_ALLTOALL = "CPU process group does not support alltoall yet"  # the message's start


class _DropFallbackNotice(logging.Filter):
    """Drops DTensor's all-to-all fallback notice, passes every other record of its logger."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(DTENSOR_ALLTOALL)


_FILTER = _DropFallbackNotice()


def quiet_known_warnings() -> None:
    """Install both filters in this process (idempotent: a second call adds nothing)."""
    warnings.filterwarnings("ignore", message=FSDP_VIEW, category=UserWarning)
    logger = logging.getLogger(DTENSOR_LOGGER)
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
