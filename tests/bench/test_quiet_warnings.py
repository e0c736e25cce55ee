"""The bench drops exactly two known notices of torch's peer variants (issue 32, item 3): FSDP2's
view warning and DTensor's gloo all-to-all fallback, by their text; every other warning stays."""

from __future__ import annotations

import inspect
import logging
import warnings

import torch.distributed.fsdp._fully_shard._fsdp_state as fsdp_state
import torch.distributed.tensor._collective_utils as collective_utils

from shardkit.bench._quiet import _FILTER, DTENSOR_ALLTOALL, DTENSOR_LOGGER, quiet_known_warnings


def test_the_filtered_texts_are_still_the_ones_torch_emits():
    # A torch release that rewords a notice would make its filter a no-op: this fails first.
    assert DTENSOR_ALLTOALL in inspect.getsource(collective_utils)
    assert collective_utils.logger.name == DTENSOR_LOGGER
    assert "returned a view tensor" in inspect.getsource(fsdp_state)


def test_only_the_two_known_notices_are_dropped():
    logger = logging.getLogger(DTENSOR_LOGGER)
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:  # restores the filters on exit
            warnings.simplefilter("always")
            quiet_known_warnings()
            quiet_known_warnings()  # idempotent
            known = "FSDP2-wrapped module (Linear) returned a view tensor. An in-place op ..."
            warnings.warn(known, UserWarning, stacklevel=1)
            warnings.warn("some other FSDP2-wrapped module (Linear) returned a view tensor", UserWarning, stacklevel=1)
            warnings.warn("a different UserWarning", UserWarning, stacklevel=1)
            logger.warning(DTENSOR_ALLTOALL + ", falling back with allgather + chunk!")
            logger.warning("another DTensor notice")
        assert [str(w.message) for w in caught] == [
            "some other FSDP2-wrapped module (Linear) returned a view tensor",  # the regex is anchored
            "a different UserWarning",
        ]
        assert seen == ["another DTensor notice"]
        assert logger.filters.count(_FILTER) == 1
    finally:
        logger.removeHandler(handler)
        logger.removeFilter(_FILTER)
