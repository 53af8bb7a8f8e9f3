"""The host's time per call, on a machine without a GPU: the runtime's Python and torch work of a call with
every kernel launch stubbed out, so what is left is what a GPU call pays on the host besides the launches.

    python tools/host_cost.py [--spec gpt_oss_sinks ...] [--shape B,H,N,D] [--calls 200] [--backward] [--profile [cumtime]]

Each spec (a name in specs/, causal_sink, or a path) is timed beside the same spec without its feature where
PAIRS has one (gpt_oss_sinks against its mask without the sink, causal_sink against causal): the least over
15 rounds of `--calls` calls each, the two taking turns, in microseconds per call; --backward times forward+backward with a learnable input; --profile
prints cProfile's hottest functions (by own time). The tensors are small CPU tensors, so torch's own work on
them (the host side of a sink's rows, say) costs about what its launches cost on a GPU's host.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

import torch

import attngen
from attngen import testing
from attngen.families.decode import runtime as decode
from attngen.families.hopper import runtime as hopper
from attngen.families.portable import runtime as portable
from attngen.runtime import launching, tables

ROOT = Path(__file__).resolve().parent.parent
PAIRS = {
    "gpt_oss_sinks": "attention gpt_oss_no_sink\nparam window = 128\nmask: causal and q - k < window\n",
    "causal_sink": "specs/causal.attn",
}
SPECS = {"causal_sink": "attention causal_sink\ninput sinks: f32[H] learnable\nmask: causal\nsink: sinks[h]\n"}


def _stub_launches():
    """Every kernel launch of the runtime returns at once (the outputs stay torch.empty's)."""
    for module in (portable, launching, hopper, decode, tables):
        module._launch = lambda *args, **kwargs: None


def _spec(name: str):
    if name in SPECS:
        return SPECS[name]
    path = ROOT / "specs" / f"{name}.attn"
    return path if path.exists() else name


def _call(spec, shape, backward):
    B, H, N, D = shape
    attn = attngen.build(_spec(spec))
    q, k, v = testing.random_qkv(B, H, H, N, N, D, D, torch.bfloat16)
    inputs = testing.random_inputs(attn.spec, B, H, H, N, N)
    if not backward:
        def step():
            with torch.no_grad():
                attn(q, k, v, **inputs)
        return step
    leaves = [t.requires_grad_() for t in (q, k, v)]
    leaves += [inputs[i.name].requires_grad_() for i in attn.spec.learnable_inputs]
    dout = torch.zeros(B, H, N, D, dtype=torch.bfloat16)

    def step():
        torch.autograd.grad(attn(q, k, v, **inputs), leaves, dout)
    return step


def _us(steps, calls, rounds=15):
    """Each step's microseconds per call: the least over `rounds` rounds of `calls` calls, the steps taking
    turns within each round (the machine's other work only ever adds time, so the least is the call's own)."""
    for step in steps:
        for _ in range(50):
            step()
    best = [float("inf")] * len(steps)
    for _ in range(rounds):
        for n, step in enumerate(steps):
            start = time.perf_counter()
            for _ in range(calls):
                step()
            best[n] = min(best[n], (time.perf_counter() - start) / calls * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", nargs="*", default=["gpt_oss_sinks", "causal_sink"])
    parser.add_argument("--shape", default="2,16,256,128", help="B,H,N,D")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--profile", nargs="?", const="tottime", choices=["tottime", "cumtime"],
                        help="print cProfile's hottest functions, by own (default) or cumulative time")
    args = parser.parse_args()
    shape = tuple(int(x) for x in args.shape.split(","))
    _stub_launches()
    torch.set_num_threads(1)
    for name in args.spec:
        steps = {name: _call(name, shape, args.backward)}
        if name in PAIRS:
            steps["without"] = _call(PAIRS[name], shape, args.backward)
        times = dict(zip(steps, _us(list(steps.values()), args.calls)))
        part = "forward+backward" if args.backward else "forward"
        print(f"{name} {part} B,H,N,D={args.shape}: " + ", ".join(f"{k} {v:.1f} us" for k, v in times.items()))
        if args.profile:
            step = _call(name, shape, args.backward)
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(args.calls):
                step()
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats(args.profile).print_stats(25)
            print(text.getvalue())


if __name__ == "__main__":
    main()
