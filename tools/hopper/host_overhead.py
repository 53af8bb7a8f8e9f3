"""Measures the host time of attngen calls (the Python from attn() to the launches) against their GPU
time, and profiles where the host time goes, for the Hopper family and the portable one.

    python tools/hopper/host_overhead.py [--spec FILE] [--shape B,H,N,D] [--backward] [--out FILE]

Calls are issued back to back without synchronizing, so wall time per call is the host's cost when
it exceeds the GPU's; the GPU's own time is a CUDA graph's replay of the same call. The default, a
small causal problem (B=2, H=16, N=512, D=128, bf16), takes the GPU a few microseconds.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path

import torch

import attngen
from attngen import testing

CAUSAL = "attention causal\nmask: causal\n"


def inputs_for(attn, B: int, H: int, N: int) -> dict:
    """Values for a spec's inputs at (B, H, N), as attngen.testing.random_inputs gives them, but the catalog's
    `doc`: ids of 512-token documents. Learnable inputs require grad, so a backward computes their gradients."""
    inputs = testing.random_inputs(attn.spec, B, H, H, N, N, device="cuda")
    if "doc" in inputs:
        inputs["doc"] = torch.arange(N, device="cuda", dtype=torch.int32) // 512
    for decl in attn.spec.learnable_inputs:
        inputs[decl.name].requires_grad_()
    return inputs


def graph_time_us(call) -> str:
    """The GPU's time for one call: the replay of a CUDA graph of it, or why it could not be captured."""
    try:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            call()
            with torch.cuda.graph(graph, stream=stream):
                call()
        torch.cuda.synchronize()
    except Exception as error:  # a call that synchronizes cannot be captured: report it, time the rest
        return f"n/a ({type(error).__name__}: {str(error)[:80]})"
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return f"{start.elapsed_time(end) / 50 * 1e3:.1f}"


def torch_profile(call, calls=100) -> str:
    """torch.profiler's CPU-side events of `calls` calls (the CUDA runtime and driver calls among them), by
    self time: what a call's host time is spent on below Python."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", help="a .attn file (default: causal)")
    parser.add_argument("--shape", default="2,16,512,128", help="B,H,N,D")
    parser.add_argument("--backward", action="store_true", help="time forward+backward calls")
    parser.add_argument("--out")
    parser.add_argument("--only", default="hopper,portable", help="which of hopper, portable")
    parser.add_argument("--sort", default="tottime", choices=["tottime", "cumtime"], help="cProfile's order")
    parser.add_argument("--torch-profile", action="store_true",
                        help="also print torch.profiler's CPU-side events by self time (CUDA API calls, allocations)")
    args = parser.parse_args()
    B, H, N, D = (int(x) for x in args.shape.split(","))
    text = Path(args.spec).read_text() if args.spec else CAUSAL
    result = {}
    for name, target in (("hopper", None), ("portable", "a100")):
        if name not in args.only.split(","):
            continue
        attn = attngen.build(text, target=target) if target else attngen.build(text)
        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=args.backward)
                   for _ in range(3))
        inputs = inputs_for(attn, B, H, N)

        def call():
            if args.backward:
                attn(q, k, v, **inputs).backward(do)
            else:
                with torch.no_grad():
                    attn(q, k, v, **inputs)

        do = torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16)
        for _ in range(20):
            call()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(300):
            call()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t0) / 300 * 1e6
        graph_us = graph_time_us(call)
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(200):
            call()
        profile.disable()
        torch.cuda.synchronize()
        report = io.StringIO()
        pstats.Stats(profile, stream=report).sort_stats(args.sort).print_stats(30)
        family = (attn.forward_family(q, k, v, **inputs), attn.backward_family(q, k, v, **inputs))
        result[name] = {"family": family, "wall_us_per_call": wall_us,
                        "graph_us_per_call": graph_us, "profile": report.getvalue()}
        print(name, family, f"{wall_us:.1f} us/call wall, {graph_us} us/call GPU "
              f"(CUDA graph)", flush=True)
        print(report.getvalue()[:5000], flush=True)
        if args.torch_profile:
            print(torch_profile(call), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
