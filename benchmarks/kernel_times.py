"""Where a call's GPU time goes: each kernel's GPU microseconds per call, under torch.profiler, for the
Hopper family, the portable one and FlexAttention (compiled), forward or forward+backward.

    python benchmarks/kernel_times.py --spec specs/chunked_causal.attn --shape 2,16,8192,128 [--backward]

The call's total is the sum of its kernels' times (gaps between kernels are not counted), so a
short call's host time shows as the difference to tools/hopper/host_overhead.py's wall time.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import flex_attention

import attngen
from attngen import bench

# The catalog's inputs as tools/hopper/host_overhead.py gives them, so the two tools time the same calls.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools" / "hopper"))
from host_overhead import inputs_for  # noqa: E402

ITERATIONS = 20


def kernel_times(call) -> dict[str, float]:
    """Each kernel's GPU microseconds per call (by name, cut to 70 characters), over ITERATIONS profiled calls
    after a warm-up (attngen.bench.kernel_times), the costliest first."""
    totals: dict[str, float] = defaultdict(float)
    for name, us in bench.kernel_times(call, calls=ITERATIONS, warmup=5).items():
        totals[name[:70]] += us
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="a .attn file")
    parser.add_argument("--shape", default="2,16,8192,128", help="B,H,N,D")
    parser.add_argument("--backward", action="store_true", help="forward+backward calls")
    parser.add_argument("--only", default="hopper,portable,flex", help="which of hopper, portable, flex")
    args = parser.parse_args()
    only = args.only.split(",")
    B, H, N, D = (int(x) for x in args.shape.split(","))
    text = Path(args.spec).read_text()
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=args.backward)
               for _ in range(3))
    do = torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16)
    calls = {}
    for name, target in (("hopper", None), ("portable", "a100")):
        if name in only:
            attn = attngen.build(text, target=target) if target else attngen.build(text)
            inputs = inputs_for(attn, B, H, N)
            calls[name] = (lambda attn=attn, inputs=inputs: attn(q, k, v, **inputs))
    if "flex" in only:
        flex = torch.compile(flex_attention)
        flex_kwargs = attngen.to_flex(text).kwargs(q, k, **inputs_for(attngen.build(text), B, H, N))
        calls["flex"] = lambda: flex(q, k, v, **flex_kwargs)
    print(f"# {Path(args.spec).stem} B{B} H{H} N{N} D{D} bf16, {'forward+backward' if args.backward else 'forward'}")
    for name, forward in calls.items():

        def call(forward=forward):
            if args.backward:
                forward().backward(do)
            else:
                with torch.no_grad():
                    forward()
        try:
            times = kernel_times(call)
        except Exception as error:  # report it and go on with the others
            print(f"{name}: failed: {type(error).__name__}: {str(error)[:200]}")
            continue
        print(f"{name}: {sum(times.values()):.1f} us of kernels per call")
        for kernel, us in times.items():
            print(f"  {us:9.1f}  {kernel}")


if __name__ == "__main__":
    main()
