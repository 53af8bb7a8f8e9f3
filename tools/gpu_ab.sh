#!/bin/bash
# Kernel times of the catalog for two versions of attngen in one GPU session: the package at
# $OLD (a folder holding an older attngen/, e.g. from `git archive OLD attngen | tar -x -C DIR`)
# and this checkout's. Compiles both in parallel first, then times them alternately (old, new,
# old, new) so drift shows as a difference between the two runs of one version.
#     OLD=.baseline bash tools/gpu_ab.sh            (outputs in $OUT, default device-out)
set -u
OUT=${OUT:-device-out}
OLD=${OLD:-.baseline}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SPECS=$(ls specs/*.attn | xargs -n1 basename | sed 's/\.attn$//')
T0=$(date +%s)
for spec in $SPECS; do
  PYTHONPATH="$OLD:${PYTHONPATH:-}" python3 tools/time_catalog.py --warm --only "$spec" > "$OUT/warm_old_$spec.log" 2>&1 &
  PYTHONPATH="$PWD:${PYTHONPATH:-}" python3 tools/time_catalog.py --warm --only "$spec" > "$OUT/warm_new_$spec.log" 2>&1 &
done
wait
echo "compiled both versions in $(( $(date +%s) - T0 )) s"
grep -l "Error\|Traceback" "$OUT"/warm_*.log && tail -20 $(grep -l "Traceback" "$OUT"/warm_*.log | head -2)
for round in 1 2; do
  PYTHONPATH="$OLD:${PYTHONPATH:-}" python3 tools/time_catalog.py --label "old$round" --out "$OUT/old$round.json" > /dev/null 2>> "$OUT/ab.log"
  PYTHONPATH="$PWD:${PYTHONPATH:-}" python3 tools/time_catalog.py --label "new$round" --out "$OUT/new$round.json" > /dev/null 2>> "$OUT/ab.log"
done
for round in 1 2; do
  echo "== round $round"; python3 tools/time_catalog.py --compare "$OUT/old$round.json" "$OUT/new$round.json"
done | tee "$OUT/ab_compare.txt"
{ echo "== old1 vs old2 (noise)"; python3 tools/time_catalog.py --compare "$OUT/old1.json" "$OUT/old2.json"; } | tee -a "$OUT/ab_compare.txt"
echo "done in $(( $(date +%s) - T0 )) s"
