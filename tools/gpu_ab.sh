#!/bin/bash
# Kernel times of the catalog for two versions of attngen in one GPU session: the package at
# $OLD (a folder holding an older attngen/, e.g. from `git archive OLD attngen | tar -x -C DIR`)
# and the one at $NEW (default: this checkout). Compiles both in parallel first, then times them
# alternately (old, new, old, new) so drift shows as a difference between the two runs of one version.
#     OLD=.baseline bash tools/gpu_ab.sh            (outputs in $OUT, default device-out)
# HEAD_DIM (default 128) sets D and DV; SPECS (default every catalog spec) names the specs, FOLDER (default
# specs) the folder they are in; SHAPE (B,H,N; default 2,16,8192) the batch, heads and length; TAG prefixes the
# output files, so several comparisons can share one $OUT.
set -u
OUT=${OUT:-device-out}
OLD=${OLD:-.baseline}
NEW=${NEW:-$PWD}
TAG=${TAG:-}
HEAD_DIM=${HEAD_DIM:-128}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
FOLDER=${FOLDER:-specs}
SPECS=${SPECS:-$(ls "$FOLDER"/*.attn | xargs -n1 basename | sed 's/\.attn$//')}
SHAPE=${SHAPE:-2,16,8192}
TIME="tools/time_catalog.py --head-dim $HEAD_DIM --folder $FOLDER --shape $SHAPE"
T0=$(date +%s)
for spec in $SPECS; do
  PYTHONPATH="$OLD:${PYTHONPATH:-}" python3 $TIME --warm --only "$spec" > "$OUT/${TAG}warm_old_$spec.log" 2>&1 &
  PYTHONPATH="$NEW:${PYTHONPATH:-}" python3 $TIME --warm --only "$spec" > "$OUT/${TAG}warm_new_$spec.log" 2>&1 &
done
wait
echo "compiled both versions in $(( $(date +%s) - T0 )) s"
# The compile logs go into one file (a device call brings back few files); the first failure is shown.
for log in "$OUT"/${TAG}warm_*.log; do echo "== $log"; cat "$log"; done > "$OUT/${TAG}warm.log" && rm -f "$OUT"/${TAG}warm_*.log
grep -q "Traceback" "$OUT/${TAG}warm.log" && grep -m1 -B2 -A20 "Traceback" "$OUT/${TAG}warm.log"
for round in 1 2; do
  for version in old new; do
    dir=$OLD; [ $version = new ] && dir=$NEW
    PYTHONPATH="$dir:${PYTHONPATH:-}" python3 $TIME --only $SPECS --label "$version$round" \
      --out "$OUT/${TAG}$version$round.json" > /dev/null 2>> "$OUT/${TAG}ab.log"
  done
done
for round in 1 2; do
  echo "== round $round"; python3 tools/time_catalog.py --compare "$OUT/${TAG}old$round.json" "$OUT/${TAG}new$round.json"
done | tee "$OUT/${TAG}ab_compare.txt"
{ echo "== old1 vs old2 (noise)"
  python3 tools/time_catalog.py --compare "$OUT/${TAG}old1.json" "$OUT/${TAG}old2.json"; } | tee -a "$OUT/${TAG}ab_compare.txt"
echo "done in $(( $(date +%s) - T0 )) s"
