#!/bin/bash
# The inference work (issue 14) on the GPU, in parts chosen on the command line, each under its own
# time limit; logs and JSON go to $OUT (or ./device-out).
#
#     bash tools/gpu_decode_session.sh [tests] [prefill] [bench] [hf] [fuzz] [hopper]
#
# tests: the decode and cache tests (the CUDA-graph capture among them) and the catalog's bf16 kernels;
# prefill: benchmarks/decode_bench.py --prefill (chunked prefill on both forward families);
# bench: benchmarks/decode_bench.py (issue 14's targets table, tile-table masks decoded);
# hf: benchmarks/hf_check.py (a transformers Llama: training step, greedy generation tokens/s);
# fuzz: tools/fuzz_device.py over cache calls (FUZZ_SECONDS, default 240), bf16 and fp16;
# hopper: tools/hopper/gpu_bench.py (the Gluon forward prototype of issue 13).
set -u
OUT=${OUT:-device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T0=$(date +%s)
for part in ${*:-tests prefill bench}; do
  case $part in
    tests)
      timeout 300 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_decode.py tests/test_cache.py \
        tests/test_kernels.py -k "decode or cache or paged or graph or bfloat16" > "$OUT/pytest.log" 2>&1
      echo "pytest exit $?" >> "$OUT/pytest.log"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.log" | head -20 ;;
    prefill)
      timeout 240 python3 benchmarks/decode_bench.py --prefill --out "$OUT/prefill.json" 2>&1 \
        | grep -v Warning > "$OUT/prefill.log"; tail -3 "$OUT/prefill.log" ;;
    bench)
      timeout 300 python3 benchmarks/decode_bench.py --out "$OUT/decode.json" 2>&1 | grep -v Warning > "$OUT/bench.log"
      cut -c1-300 "$OUT/bench.log" ;;
    hf)
      timeout 300 python3 benchmarks/hf_check.py --out "$OUT/hf.json" > "$OUT/hf.log" 2>&1
      grep -E "^(sdpa|flex_attention|attngen) " "$OUT/hf.log" | cut -c1-400 ;;
    fuzz)
      for shard in 1 2 3 4; do
        timeout ${FUZZ_SECONDS:-240} python3 tools/fuzz_device.py --examples 400 --seed $shard --dtype bf16 \
          --dtype f16 --cache contiguous --cache paged16 --cache paged32 > "$OUT/fuzz$shard.log" 2>&1 &
      done
      wait
      cat "$OUT"/fuzz?.log > "$OUT/fuzz.log" && rm "$OUT"/fuzz?.log
      grep -c "^ok" "$OUT/fuzz.log"; grep -c "^skip" "$OUT/fuzz.log"; grep -A4 "^FAIL" "$OUT/fuzz.log" | head -40 ;;
    hopper)
      timeout ${HOPPER_SECONDS:-400} python3 tools/hopper/gpu_bench.py --check-timeout 150 --out "$OUT/hopper.json" \
        > "$OUT/hopper.log" 2>&1; tail -40 "$OUT/hopper.log" | cut -c1-250 ;;
  esac
  echo "-- $part done at $(( $(date +%s) - T0 )) s"
done
