"""``shardkit.plan``: a cost model of the composed trainer's layouts, from first principles.

* :mod:`.model`: parameters and FLOPs of a Hugging Face decoder config (:class:`ModelShape`).
* :mod:`.options`: the step options (:class:`StepOptions`) and the trainer's limits.
* :mod:`.collectives`: the step's collectives per rank, equal to the trainer's CommLedger.
* :mod:`.cluster`: GPUs per node, link bandwidths and latencies, memory, peak FLOP/s.
* :mod:`.timing` and :mod:`.memory`: alpha-beta times and memory per rank.
* :mod:`.search`: :func:`estimate_step` for one layout, :func:`plan_layouts` ranks them all.
* :mod:`.saving`: what a checkpoint save adds to a step, synchronous or ``--async-checkpoint``.
"""

from .cluster import CLUSTERS, Cluster
from .collectives import CommRow, step_collectives
from .model import ModelShape
from .options import StepOptions
from .saving import SaveCost, save_cost
from .search import StepEstimate, estimate_step, plan_layouts

__all__ = [
    "CLUSTERS",
    "Cluster",
    "CommRow",
    "ModelShape",
    "SaveCost",
    "StepEstimate",
    "StepOptions",
    "estimate_step",
    "plan_layouts",
    "save_cost",
    "step_collectives",
]
