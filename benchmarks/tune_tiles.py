"""Times tile configurations of the forward or backward kernels of several specs on the GPU, to
calibrate the planner's starting points (plan/planner.py) against measurements rather than folklore.

    python benchmarks/tune_tiles.py --kernel bwd --specs sliding_window chunked_causal \
        --configs one:64x128w8s3,128x64w8s3 two:32x64w4s3,128x64w8s3 [--jobs 12] [--n 8192]

A forward config is BLOCK_MxBLOCK_NwWARPSsSTAGES; a backward one is `one:` (dK/dV and dQ in one
launch) or `two:` (two launches on two streams) followed by the dK/dV tiles and the dQ tiles.
`full` and `causal` are the catalog specs; the masked names are sparsity_bench's variants.
With --jobs, every (spec, config) is first compiled in parallel worker processes (Triton's disk
cache keeps the binaries), so the timing process, which runs alone on the GPU, compiles nothing.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import subprocess
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gpu_check import bench, spec_path  # noqa: E402
from sparsity_bench import variants  # noqa: E402

import attngen  # noqa: E402
from attngen import testing  # noqa: E402

TILES = re.compile(r"(\d+)x(\d+)w(\d+)s(\d+)")


def parse_config(text: str, kernel: str):
    """(one_launch or None, {plan index: tiles}) from a config's text."""
    if kernel == "fwd":
        return None, {0: _tiles(text)}
    launch, _, tiles = text.partition(":")
    if launch not in ("one", "two") or tiles.count(",") != 1:
        raise SystemExit(f"a backward config is one:DKDV,DQ or two:DKDV,DQ, got {text!r}")
    dkdv, dq = tiles.split(",")
    return launch == "one", {1: _tiles(dkdv), 2: _tiles(dq)}


def _tiles(text: str) -> tuple[int, int, int, int]:
    match = TILES.fullmatch(text)
    if match is None:
        raise SystemExit(f"tiles are BLOCK_MxBLOCK_NwWARPSsSTAGES (like 128x64w8s3), got {text!r}")
    return tuple(int(g) for g in match.groups())


def setup(name: str, n: int):
    B, H, D = 2, 16, 128
    path, params, _, inputs = variants(B, H, n, "cuda").get(name, (spec_path(name), {}, None, {}))
    attn = attngen.build(path, params=params)
    q, k, v = testing.random_qkv(B, H, H, n, n, D, D, torch.bfloat16, device="cuda", seed=2)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    return attn, q, k, v, inputs, torch.randn_like(q)


def apply(attn, config):
    one_launch, tiles = config
    key = (128, 128, "bf16")
    planned = list(attn.module.FACTS.plan[key])
    for index, t in tiles.items():
        planned[index] = t
    attn.module.FACTS.plan[key] = tuple(planned)
    if one_launch is not None:
        attn.module.FACTS.one_launch_backward = one_launch


def measure(attn, q, k, v, inputs, do, kernel: str, time_it: bool = True) -> float:
    if kernel == "fwd":
        fn = lambda: attn(q, k, v, **inputs)  # noqa: E731
        with torch.no_grad():
            fn()
            return bench(fn) if time_it else 0.0
    fn = lambda: attn(q, k, v, **inputs).backward(do)  # noqa: E731
    fn()
    return bench(fn, grad_to_none=[q, k, v]) if time_it else 0.0


def compile_one(spec: str, config: str, kernel: str, n: int) -> str:
    """Runs one (spec, config) once in a worker process, so its kernels land in Triton's cache."""
    cmd = [sys.executable, __file__, "--compile-only", "--kernel", kernel, "--n", str(n),
           "--specs", spec, "--configs", config]
    done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    return "" if done.returncode == 0 else f"{spec} {config}: {done.stderr.strip().splitlines()[-1:]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", choices=["fwd", "bwd"], default="bwd")
    parser.add_argument("--specs", nargs="+", required=True)
    parser.add_argument("--configs", nargs="+", required=True)
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--jobs", type=int, default=0, help="compile in this many worker processes first")
    parser.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help="write the timings here as JSON")
    args = parser.parse_args()
    configs = {c: parse_config(c, args.kernel) for c in args.configs}
    if args.jobs:
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            jobs = [pool.submit(compile_one, s, c, args.kernel, args.n) for s in args.specs for c in configs]
            for failure in filter(None, (j.result() for j in jobs)):
                print(f"compile failed: {failure}", flush=True)
    rows = []
    for spec in args.specs:
        attn, q, k, v, inputs, do = setup(spec, args.n)
        for text, config in configs.items():
            apply(attn, config)
            try:
                ms = measure(attn, q, k, v, inputs, do, args.kernel, time_it=not args.compile_only)
            except Exception as e:  # out of shared memory or registers: report and go on
                print(f"{spec:<16} {text:<32} -- {type(e).__name__}: {str(e)[:100]}", flush=True)
                continue
            if args.compile_only:
                continue
            rows.append(dict(spec=spec, config=text, kernel=args.kernel, n=args.n, ms=round(ms, 4)))
            print(f"{spec:<16} {text:<32} {ms:.3f} ms", flush=True)
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
