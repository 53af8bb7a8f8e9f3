"""Where a packed call's time goes, beside the dense batch of the same sequences: wall time, the sum of
its kernels' GPU times, the host's time per step, each kernel, and (--host) where the host's time goes.

    python tools/packed_profile.py [--lengths 1024x16] [--full] [--steps 20] [--host]

A packed batch of equal lengths is the dense batch (B = sequences) in another layout, so its
forward+backward should cost what the dense call costs; what it costs beyond that is either kernel
time (the kernels' table) or host time (wall time above the kernels' sum; the cProfile shows where).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import triton
from torch.profiler import ProfilerActivity, profile

import attngen

H, D = 16, 128


def kernels(step, iterations=10):
    """Each kernel's GPU microseconds per step, and their sum."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iterations):
            step()
        torch.cuda.synchronize()
    totals = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name[:60]] += event.device_time / iterations
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def host_us(step, steps):
    """The host's microseconds per step: `steps` steps issued without synchronizing (the launch queue
    holds them all), so the time is the host's alone unless the step itself waits for the GPU."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    return (issued - start) / steps * 1e6


def host_profile(step, steps):
    """The host's hottest Python functions (cProfile, by own time) and torch operators (torch.profiler's
    CPU times, launches included) over `steps` steps."""
    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(20)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return text.getvalue() + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024x16", help="LENxCOUNT, or a comma list of lengths")
    parser.add_argument("--full", action="store_true", help="no mask (default: causal)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--host", action="store_true", help="profile each step's host time too")
    args = parser.parse_args()
    if "x" in args.lengths:
        n, count = (int(x) for x in args.lengths.split("x"))
        lengths = [n] * count
    else:
        lengths = [int(x) for x in args.lengths.split(",")]
    spec = Path(__file__).resolve().parent.parent / "specs" / ("full.attn" if args.full else "causal.attn")
    attn = attngen.build(spec)
    total, longest = sum(lengths), max(lengths)
    # q, k, v as a fused projection gives them, in both layouts.
    fused = torch.randn(total, 3, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q, k, v = fused.unbind(1)
    dout = torch.randn(total, H, D, device="cuda", dtype=torch.bfloat16)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    packed = dict(cu_seqlens_q=offsets, cu_seqlens_k=offsets, max_seqlen_q=longest, max_seqlen_k=longest)

    def packed_step():
        torch.autograd.grad(attn(q, k, v, **packed), [fused], dout)

    def packed_forward():
        with torch.no_grad():
            attn(q, k, v, **packed)

    steps = {"packed fwd": packed_forward, "packed fwd+bwd": packed_step}
    if len(set(lengths)) == 1:
        B, N = len(lengths), lengths[0]
        # The same unbound q, k, v as (B, H, N, D) views, so both steps' autograd outside attngen is the same.
        views = [t.unflatten(0, (B, N)).transpose(1, 2) for t in (q, k, v)]
        dense_dout = dout.unflatten(0, (B, N)).transpose(1, 2)

        def dense_step():
            torch.autograd.grad(attn(*views), [fused], dense_dout)

        def dense_forward():
            with torch.no_grad():
                attn(*views)
        steps |= {"dense fwd": dense_forward, "dense fwd+bwd": dense_step}
    print(f"lengths {lengths[:4]}{'...' if len(lengths) > 4 else ''} ({len(lengths)}), H {H}, D {D}, "
          f"{'full' if args.full else 'causal'}; families {attn.forward_family(q, k, v, **packed)}, "
          f"{attn.backward_family(q, k, v, **packed)}")
    for name, step in steps.items():
        for _ in range(3):
            step()
        ms = triton.testing.do_bench(step, warmup=25, rep=200)
        times = kernels(step)
        print(f"\n== {name}: wall {ms * 1e3:.0f} us, kernels {sum(times.values()):.0f} us, "
              f"host {host_us(step, args.steps):.0f} us")
        for kernel, us in times.items():
            print(f"   {us:8.1f}  {kernel}")
        if args.host:
            print(host_profile(step, args.steps))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
