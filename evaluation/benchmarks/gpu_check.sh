#!/usr/bin/env bash
# GPU check (one CUDA GPU, under 8 minutes on an H200): bf16 verify cost eager / compiled /
# CUDA graphs on a random ~1B Llama, and training steps under gpu, deepspeed_zero2,
# deepspeed_zero3 and fsdp with the measured peak memory against `hydra-heads plan`.
#   bash evaluation/benchmarks/gpu_check.sh [--quick] [--sections verify,train] [--out DIR]
# In the project's environment (`make setup`). On a bare GPU machine, wheels of the missing
# packages in .whl/ are installed into /tmp/site first.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
exec "$PY" evaluation/benchmarks/gpu_check.py "$@"
