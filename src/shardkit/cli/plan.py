"""``shardkit plan``: rank every layout of a model on a cluster by predicted step time.

The model is a Hugging Face ``config.json``; the cluster a preset (``--preset h100`` / ``h800``,
figures and sources in :mod:`shardkit.plan.cluster`) with any figure overridden by a flag.
Prints the fastest layouts that fit in memory (pipeline schedule and virtual stages included)
with their breakdown (and, for their ring cp degrees, each cp layout's load balance), and writes
a plot of them when matplotlib (the ``plot`` extra) is installed; ``--json`` prints them as a
JSON list instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

from .._optional import install_hint, missing
from ..errors import ShardkitError
from ..parallelize.fake_world import fake_world_table
from ..pipeline_parallel.tables import SCHEDULES
from ..plan import CLUSTERS, Cluster, ModelShape, StepEstimate, StepOptions, estimate_step, plan_layouts, save_cost
from ..plan.cp_balance import CP_LAYOUTS, balance_lines, layout_balance
from ..plan.rules import check_schedule
from ..plan.search import schedule_choices
from ..sharding import ParallelDims
from .commands import COMMANDS
from .train_flags import ac_value

__all__ = ["add_plan_parser", "run_plan", "parse_layout"]

_FIGURES = (
    "gpus_per_node",
    "intra_gbps",
    "inter_gbps",
    "intra_latency_us",
    "inter_latency_us",
    "gpu_memory_gib",
    "peak_tflops",
    "efficiency",
)


def add_plan_parser(commands) -> argparse.ArgumentParser:
    """Add ``plan`` to the ``shardkit`` subcommands; returns its parser."""
    p = commands.add_parser(
        "plan",
        help=COMMANDS["plan"],
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument(
        "--config",
        required=True,
        metavar="PATH",
        help="a Hugging Face config.json, or what `train --model-path` takes: a checkpoint directory or a GGUF file",
    )
    p.add_argument("--gpus", type=int, required=True, help="GPUs in the job (the world size)")
    p.add_argument("--preset", choices=sorted(CLUSTERS), default="h100", help="cluster figures (default h100)")
    for name in _FIGURES:
        p.add_argument(
            f"--{name.replace('_', '-')}",
            type=float if name != "gpus_per_node" else int,
            default=None,
            help=f"override the preset's {name}",
        )
    p.add_argument("--seq-len", type=int, default=8192, help="tokens per sequence (default 8192)")
    p.add_argument("--global-batch", type=int, default=2048, help="sequences per step (default 2048)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument(
        "--schedule",
        choices=list(SCHEDULES),
        default=None,
        help="pipeline schedule (default: rank every schedule; gpipe keeps every microbatch's activations)",
    )
    p.add_argument(
        "--ac",
        type=ac_value,
        metavar="{none,full,selective,selective:N}",
        default="none",
        help="activation checkpointing, as shardkit train --ac (default none)",
    )
    p.add_argument(
        "--zero",
        type=int,
        choices=(0, 1, 2),
        default=0,
        help="ZeRO-1 / ZeRO-2 over the data ranks, as shardkit train --zero: only layouts with "
        "dp_shard 1 are ranked (default 0: off)",
    )
    p.add_argument(
        "--sp-activation",
        choices=("shard", "gathered"),
        default="shard",
        help="with sequence parallelism, as shardkit train --sp-activation (default shard)",
    )
    p.add_argument(
        "--async-tp",
        action="store_true",
        help="as shardkit train --async-tp: sequence parallelism's gathers and reduce-scatters as collective-matmul "
        "rings, each step's transfer hidden behind one block's matmul (layouts with tp > 1 and SP)",
    )
    p.add_argument(
        "--virtual-stages",
        type=int,
        default=None,
        metavar="V",
        help="chunks per pipeline rank (default: every V the schedule takes, up to 8); with --compare "
        "the V of the compared layouts (default 1, or 2 for zbv and dualpipev)",
    )
    p.add_argument("--json", action="store_true", help="print the ranked layouts as a JSON list (no table or plot)")
    p.add_argument("--top", type=int, default=10, help="layouts to print (default 10)")
    p.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="LAYOUT",
        help="also estimate this layout, e.g. 'tp=8,pp=16,cp_ring=2' or 'pp_tp=8:8:4' (stages of "
        "different tp sizes); dp_replicate: the rest",
    )
    p.add_argument("--plot", default="plan.png", help="where to write the plot (default plan.png)")
    p.add_argument(
        "--dry-run",
        default=None,
        metavar="LAYOUT",
        help="instead of ranking: build the real parallelized model of this layout (as --compare) on a fake "
        "world, one rank per pipeline stage, and print its counted params/grads/optimizer bytes against the plan",
    )
    p.set_defaults(func=run_plan)
    return p


def parse_layout(text: str, gpus: int) -> ParallelDims:
    """``"tp=8,pp=16,dp_shard=4"`` or ``"pp_tp=8:8:4"`` -> ParallelDims (``dp_replicate`` fills
    the rest of ``gpus``).

    Raises:
        ShardkitError: an unknown axis, a bad number, or degrees that do not divide ``gpus``.
    """
    known = {f.name for f in dataclasses.fields(ParallelDims)} - {"world_size", "pp_tp"}
    degrees: dict[str, int] = {}
    pp_tp: tuple[int, ...] | None = None
    for part in filter(None, text.split(",")):
        axis, _, number = (x.strip() for x in part.partition("="))
        if axis == "pp_tp" and all(n.isdigit() for n in number.split(":")):
            pp_tp = tuple(int(n) for n in number.split(":"))
            continue
        if axis not in known or not number.isdigit():
            raise ShardkitError(
                f"--compare {text!r}: expected axis=int pairs with axes {sorted(known)} (or "
                f"pp_tp=t0:t1:...), got {part!r}"
            )
        degrees[axis] = int(number)
    used = math.prod(d for axis, d in degrees.items() if axis != "ep")  # ep borrows, it does not multiply
    used *= sum(pp_tp) if pp_tp else 1  # a pipeline replica of stages of different tp sizes
    if "dp_replicate" not in degrees:
        if gpus % used:
            raise ShardkitError(
                f"--compare {text!r}: the degrees multiply to {used}, which does not divide {gpus} GPUs"
            )
        degrees["dp_replicate"] = gpus // used
    return ParallelDims(world_size=gpus, pp_tp=pp_tp, **degrees)  # type: ignore[arg-type]


def _cluster(args) -> Cluster:
    figures = dict(CLUSTERS[args.preset])
    figures.update({k: getattr(args, k) for k in _FIGURES if getattr(args, k) is not None})
    return Cluster(gpus=args.gpus, **figures)  # type: ignore[arg-type]


def _row(est: StepEstimate) -> list[str]:
    axes = est.axis_seconds()
    comm = " ".join(f"{a} {axes[a] * 1e3:.0f}" for a in ("tp", "cp", "ep", "pp", "dp", "fsdp") if axes.get(a))
    return [
        est.dims.describe(),
        f"{est.options.schedule} v={est.options.virtual_stages}" if est.dims.pp > 1 else "-",
        f"{est.options.microbatches}",
        f"{est.step_s:.2f}",
        f"{est.compute_s:.2f}",
        f"{est.bubble:.2f}",
        f"{est.comm_s:.2f}",
        comm or "-",
        f"{est.memory['total'] / 2**30:.1f}",
        f"{est.mfu:.2f}",
    ]


HEADER = [
    "layout",
    "schedule",
    "M",
    "step s",
    "compute s",
    "bubble",
    "exposed comm s",
    "comm ms per axis",
    "GiB/GPU",
    "MFU",
]


def _print(title: str, estimates: list[StepEstimate]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        print(" | ".join(HEADER))
        for est in estimates:
            print(" | ".join(_row(est)))
        return
    table = Table(title=title)
    for h in HEADER:
        table.add_column(h)
    for est in estimates:
        table.add_row(*_row(est))
    Console(width=160).print(table)


def as_json(est: StepEstimate, given: bool = False) -> dict[str, object]:
    """One layout's row of ``--json``: ``layout``, ``schedule``, ``virtual_stages``,
    ``microbatches``, ``step_s``, ``compute_s``, ``bubble``, ``comm_s``, ``memory_gib``,
    ``fits``, ``mfu``, ``tokens_per_s``, ``given`` (a ``--compare`` layout), and with ring cp
    ``cp_layout_balance`` (each ring layout's slowest rank / mean, causal)."""
    return dict(
        layout=est.dims.describe(),
        schedule=est.options.schedule,
        virtual_stages=est.options.virtual_stages,
        microbatches=est.options.microbatches,
        step_s=est.step_s,
        compute_s=est.compute_s,
        bubble=est.bubble,
        comm_s=est.comm_s,
        memory_gib=est.memory["total"] / 2**30,
        fits=est.fits,
        mfu=est.mfu,
        tokens_per_s=est.tokens_per_s,
        given=given,
        **(_balances(est) if est.dims.cp_ring > 1 else {}),
    )


def _balances(est: StepEstimate) -> dict[str, object]:
    """``cp_layout_balance``: each ring cp layout's slowest rank / mean (:mod:`shardkit.plan.cp_balance`)."""
    seq, ring = est.options.seq_len, est.dims.cp_ring
    return {"cp_layout_balance": {name: layout_balance(seq, ring, name) for name in CP_LAYOUTS}}


def _plot(path: str, estimates: list[StepEstimate], given: int = 0) -> None:
    """Stacked bars (compute, bubble, exposed communication) per layout; the last ``given``
    are the ``--compare`` layouts."""
    if missing(["matplotlib"]):
        print(f"plot skipped: matplotlib is not installed ({install_hint(['matplotlib'])})")
        return
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 0.5 * len(estimates) + 1.5))
    ax = fig.add_subplot()
    names = [e.dims.describe() + (" (given)" if i >= len(estimates) - given else "") for i, e in enumerate(estimates)][
        ::-1
    ]
    parts = [
        ("compute", [e.compute_s for e in estimates]),
        ("bubble", [e.compute_s * e.bubble / (1 - e.bubble) for e in estimates]),
        ("exposed comm", [e.comm_s for e in estimates]),
    ]
    left = [0.0] * len(estimates)
    for label, values in parts:
        ax.barh(names, values[::-1], left=left[::-1], label=label)
        left = [a + b for a, b in zip(left, values)]
    ax.set_xlabel("predicted seconds per step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")  # long layout names: grow the image, never clip them
    print(f"plot: {path}")


