"""Sweeps tile configurations of one kernel of one spec on the GPU and times forward+backward, to
calibrate the planner's starting points (plan.py) against measurements rather than folklore.

    python benchmarks/tune_tiles.py sliding_window --kernel dkdv [--n 8192] [-D window=1024]
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gpu_check import bench, spec_path  # noqa: E402
from sparsity_bench import variants  # noqa: E402

import attngen  # noqa: E402
from attngen import testing  # noqa: E402

KERNELS = {"fwd": 0, "dkdv": 1, "dq": 2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("spec")
    parser.add_argument("--kernel", choices=list(KERNELS), default="dkdv")
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--bm", type=int, nargs="*", default=[32, 64, 128])
    parser.add_argument("--bn", type=int, nargs="*", default=[64, 128])
    parser.add_argument("--warps", type=int, nargs="*", default=[4, 8])
    parser.add_argument("--stages", type=int, nargs="*", default=[2, 3])
    args = parser.parse_args()
    B, H, N, D = 2, 16, args.n, 128
    path, params, _, inputs = variants(B, H, N, "cuda").get(args.spec, (spec_path(args.spec), {}, None, {}))
    attn = attngen.build(path, params=params)
    q, k, v = testing.random_qkv(B, H, H, N, N, D, D, torch.bfloat16, device="cuda", seed=2)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    do = torch.randn_like(q)
    key = (128, 128, "bf16")
    planned = list(attn.module.PLAN[key])
    index = KERNELS[args.kernel]
    print(f"{args.spec} {args.kernel}: planned {planned[index]}", flush=True)
    for bm, bn, warps, stages in itertools.product(args.bm, args.bn, args.warps, args.stages):
        tiles = list(planned)
        tiles[index] = (bm, bn, warps, stages)
        attn.module.PLAN[key] = tuple(tiles)
        try:
            fn = (lambda: attn(q, k, v, **inputs)) if args.kernel == "fwd" else \
                (lambda: attn(q, k, v, **inputs).backward(do))
            fn()
            with torch.no_grad() if args.kernel == "fwd" else torch.enable_grad():
                ms = bench(fn, grad_to_none=None if args.kernel == "fwd" else [q, k, v])
            print(f"  {bm:>4} {bn:>4} {warps}w {stages}s  {ms:.3f} ms"
                  + ("   <- planned" if (bm, bn, warps, stages) == tuple(planned[index]) else ""), flush=True)
        except Exception as e:  # out of shared memory or registers: skip
            print(f"  {bm:>4} {bn:>4} {warps}w {stages}s  -- {type(e).__name__}: {str(e)[:80]}", flush=True)
        torch.cuda.empty_cache()
    attn.module.PLAN[key] = tuple(planned)


if __name__ == "__main__":
    main()
