"""Pipeline parallelism: transfers between stages, schedule tables, stages and a schedule runner.

Every function takes the pipeline group explicitly (a ``ProcessGroup``, a 1-D ``DeviceMesh``,
or a list of them for a stage with several neighbours); stage = group rank. Stages made of tp
groups, of equal or different sizes (VTP), take a :class:`StageGroups` instead, with boundary
layouts :class:`Replicate` / :class:`Shard`.
"""

from .hf_llama import LlamaStageModule, llama_stage_layers
from .hf_llama_tp import apply_llama_stage_tp
from .p2p import (
    P2PWork,
    ShapeCache,
    recv_backward,
    recv_forward,
    send_backward,
    send_backward_recv_backward,
    send_backward_recv_forward,
    send_forward,
    send_forward_recv_backward,
    send_forward_recv_forward,
)
from .runner import run_schedule, split_microbatches
from .schedules import Action, bubble_fraction, gpipe_schedule, one_f_one_b_schedule, simulate, validate_schedule
from .stage import PipelineStage
from .vtp import Replicate, Shard, StageGroups, new_stage_groups

__all__ = [
    "Action",
    "gpipe_schedule",
    "one_f_one_b_schedule",
    "validate_schedule",
    "simulate",
    "bubble_fraction",
    "PipelineStage",
    "StageGroups",
    "Replicate",
    "Shard",
    "new_stage_groups",
    "apply_llama_stage_tp",
    "LlamaStageModule",
    "llama_stage_layers",
    "run_schedule",
    "split_microbatches",
    "P2PWork",
    "ShapeCache",
    "send_forward",
    "recv_forward",
    "send_backward",
    "recv_backward",
    "send_forward_recv_backward",
    "send_backward_recv_forward",
    "send_forward_recv_forward",
    "send_backward_recv_backward",
]