def _model_config(path: str):
    """``--config``: a ``config.json`` as it is, the one of a checkpoint directory, or a GGUF
    file's (read as ``train --model-path`` reads it; needs transformers and gguf).

    Raises:
        ShardkitError: a directory without ``config.json``, or an unreadable GGUF file.
    """
    if os.path.isdir(path):
        config = os.path.join(path, "config.json")
        if not os.path.isfile(config):
            raise ShardkitError(
                f"--config: the directory {path} has no config.json (a Hugging Face checkpoint has one)"
            )
        return config
    if not path.lower().endswith(".gguf"):
        return path
    from ..train.pretrained import read_config  # transformers: imported only for a GGUF file

    try:
        return read_config(path)
    except ShardkitError as e:
        raise ShardkitError(str(e).replace("--model-path", "--config", 1)) from None


def run_plan(args: argparse.Namespace) -> int:
    """Run ``shardkit plan``; returns the exit code (errors: one line, code 2)."""
    try:
        cluster = _cluster(args)
        shape = ModelShape.from_config(_model_config(args.config))
        if args.virtual_stages is not None:  # the schedule's v range, before any layout (pp 2, 4 microbatches)
            for name in [args.schedule] if args.schedule else []:
                check_schedule(name, 2, args.virtual_stages, 4, 2 * args.virtual_stages)
            if args.virtual_stages < 1:
                raise ShardkitError(f"--virtual-stages must be >= 1, got {args.virtual_stages}")
        options = StepOptions(
            seq_len=args.seq_len,
            global_batch=args.global_batch,
            dtype=args.dtype,
            activation_checkpoint=args.ac,
            zero=args.zero,
            sp_activation=args.sp_activation,
            async_tp=args.async_tp,
        )
        if args.dry_run is not None:
            dims = parse_layout(args.dry_run, args.gpus)
            m = dataclasses.replace(options, microbatches=max(1, args.global_batch // dims.dp))
            print("\n".join(fake_world_table(args.config, dims, m)))
            return 0
        choices = None
        if args.schedule is not None or args.virtual_stages is not None:
            choices = schedule_choices(args.schedule, args.virtual_stages)
        best = plan_layouts(shape, cluster, options, top=args.top, schedules=choices)
    except ShardkitError as e:
        print(f"shardkit plan: {e}")
        return 2
    compared, refused = [], []
    for text in args.compare:
        try:
            dims = parse_layout(text, args.gpus)
            schedule = args.schedule or "1f1b"
            v = args.virtual_stages or SCHEDULES[schedule].v_min if dims.pp > 1 else 1
            opts = dataclasses.replace(
                options, microbatches=args.global_batch // dims.dp, schedule=schedule, virtual_stages=v
            )
            check_schedule(schedule, dims.pp, v, opts.microbatches, shape.layers)
            compared.append(estimate_step(shape, dims, opts, cluster))
        except ShardkitError as e:  # a published layout shardkit cannot run: say why, keep the rest
            refused.append(f"--compare {text}: refused: {e}")
    if args.json:
        rows = [as_json(e) for e in best] + [as_json(e, given=True) for e in compared]
        print(json.dumps(rows, indent=1))
        for line in refused:
            print(line, file=sys.stderr)
        return 0
    print(
        f"{shape.total_params / 1e9:.1f} B parameters ({shape.active_params / 1e9:.1f} B active); "
        f"{cluster.gpus} x {cluster.name}; seq {args.seq_len}, {args.global_batch} sequences per step, {args.dtype}"
    )
    _print(f"fastest {len(best)} layouts that fit in {cluster.gpu_memory_gib:g} GiB", best)
    if compared:
        _print("compared layouts", compared)
    for line in balance_lines(args.seq_len, [e.dims.cp_ring for e in best + compared]) + refused:
        print(line)
    if best:
        print(save_line(shape, best[0], cluster))
    _plot(args.plot, best + compared, given=len(compared))
    return 0


def save_line(shape: ModelShape, est: StepEstimate, cluster: Cluster) -> str:
    """What a checkpoint save adds to a step of ``est``'s layout, synchronous and
    ``--async-checkpoint`` (:func:`shardkit.plan.saving.save_cost`)."""
    sync = save_cost(shape, est.dims, est.options, cluster, asynchronous=False)
    ahead = save_cost(shape, est.dims, est.options, cluster, asynchronous=True)
    return (
        f"a save of the fastest layout: {sync.written / 1e9:.2f} GB written per GPU at "
        f"{cluster.checkpoint_gbps:g} GB/s, {sync.critical_s:.2f} s on the critical path; with "
        f"--async-checkpoint {ahead.staged / 1e9:.2f} GB staged at {cluster.host_gbps:g} GB/s, "
        f"{ahead.critical_s:.2f} s (the write runs behind the next steps; one longer than the steps "
        "between saves delays the next save)"
    )
