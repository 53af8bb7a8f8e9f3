#!/bin/bash
# The Hopper family (issue 13) on the GPU, in parts chosen on the command line, each under its own time
# limit; logs and JSON go to $OUT (or ./device-out).
#
#     bash tools/gpu_hopper_session.sh [tests] [suite] [kernels] [fuzz] [targets] [catalog] [layouts]
#
# tests: tests/test_hopper.py's GPU tests (every catalog spec through the family's forward and backward
#   against float64, head dims, empty rows, tables, torch.compile);
# suite: every GPU-marked test of the suite (the Hopper family serves their bf16/fp16 calls now);
# kernels: tests/test_kernels.py and tests/test_grad.py whole, on the GPU (they run on any device, so they
#   carry no gpu mark and `-m gpu` leaves them out; their fp32 cases run the portable family), KERNELS_K
#   (a pytest -k expression) narrows them;
# fuzz: tools/fuzz_device.py --hopper (random specs on shapes the family takes), FUZZ_SECONDS per shard
#   (default 280), FUZZ_SHARDS shards side by side (default 4), seeds FUZZ_SEED_BASE + 1.. (default 0);
# targets: benchmarks/targets.py on the plain, D=64, softcap and learned-bias cases;
# catalog: benchmarks/targets.py on every catalog spec at N=8192;
# layouts: attngen bench on full and causal attention with q, k, v dense and as transposed views (--layout),
#   beside Flex and SDPA given the same tensors.
# WORKERS sets the pytest-xdist workers of tests, suite and kernels (default 8).
set -u
OUT=${OUT:-device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T0=$(date +%s)
for part in ${*:-tests targets}; do
  case $part in
    tests)
      timeout ${TESTS_SECONDS:-420} python3 -m pytest -q -p no:cacheprovider -n ${WORKERS:-8} \
        tests/test_hopper.py > "$OUT/pytest.log" 2>&1
      echo "pytest exit $?" >> "$OUT/pytest.log"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.log" | head -30 ;;
    suite)
      # The launch and Hopper tests first, so that a run cut by its time limit has run them (xdist hands out
      # tests in collection order, and they come late alphabetically).
      T1=$(date +%s)
      timeout ${SUITE_SECONDS:-420} python3 -m pytest -q -p no:cacheprovider -n ${WORKERS:-8} -m gpu \
        tests/test_launch.py tests/test_hopper.py > "$OUT/suite.log" 2>&1
      echo "pytest exit $?" >> "$OUT/suite.log"
      timeout $(( ${SUITE_SECONDS:-420} - $(date +%s) + T1 )) python3 -m pytest -q -p no:cacheprovider \
        -n ${WORKERS:-8} -m gpu tests/ --ignore=tests/test_launch.py --ignore=tests/test_hopper.py \
        >> "$OUT/suite.log" 2>&1
      echo "pytest exit $?" >> "$OUT/suite.log"; grep -E "^(FAILED|ERROR)|passed|failed|exit" "$OUT/suite.log" | head -30 ;;
    kernels)
      timeout ${KERNELS_SECONDS:-300} python3 -m pytest -q -p no:cacheprovider -n ${WORKERS:-8} \
        tests/test_kernels.py tests/test_grad.py ${KERNELS_K:+-k "$KERNELS_K"} > "$OUT/kernels.log" 2>&1
      echo "pytest exit $?" >> "$OUT/kernels.log"
      grep -E "^(FAILED|ERROR)|passed|failed|exit" "$OUT/kernels.log" | head -30 ;;
    fuzz)
      for shard in $(seq ${FUZZ_SHARDS:-4}); do
        timeout ${FUZZ_SECONDS:-280} python3 tools/fuzz_device.py --hopper --examples 1000 \
          --seed $((shard + ${FUZZ_SEED_BASE:-0})) --dtype bf16 --dtype f16 > "$OUT/fuzz$shard.log" 2>&1 &
      done
      wait
      cat "$OUT"/fuzz?.log > "$OUT/fuzz.log" && rm "$OUT"/fuzz?.log
      grep -c "^ok" "$OUT/fuzz.log"; grep -c "fwd hopper" "$OUT/fuzz.log"; grep -c "bwd hopper" "$OUT/fuzz.log"
      grep -A4 "^FAIL" "$OUT/fuzz.log" | head -40 ;;
    targets)
      timeout ${TARGETS_SECONDS:-300} python3 benchmarks/targets.py --only full,causal,causal_d64,softcap,learned_rel_bias \
        --out "$OUT/targets-shapes.json" > "$OUT/targets-shapes.log" 2>&1; tail -60 "$OUT/targets-shapes.log" | cut -c1-220 ;;
    catalog)
      timeout ${CATALOG_SECONDS:-400} python3 benchmarks/targets.py --only catalog --out "$OUT/targets-catalog.json" \
        > "$OUT/targets-catalog.log" 2>&1; tail -60 "$OUT/targets-catalog.log" | cut -c1-220 ;;
    layouts)
      for spec in full causal; do
        for layout in dense transposed; do
          timeout ${LAYOUT_SECONDS:-150} python3 -m attngen.cli bench specs/$spec.attn --layout $layout \
            --json "$OUT/bench-$spec-$layout.json" > "$OUT/bench-$spec-$layout.log" 2>&1
          echo "exit $?"; tail -14 "$OUT/bench-$spec-$layout.log" | cut -c1-180
        done
      done ;;
  esac
  echo "-- $part done at $(( $(date +%s) - T0 )) s"
done
