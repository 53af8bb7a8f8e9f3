#!/bin/bash
# The ecosystem checks of issue 11 on a CUDA machine, in one call: torch.compile (Inductor,
# dynamic lengths, CUDA graphs, host overhead), `attngen bench` on four catalog specs, and the
# GPU-marked tests of the Flex translation and bench. Logs and JSON go to $OUT (or ./device-out).
#
#     bash tools/gpu_ecosystem.sh [compile] [bench] [tests] [hf]
set -u
OUT=${OUT:-device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PARTS=${*:-compile bench tests}
T0=$(date +%s)
for part in $PARTS; do
  case $part in
    compile)
      timeout 240 python3 benchmarks/compile_check.py --out "$OUT/compile.json" > "$OUT/compile.log" 2>&1
      grep -E "^(ok|FAIL) " "$OUT/compile.log" | cut -c1-400 ;;
    bench)
      for spec in causal sliding_window document_causal gemma2_local; do
        timeout 150 python3 -m attngen.cli bench "specs/$spec.attn" --json "$OUT/bench_$spec.json" \
          --plot "$OUT/bench_$spec.png" > "$OUT/bench_$spec.log" 2>&1
        echo "== bench $spec (exit $?)"; grep -v -i warn "$OUT/bench_$spec.log" | tail -14
      done ;;
    tests)
      timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_flex.py tests/test_bench.py \
        > "$OUT/pytest_gpu.log" 2>&1; grep -E "^E |Error|passed|failed" "$OUT/pytest_gpu.log" | head -30 ;;
    hf)
      timeout 400 python3 benchmarks/hf_check.py --out "$OUT/hf.json" > "$OUT/hf.log" 2>&1
      grep -E "^(sdpa|flex_attention|attngen) " "$OUT/hf.log"; tail -5 "$OUT/hf.log" ;;
  esac
  echo "-- $part done at $(( $(date +%s) - T0 )) s"
done
# One archive: the device tool brings back only a few files.
tar -czf "$OUT/../ecosystem-$(date +%H%M%S).tgz" -C "$OUT" . && rm -rf "$OUT"/* && mv "$OUT"/../ecosystem-*.tgz "$OUT"/
