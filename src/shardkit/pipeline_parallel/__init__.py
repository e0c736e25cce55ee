"""Pipeline parallelism: transfers between stages, schedule tables, stages and a schedule runner.

Every function takes the pipeline group explicitly (a ``ProcessGroup``, a 1-D ``DeviceMesh``,
or a list of them for a stage with several neighbours); stage = group rank. Stages made of tp
groups, of equal or different sizes (VTP), take a :class:`StageGroups` instead, with boundary
layouts :class:`~shardkit.sharding.Replicate` / :class:`~shardkit.sharding.Shard`. Hugging Face
decoder models are cut into stages by :class:`shardkit.parallelize.DecoderStageModule`.
"""

from .._moved import moved_names
from ..sharding import Replicate, Shard, StageGroups, new_stage_groups
from .chunked import ChunkedStage, chunk_layers
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
from .run_mode import ScheduleOutput
from .runner import run_schedule, split_microbatches
from .schedules import Action, bubble_fraction, gpipe_schedule, one_f_one_b_schedule, validate_schedule
from .simulate import simulate  # deprecated for one release: simulate_steps
from .stage import PipelineStage
from .steps import forward_only
from .weight_defer import defer, deferring

# the Hugging Face decoder's stages moved to shardkit.parallelize (deprecated here for one release)
_HF = ("DecoderStageModule", "decoder_stage_layers", "check_pp", "sum_tied_embedding_grads")
__getattr__ = moved_names(__name__, dict.fromkeys(_HF, "shardkit.parallelize"))

__all__ = [
    "Action",
    "gpipe_schedule",
    "one_f_one_b_schedule",
    "validate_schedule",
    "simulate",
    "bubble_fraction",
    "PipelineStage",
    "ChunkedStage",
    "chunk_layers",
    "StageGroups",
    "Replicate",
    "Shard",
    "new_stage_groups",
    "run_schedule",
    "ScheduleOutput",
    "forward_only",
    "deferring",
    "defer",
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
