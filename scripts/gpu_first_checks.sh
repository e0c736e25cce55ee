#!/usr/bin/env bash
# What to run in the first ten minutes on a lent GPU machine: each step bounded in time, each
# writing one report under the output folder, a summary table last (docs/support.md).
#
#   scripts/gpu_first_checks.sh --dry-run          # print the steps and their time limits
#   scripts/gpu_first_checks.sh --out DIR          # run them (default folder: gpu-checks)
#
# Runs under the machine's own python3/torch (no install: shardkit is imported from src/ when it
# is not installed). Steps on one GPU: the environment and shardkit's import; the fake-CUDA tier
# on a CUDA build; ring attention's fused blocks against float64 (every kernel it picks); ring
# blocks against one fused SDPA call and the old math path at S 2k-8k in bf16 (time, peak
# memory); a one-GPU `shardkit train` (tokens/s, MFU, peak memory); the same run under CUDA's
# sync debug mode (every synchronizing op by source line); `shardkit bench --device cuda`. With
# two or more GPUs, the NCCL layouts follow in order: tp 2 --verify, FSDP2, ring, Ulysses,
# pipelines with messages above NCCL's P2P buffer, MoE, --checks.
# Environment: PYTHON (default python3), STEP_SCALE (multiplies every time limit, default 1).
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
OUT_DIR=gpu-checks
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --out) OUT_DIR=$2; shift ;;
    -h|--help) echo "usage: scripts/gpu_first_checks.sh [--dry-run] [--out DIR]"; sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_first_checks.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
PY=${PYTHON:-python3}
SCALE=${STEP_SCALE:-1}
"$PY" -c "import shardkit" 2>/dev/null || export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
SUMMARY="$OUT_DIR/summary.tsv"
[ $DRY -eq 1 ] || { mkdir -p "$OUT_DIR" && printf 'step\trc\tseconds\tlimit_s\n' >"$SUMMARY"; }

step() {  # step NAME LIMIT_SECONDS COMMAND...: output in $OUT_DIR/NAME.log, a row in summary.tsv
  local name=$1 limit=$(($2 * SCALE)); shift 2
  if [ $DRY -eq 1 ]; then
    printf '%-14s <= %4ss  %s\n' "$name" "$limit" "$*"
    return 0
  fi
  echo "== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1
  local rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$limit" >>"$SUMMARY"
  tail -n 25 "$OUT_DIR/$name.log"
  return 0
}

TRAIN_MODEL=(--hidden-size 1024 --layers 8 --heads 16 --kv-heads 4 --intermediate-size 2816 --seq-len 1024
  --batch-size 8 --dtype bfloat16)
TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc-per-node)
# A dry run lists every step, so it asks torch nothing (each probe imports torch: seconds)
[ $DRY -eq 1 ] && NGPU=0 || NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)

step env 45 "$PY" scripts/gpu_checks.py --out "$OUT_DIR/env.json" env
step fake_tier 60 "$PY" -m pytest -q -p no:cacheprovider tests/context_parallel/test_fused_blocks_cuda.py
step blocks 60 "$PY" scripts/gpu_checks.py --out "$OUT_DIR/blocks.json" blocks
step attention 90 "$PY" scripts/gpu_checks.py --out "$OUT_DIR/attention.json" attention --seq 2048 4096 8192
step train_1gpu 120 "${TORCHRUN[@]}" 1 -m shardkit.cli.main train --tp 1 --steps 30 --log-every 10 \
  "${TRAIN_MODEL[@]}" --report "$OUT_DIR/train_1gpu"
step syncs 90 "${TORCHRUN[@]}" 1 scripts/gpu_checks.py --out "$OUT_DIR/syncs.json" syncs --tp 1 --steps 6 \
  --seq-len 256 --batch-size 4 --dtype bfloat16
if [ $DRY -eq 1 ] || "$PY" -m shardkit.cli.main bench --help 2>/dev/null | grep -q -- "--device"; then
  step bench 90 "${TORCHRUN[@]}" 1 -m shardkit.cli.main bench --device cuda --quick --out "$OUT_DIR/bench"
fi
if [ "$NGPU" -ge 2 ] || [ $DRY -eq 1 ]; then  # NCCL needs one GPU per rank
  NP=2
  step nccl_tp 120 "${TORCHRUN[@]}" $NP -m shardkit.cli.main train --tp 2 --steps 4 --verify
  step nccl_fsdp2 120 "${TORCHRUN[@]}" $NP -m shardkit.cli.main train --tp 1 --dp-shard 2 --steps 4 --verify
  step nccl_ring 120 "${TORCHRUN[@]}" $NP -m shardkit.cli.main train --tp 1 --cp-ring 2 --steps 4 --verify
  step nccl_ulysses 120 "${TORCHRUN[@]}" $NP -m shardkit.cli.main train --tp 1 --cp-ulysses 2 --steps 4 --verify
  # 4 x 1024 x 1024 bf16 activations per message: 8 MiB, above NCCL's 4 MiB P2P chunk.
  step nccl_pp 150 "${TORCHRUN[@]}" $NP -m shardkit.cli.main train --tp 1 --pp 2 --microbatches 4 --steps 4 \
    --seq-len 1024 --hidden-size 1024 --batch-size 16 --verify
  step nccl_moe 120 "${TORCHRUN[@]}" $NP -m shardkit.cli.main train --model moe --tp 1 --dp-shard 2 --ep 2 \
    --steps 4 --verify
  step nccl_checks 120 "${TORCHRUN[@]}" $NP -m shardkit.cli.main train --tp 2 --steps 4 --checks
else
  echo "== NCCL layouts skipped: $NGPU GPU(s); NCCL needs one GPU per rank" | tee "$OUT_DIR/nccl.log"
fi
[ $DRY -eq 1 ] && exit 0
echo "== summary ($SUMMARY)"
column -t -s $'\t' "$SUMMARY" 2>/dev/null || cat "$SUMMARY"
