"""Summarizes the per-SASS-instruction page of an Nsight Compute report (tools/hopper/ncu_profile.sh's
NAME.sass.csv): the warp stall reasons over all samples, the instructions with the most samples, and the
executed instruction mix by opcode (per work unit when --units is given, e.g. the tiles the kernel did).

    python tools/hopper/ncu_stalls.py device-out/fwd_d64.sass.csv [--top 25] [--units 133120]
"""

from __future__ import annotations

import argparse
import csv
from collections import Counter

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def _count(text: str) -> int:
    return int(text) if text not in ("", "-") else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    parser.add_argument("--top", type=int, default=25, help="instructions with the most samples to list")
    parser.add_argument("--units", type=int, default=1, help="divide the instruction mix by this count")
    args = parser.parse_args()
    with open(args.csv, newline="") as f:
        rows = list(csv.reader(f))
    header, data = rows[1], [r for r in rows[2:] if len(r) >= len(rows[1])]  # row 0 names the kernel
    col = {name: i for i, name in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    total = sum(_count(r[col[SAMPLES]]) for r in data) or 1

    print(f"stall samples: {total}")
    by_reason = Counter({s: sum(_count(r[col[s]]) for r in data) for s in reasons})
    for reason, n in by_reason.most_common(12):
        print(f"  {reason:28s} {n:9d} {100 * n / total:5.1f}%")

    print("\ninstructions with the most samples (address tail, share, SASS, top two reasons):")
    for r in sorted(data, key=lambda r: -_count(r[col[SAMPLES]]))[:args.top]:
        top = sorted(((_count(r[col[s]]), s) for s in reasons), reverse=True)[:2]
        print(f"  {r[0][-5:]} {100 * _count(r[col[SAMPLES]]) / total:5.2f}% {r[1].strip()[:60]:60s} {top}")

    mix = Counter()
    for r in data:
        words = r[1].split()
        opcode = words[1] if words[0].startswith("@") else words[0]  # past a predicate
        mix[opcode.split(".")[0]] += _count(r[col[EXECUTED]])
    executed = sum(mix.values()) or 1
    print(f"\nexecuted warp instructions: {executed} ({executed / args.units:.1f} per unit)")
    for opcode, n in mix.most_common(30):
        print(f"  {opcode:12s} {n / args.units:10.1f} per unit {100 * n / executed:5.1f}%")


if __name__ == "__main__":
    main()
