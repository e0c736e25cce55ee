"""Differentiable collectives every parallel axis is built from.

Every function takes ``group`` (a ``ProcessGroup`` or 1-D ``DeviceMesh``), is the identity on a
size-1 group, handles uneven shards, and has a backward checked by adjoint tests.
"""

from .all_to_all import all_to_all
from .checks import checks, checks_enabled
from .collectives import all_gather, all_reduce_backward, all_reduce_forward, reduce_scatter
from .flight_recorder import FlightRecorder, get_flight_recorder, set_flight_recorder
from .ledger import CommLedger, CommRecord
from .regions import gather_forward_split_backward, split_forward_gather_backward

__all__ = [
    "all_reduce_forward",
    "all_reduce_backward",
    "all_gather",
    "reduce_scatter",
    "split_forward_gather_backward",
    "gather_forward_split_backward",
    "all_to_all",
    "CommLedger",
    "CommRecord",
    "checks",
    "checks_enabled",
    "FlightRecorder",
    "get_flight_recorder",
    "set_flight_recorder",
]
