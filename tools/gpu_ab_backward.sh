#!/bin/bash
# The Hopper backward of two versions of attngen in one GPU session: the GPU tests of the Hopper kernels on
# $NEW (default: this checkout) against the float64 reference, then tools/hopper/backward_cases.py's times for
# the package at $OLD (a folder holding an older attngen/, e.g. from `git archive OLD attngen | tar -x -C DIR`)
# and at $NEW, in turn (old, new, new, old), so drift between runs shows as a difference between the two runs
# of one version. Both versions' kernels are compiled beside the tests first.
#     OLD=/tmp/old bash tools/gpu_ab_backward.sh            (outputs in $OUT, default device-out)
# TESTS_S bounds the tests (default 240 s); CUDNN=1 times cuDNN beside the first run.
set -u
OUT=${OUT:-device-out}
OLD=${OLD:-.baseline}
NEW=${NEW:-$PWD}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T0=$(date +%s)
CASES=tools/hopper/backward_cases.py
(PYTHONPATH="$NEW:${PYTHONPATH:-}" timeout "${TESTS_S:-240}" python3 -m pytest -v -p no:cacheprovider -n 12 tests/test_hopper.py tests/test_sinks.py \
   tests/test_packed.py tests/test_sigmoid.py tests/test_dropout.py \
   -k "hopper or 128_query or head_dims_on or short_query or gqa_head_dims or packed_half" > "$OUT/tests.log" 2>&1) &
for version in old new; do
  dir=$OLD; [ $version = new ] && dir=$NEW
  (PYTHONPATH="$dir:${PYTHONPATH:-}" timeout 300 python3 $CASES --label warm --out "/tmp/warm-$version.json" \
     > "$OUT/warm-$version.log" 2>&1) &
done
wait
echo "tests and compiles: $(( $(date +%s) - T0 )) s; $(grep -c PASSED "$OUT/tests.log") passed, $(grep -c FAILED "$OUT/tests.log") failed"
grep -E "FAILED|ERROR" "$OUT/tests.log" | head -20
n=0
for version in old new new old; do
  dir=$OLD; [ $version = new ] && dir=$NEW
  n=$((n + 1))
  cudnn=""; [ "${CUDNN:-0}" = 1 ] && [ $n = 1 ] && cudnn=--cudnn
  PYTHONPATH="$dir:${PYTHONPATH:-}" python3 $CASES --label "$version$n" --out "$OUT/backward-$version$n.json" $cudnn \
    2>> "$OUT/backward.err" | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print(r['label'], r['case'], r['bwd_ms'], r['bwd_tflops'] or '', r.get('cudnn_bwd_ms', ''))"
done
echo "done in $(( $(date +%s) - T0 )) s"
