"""The bench drops exactly three known notices of torch's peer variants (issue 32, item 3):
FSDP2's view warning and DTensor's gloo all-to-all fallback and sequential-redistribute notices,
by their text; every other warning and log record stays."""

from __future__ import annotations

import importlib
import inspect
import logging
import warnings

import torch
import torch.distributed.fsdp._fully_shard._fsdp_state as fsdp_state

from shardkit.bench._quiet import _FILTERS, DTENSOR_NOTICES, quiet_known_warnings
from shardkit.comm._compat import release


def test_the_filtered_texts_are_still_the_ones_torch_emits():
    # A torch release that rewords a notice would make its filter a no-op: this fails first.
    for name, prefix in DTENSOR_NOTICES.items():
        module = importlib.import_module(name)
        assert module.logger.name == name
        assert prefix.split("%s")[0] in inspect.getsource(module), name
    if release(torch.__version__) >= (2, 13):  # torch 2.11's FSDP2 has no such warning to filter
        assert "returned a view tensor" in inspect.getsource(fsdp_state)


def test_only_the_known_notices_are_dropped():
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    loggers = [logging.getLogger(name) for name in DTENSOR_NOTICES]
    for logger in loggers:
        logger.addHandler(handler)
    alltoall, redistribute = loggers
    try:
        with warnings.catch_warnings(record=True) as caught:  # restores the filters on exit
            warnings.simplefilter("always")
            quiet_known_warnings()
            quiet_known_warnings()  # idempotent
            known = "FSDP2-wrapped module (Linear) returned a view tensor. An in-place op ..."
            warnings.warn(known, UserWarning, stacklevel=1)
            warnings.warn("some other FSDP2-wrapped module (Linear) returned a view tensor", UserWarning, stacklevel=1)
            warnings.warn("a different UserWarning", UserWarning, stacklevel=1)
            alltoall.warning("CPU process group does not support alltoall yet, falling back with allgather + chunk!")
            alltoall.warning("another DTensor notice")
            redistribute.warning(DTENSOR_NOTICES[redistribute.name] + " x", "(P,)", "(R,)", 2, "all_reduce")
            redistribute.warning("While redistributing from %s: something new", "(P,)")
        assert [str(w.message) for w in caught] == [
            "some other FSDP2-wrapped module (Linear) returned a view tensor",  # the regex is anchored
            "a different UserWarning",
        ]
        assert seen == ["another DTensor notice", "While redistributing from (P,): something new"]
        assert all(logger.filters.count(_FILTERS[logger.name]) == 1 for logger in loggers)
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
            logger.removeFilter(_FILTERS[logger.name])
