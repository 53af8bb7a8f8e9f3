#!/bin/bash
# Nsight Compute profiles of the Hopper family's kernels on one call shape: each kernel's one launch
# (after warm-up calls) with the full section set, then the report's details page as text (speed of
# light, occupancy, registers, warp stall reasons) and tools/hopper/ncu_stalls.py's summary of the
# per-instruction samples (stall reasons, the instructions with most samples, the instruction mix).
#     SPEC=specs/causal.attn SHAPE=4,16,8192,64 KERNEL=_hopper_fwd_kernel NAME=fwd_d64 bash tools/hopper/ncu_profile.sh
# BACKWARD=1 profiles forward+backward calls (KERNEL=_hopper_bwd_kernel); TARGET=a100 the portable kernels
# (KERNEL=_fwd_kernel). Outputs in $OUT (default
# device-out): NAME.ncu-rep, NAME.txt (details), NAME.sass.csv (per-instruction samples) and
# NAME-stalls.txt (their summary).
# Clocks are left alone (--clock-control none), as the lent machine's METHOD.md asks.
set -u
OUT=${OUT:-device-out}
SPEC=${SPEC:-specs/causal.attn}
SHAPE=${SHAPE:-4,16,8192,128}
KERNEL=${KERNEL:-_hopper_fwd_kernel}
NAME=${NAME:-profile}
mkdir -p "$OUT"
BACKWARD_FLAG=""
[ "${BACKWARD:-0}" = 1 ] && BACKWARD_FLAG="--backward"
# The profiled program: warm-up calls compile everything, then the launch ncu keeps is the third.
ncu --clock-control none --set full --import-source no -k "regex:$KERNEL" --launch-skip 2 --launch-count 1 \
    -f -o "$OUT/$NAME" python3 tools/hopper/one_call.py --spec "$SPEC" --shape "$SHAPE" $BACKWARD_FLAG --calls 4 \
    ${TARGET:+--target "$TARGET"} \
    > "$OUT/$NAME.ncu.log" 2>&1 || { tail -20 "$OUT/$NAME.ncu.log"; exit 1; }
ncu --import "$OUT/$NAME.ncu-rep" --page details > "$OUT/$NAME.txt"
ncu --import "$OUT/$NAME.ncu-rep" --page source --csv --print-source sass > "$OUT/$NAME.sass.csv" 2>&1
python3 tools/hopper/ncu_stalls.py "$OUT/$NAME.sass.csv" > "$OUT/$NAME-stalls.txt"
grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per Thread|Achieved Occupancy|\
Warp Cycles Per Issued|Issued Ipc|Tensor|Stall" "$OUT/$NAME.txt" | head -40
