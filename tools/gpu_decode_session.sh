#!/bin/bash
# The decode family and cache calls on the GPU in one call: the decode benchmark alone on the GPU
# (SWEEP=1: its tile sweep instead), then the decode and cache tests and the catalog's bf16 tests.
# Logs go to $OUT.
#     bash tools/gpu_decode_session.sh
set -u
OUT=${OUT:-device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
timeout ${BENCH_SECONDS:-300} python3 benchmarks/decode_bench.py ${SWEEP:+--sweep} --out "$OUT/decode.json" 2>&1 \
  | grep -v Warning > "$OUT/bench.log"
cat "$OUT/bench.log"
timeout ${TEST_SECONDS:-240} python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_decode.py tests/test_cache.py \
  tests/test_kernels.py -k "decode or cache or paged or bfloat16" > "$OUT/pytest.log" 2>&1
echo "pytest exit $?" >> "$OUT/pytest.log"
tail -5 "$OUT/pytest.log"
