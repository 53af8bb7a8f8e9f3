#!/bin/bash
# Everything the GPU checks, in one call within a time budget: timings first (alone on the GPU),
# then the GPU tests and bf16 fuzzing side by side until the budget ends. Logs go to $OUT (or
# ./device-out). Usage, from the repository root on a CUDA machine:
#
#     bash tools/device_session.sh [BUDGET_SECONDS=560]
#
# Timing: benchmarks/sparsity_bench.py (masked variants against FlexAttention, BlockMask outside
# and inside the timed region, tile-table kernel, bf16 checks, visit counts) and gpu_check.py for
# full, causal (SDPA and cuDNN beside) and learned_rel_bias (whose backward scatters atomics).
# Then pytest on the GPU-relevant test files and tools/fuzz_device.py in several seeded processes;
# each fuzz case is printed as it finishes, so a run cut short still says what it checked.
set -u
BUDGET=${1:-560}
OUT=${OUT:-device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T0=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }

timeout 200 python3 benchmarks/sparsity_bench.py --skip-check --only ${SPARSITY_VARIANTS:-sliding_window document_causal prefix_lm block_sparse chunked_causal} \
  --out "$OUT/sparsity.json" > "$OUT/timing.log" 2>&1
timeout 120 python3 benchmarks/gpu_check.py --skip-check --only full causal learned_rel_bias --out "$OUT/gpu_timing.json" >> "$OUT/timing.log" 2>&1
grep -v Warning "$OUT/timing.log" | tail -12
echo "timings done at $(( $(date +%s) - T0 )) s"

REST=$(( $(left) - 15 ))
if [ "$REST" -gt 30 ]; then
  # The trust tests first (their bf16 cases run only here), then the bf16 catalog and sparsity.
  (timeout "$REST" python3 -m pytest -q -p no:cacheprovider -n 6 tests/test_trust.py tests/test_integers.py \
     tests/test_autograd_and_tables.py tests/test_sparsity.py tests/test_kernels.py -k "not test_catalog or bfloat16" \
     > "$OUT/pytest.log" 2>&1; echo "pytest exit $?" >> "$OUT/pytest.log") &
  for seed in 1 2 3 4 5 6; do
    (timeout "$REST" python3 tools/fuzz_device.py --examples 1000 --dtype bf16 --seed "$seed" \
       > "/tmp/fuzz_$seed.log" 2>&1) &
  done
  wait
  for seed in 1 2 3 4 5 6; do echo "== seed $seed"; cat "/tmp/fuzz_$seed.log"; done > "$OUT/fuzz.log"
  tail -3 "$OUT/pytest.log"
  echo "fuzz cases: $(grep -c '^ok' "$OUT/fuzz.log") ok, $(grep -c '^FAIL' "$OUT/fuzz.log") failed"
  grep -A8 '^FAIL' "$OUT/fuzz.log" | head -40
fi
echo "done at $(( $(date +%s) - T0 )) s"
