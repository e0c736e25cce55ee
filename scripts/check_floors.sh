#!/usr/bin/env bash
# Build a clean virtual environment holding shardkit's declared floors and run the test suite
# in it: the minimums in pyproject.toml are only claimed if this passes.
#
#   scripts/check_floors.sh                      # floors from pyproject.toml, whole suite
#   scripts/check_floors.sh tests/tensor_parallel tests/expert_parallel tests/context_parallel
#   TRANSFORMERS=4.57.6 scripts/check_floors.sh tests/expert_parallel   # try another candidate
#
# Environment: PYTHON (interpreter for the venv, default python3), VENV (default
# .venv-floors), TRANSFORMERS / TORCH (versions, default: the floors read from pyproject.toml).
# The venv is made without --system-site-packages, so nothing installed globally (a newer
# transformers, say) can leak into the run.
set -euo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  echo "usage: scripts/check_floors.sh [TEST_PATH ...]"
  sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv-floors}

floor() {  # the version after ">=" of a requirement named $1 in pyproject.toml
  sed -n "s/.*\"$1>=\([0-9][0-9.]*\)[\",;].*/\1/p" pyproject.toml | head -1
}
TORCH=${TORCH:-$(floor torch)}
TRANSFORMERS=${TRANSFORMERS:-$(floor transformers)}
SAFETENSORS=$(floor safetensors)
echo "floors: python $($PYTHON -c 'import platform; print(platform.python_version())')," \
     "torch $TORCH, transformers $TRANSFORMERS, safetensors $SAFETENSORS"

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q "torch==$TORCH"
# shardkit with every extra the suite uses, torch, transformers and safetensors held at their
# floors (the other dependencies as pip resolves them against those pins).
"$PY" -m pip install -q -e ".[hf,plot,tb,test,docs]" "torch==$TORCH" "transformers==$TRANSFORMERS" \
  "safetensors==$SAFETENSORS"
"$PY" -m pip check
"$PY" - <<'PY'
import sys, torch, transformers
import safetensors
print(f"running on python {sys.version.split()[0]}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}, safetensors {safetensors.__version__}")
PY
# The venv is at the floors: run the tests with its interpreter, with nothing else on the path.
PYTHONPATH= "$PY" -m pytest -q "${@:-tests}"
