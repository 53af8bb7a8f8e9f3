#!/bin/bash
# One device call: install the wheels carried in .whl (lark, pydantic: the GPU image lacks them), then run
# the given pytest arguments on the GPU with xdist, logging to $OUT. Usage:
#     bash tools/gpu_session.sh [WORKERS=8] -- PYTEST_ARGS...
set -u
WORKERS=${1:-8}; shift; [ "${1:-}" = "--" ] && shift
OUT=${OUT:-device-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
fi
python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())'
python3 -m pytest -q -p no:cacheprovider -n "$WORKERS" "$@" 2>&1 | tee "$OUT/pytest.log" | tail -60
