#!/usr/bin/env bash
# Build a clean virtual environment holding shardkit's declared floors (or the newest releases)
# and run the quick test tier in it: the ranges in pyproject.toml are only claimed if both pass.
#
#   scripts/check_floors.sh                      # floors from pyproject.toml, quick tier of tests/
#   scripts/check_floors.sh --newest             # the newest torch and transformers (.venv-newest)
#   scripts/check_floors.sh --all tests/expert_parallel   # every tier (slow, meta) of some paths
#   TRANSFORMERS=5.20.2 scripts/check_floors.sh tests/expert_parallel   # try another candidate
#
# Environment: PYTHON (interpreter for the venv, default python3), VENV (default .venv-floors,
# .venv-newest with --newest), TRANSFORMERS / TORCH (versions; default: the floors read from
# pyproject.toml, or with --newest the newest release `pip index versions` lists).
# The venv is made without --system-site-packages, so nothing installed globally can leak in.
# Any torch but the local CPU wheel (2.13.0 here) downloads its CUDA build (GBs; it runs on CPU):
# fine for this check, never for the README's commands.
# A site-wide pip constraints file can cap a version below the newest (this machine's
# /etc/xdg/pip caps torch at 2.14.1): --newest sets PIP_CONSTRAINT=/dev/null for its own pip calls,
# which overrides the config file's constraint without touching it (or set PIP_CONSTRAINT
# yourself, or put "[global] constraint = /dev/null" in $VENV/pip.conf).
set -euo pipefail
usage() {
  echo "usage: scripts/check_floors.sh [--newest] [--all] [TEST_PATH ...]"
  sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'
}
NEWEST=0
MARKERS="not slow and not meta"  # the quick tier (pyproject.toml's markers)
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --newest) NEWEST=1; shift ;;
    --all) MARKERS=""; shift ;;
    --) shift; break ;;
    -*) echo "check_floors.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) break ;;
  esac
done
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

floor() {  # the version after ">=" of a requirement named $1 in pyproject.toml
  sed -n "s/.*\"$1>=\([0-9][0-9.]*\)[\",;].*/\1/p" pyproject.toml | head -1
}
newest() {  # the newest release of package $1 on the configured indexes
  "$PYTHON" -m pip index versions "$1" 2>/dev/null | sed -n 's/^Available versions: \([^,]*\).*/\1/p'
}

if [ "$NEWEST" = 1 ]; then
  VENV=${VENV:-.venv-newest}
  export PIP_CONSTRAINT=${PIP_CONSTRAINT:-/dev/null}
  TORCH=${TORCH:-$(newest torch)}
  TRANSFORMERS=${TRANSFORMERS:-$(newest transformers)}
  SAFETENSORS_PIN="safetensors>=$(floor safetensors)"  # as pip resolves it for that transformers
  WHAT="newest"
else
  VENV=${VENV:-.venv-floors}
  TORCH=${TORCH:-$(floor torch)}
  TRANSFORMERS=${TRANSFORMERS:-$(floor transformers)}
  SAFETENSORS_PIN="safetensors==$(floor safetensors)"
  WHAT="floors"
fi
if [ -z "$TORCH" ] || [ -z "$TRANSFORMERS" ]; then
  echo "check_floors.sh: no torch / transformers version found (torch '$TORCH', transformers '$TRANSFORMERS')" >&2
  exit 1
fi
echo "$WHAT: python $($PYTHON -c 'import platform; print(platform.python_version())')," \
     "torch $TORCH, transformers $TRANSFORMERS, $SAFETENSORS_PIN"

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q "torch==$TORCH"
# shardkit with every extra the suite uses, torch, transformers and safetensors held at the
# versions above (the other dependencies as pip resolves them against those pins).
"$PY" -m pip install -q -e ".[hf,plot,tb,test,docs]" "torch==$TORCH" "transformers==$TRANSFORMERS" \
  "$SAFETENSORS_PIN"
"$PY" -m pip check
"$PY" - <<'PY'
import sys, torch, transformers
import safetensors
print(f"running on python {sys.version.split()[0]}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}, safetensors {safetensors.__version__}")
PY
# Run the tests with the venv's interpreter, with nothing else on the path.
if [ -n "$MARKERS" ]; then
  PYTHONPATH= "$PY" -m pytest -q -m "$MARKERS" "${@:-tests}"
else
  PYTHONPATH= "$PY" -m pytest -q "${@:-tests}"
fi
