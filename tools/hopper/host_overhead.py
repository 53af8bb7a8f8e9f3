"""Measures the host time of one Hopper-family forward call (the Python from attn() to the launch), against
its GPU time, and profiles where the host time goes.

    python tools/hopper/host_overhead.py [--out FILE]

A small causal problem (B=2, H=16, N=512, D=128, bf16) whose kernel takes a few microseconds: calls are
issued back to back without synchronizing, so wall time per call is the host's cost when it exceeds the GPU's.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch

import attngen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    args = parser.parse_args()
    result = {}
    for name, target in (("hopper", None), ("portable", "a100")):
        attn = attngen.build("attention causal\nmask: causal\n", target=target) if target else \
            attngen.build("attention causal\nmask: causal\n")
        q, k, v = (torch.randn(2, 16, 512, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        with torch.no_grad():
            for _ in range(20):
                attn(q, k, v)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(500):
                attn(q, k, v)
            torch.cuda.synchronize()
            wall_us = (time.perf_counter() - t0) / 500 * 1e6
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            graph_input = attn(q, k, v)
            del graph_input
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(200):
                attn(q, k, v)
            profile.disable()
            torch.cuda.synchronize()
            start.record()
            for _ in range(50):
                attn(q, k, v)
            end.record()
            torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(25)
        result[name] = {"family": attn.forward_family(q, k, v), "wall_us_per_call": wall_us,
                        "events_us_per_call": start.elapsed_time(end) / 50 * 1e3, "profile": text.getvalue()}
        print(name, result[name]["family"], f"{wall_us:.1f} us/call wall", flush=True)
        print(text.getvalue()[:6000], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
