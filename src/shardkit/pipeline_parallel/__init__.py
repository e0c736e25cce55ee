"""Pipeline parallelism: transfers between stages, schedule tables, stages and a schedule runner.

Every function takes the pipeline group explicitly (a ``ProcessGroup``, a 1-D ``DeviceMesh``,
or a list of them for a stage with several neighbours); stage = group rank.
"""

from .hf_llama import LlamaStageModule, llama_stage_layers
from .p2p import (
    P2PWork,
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

__all__ = [
    "Action",
    "gpipe_schedule",
    "one_f_one_b_schedule",
    "validate_schedule",
    "simulate",
    "bubble_fraction",
    "PipelineStage",
    "LlamaStageModule",
    "llama_stage_layers",
    "run_schedule",
    "split_microbatches",
    "P2PWork",
    "send_forward",
    "recv_forward",
    "send_backward",
    "recv_backward",
    "send_forward_recv_backward",
    "send_backward_recv_forward",
    "send_forward_recv_forward",
    "send_backward_recv_backward",
]
