"""Fuzzes drawn specs and cases on the GPU (bf16 included), printing each result as it comes, so a
run cut short by a time limit still reports what it checked.

    python tools/fuzz_device.py [--examples 40] [--dtype bf16 --dtype f16] [--seed 3] [--cache contiguous ...]
                                [--hopper]

--dtype fp8 draws FP8 calls (float8_e4m3fn q, k, v with descale factors: a dense forward), each checked within
its bound (attngen.testing.tolerances.fp8_bound). --hopper draws shapes the Hopper family takes (head dims 64-256
in steps of 8, lengths 65 to 700) and counts the cases by the forward family that ran them.

Without --seed the draw is derandomized (the same cases each run); shards with different seeds
draw different cases, so several processes can share a GPU (compiling dominates).
"""

from __future__ import annotations

import argparse
import sys
import time

from hypothesis import HealthCheck, Phase, given, seed, settings

import attngen
from attngen.testing import strategies
from attngen.api import parse_spec
from attngen.errors import IndexOutOfRange


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--examples", type=int, default=40)
    parser.add_argument("--dtype", action="append", default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--cache", action="append", default=None, choices=strategies.CACHES,
                        help="calls to draw (default: training calls only)")
    parser.add_argument("--hopper", action="store_true", help="draw shapes the Hopper family takes")
    args = parser.parse_args()
    dtypes = tuple(args.dtype or ["bf16", "f16", "f32"])
    caches = tuple(args.cache or ["none"])
    counts = {"ok": 0, "failed": 0, "skipped": 0}
    families: dict[str, int] = {}
    # --hopper: lengths past one decode tile (a call of at most 64 query rows per key/value head goes to
    # the decode family first) and the head dims the Hopper family takes.
    shapes = (dict(min_len=65, max_len=700, head_dims=range(64, 257, 8),
                   near_tiles=[n + d for n in (128, 256, 384, 512) for d in (-1, 0, 1)]) if args.hopper
              else dict(max_len=300, max_head_dim=128))

    @settings(max_examples=args.examples, derandomize=args.seed is None, deadline=None, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.generate])
    @given(text=strategies.spec_texts(),
           case=strategies.cases(dtypes=dtypes, caches=caches, **shapes))
    def run(text, case):
        t0 = time.time()
        spec = parse_spec(text)
        try:
            attn = attngen.build(spec)
            family = ""
            if case.cache == "none":
                q, k, v, inputs = strategies.case_data(spec, case, device="cuda")
                family = f"fwd {attn.forward_family(q, k, v, **inputs)}"
                if case.dtype != strategies.FP8:  # an FP8 call has no backward (backward_family refuses it)
                    family += f" bwd {attn.backward_family(q, k, v, **inputs)}"
                families[family] = families.get(family, 0) + 1
            strategies.check_case(spec, attn, case, device="cuda")
            counts["ok"] += 1
            print(f"ok   {case}  {family} ({time.time() - t0:.1f} s)", flush=True)
        except IndexOutOfRange as e:  # sizes outside what the spec defines (fuzz.fuzz_spec skips them too)
            counts["skipped"] += 1
            print(f"skip {case}: {e}", flush=True)
        except Exception as e:  # report and go on: one run, many cases
            counts["failed"] += 1
            print(f"FAIL {case}\n{text}{type(e).__name__}: {str(e)[:400]}", flush=True)

    (run if args.seed is None else seed(args.seed)(run))()
    print(f"{counts['ok']} ok, {counts['failed']} failed, {counts['skipped']} skipped; families of the "
          f"training calls: {families}", flush=True)
    sys.exit(1 if counts["failed"] else 0)


if __name__ == "__main__":
    main()
