"""Where a call's host time goes on a GPU machine: each piece's inclusive wall time per call, by timer wrappers
around the runtime's functions and Triton's launcher (no profiler, whose own cost would swamp microseconds).

    python tools/host_split.py SPEC [SPEC ...] [--shape 4,16,4096,64]

For each spec (a .attn file; a random_variants spec as its --json rows hold it, its length params scaled to
N as that script scales them), the wall time per call of back-to-back forward (no_grad) and
forward+backward (torch.autograd.grad) calls, then the same calls with the wrappers on, and each wrapped
function's inclusive microseconds and calls per call. The wrappers add about a microsecond a wrapped call.

With --loops, forward+backward is instead timed in the loops benchmarks use, to tell which of their habits
costs what: back to back with torch.autograd.grad and with .backward() (gradients set to None between calls,
as do_bench's grad_to_none does), triton's do_bench (which also zeroes a 256 MB buffer before each call to
flush L2), and CUDA events around each call with and without that flush; --trace DIR writes a torch.profiler
trace of ten do_bench-style calls of each spec there.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from triton.backends.nvidia import driver as nvidia_driver

import attngen
from attngen import bench, testing
from attngen.families.hopper import runtime as hopper
from attngen.runtime import attention, dispatch, launching, operators

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import random_variants  # noqa: E402

TIMES: dict[str, float] = defaultdict(float)
COUNTS: dict[str, int] = defaultdict(int)

# (owner, function names): what the wrappers time.
WRAPPED = (
    (attention.Attention, ["attn", "_call_plan", "_sink_rows", "_dropout", "_check_learnable", "_builder", "_reduced",
                           "_table_args"]),
    (operators._Attention, ["forward", "backward"]),
    (dispatch.Dispatch, ["_forward_with_tables", "_backward_with_tables"]),
    (launching.LaunchArguments, ["_row_terms", "_input_grads", "_summed_input_grads", "_input_args"]),
    (hopper.HopperFamily, ["prepare", "backward"]),
    (hopper, ["_hopper_descriptor", "_hopper_row_descriptor", "_empty_in_layout"]),
    (nvidia_driver, ["make_tensordesc_arg"]),
    (nvidia_driver.CudaLauncher, ["__call__"]),
    (torch.autograd, ["grad"]),
)


def _wrap(owner, name: str) -> None:
    fn = getattr(owner, name)
    label = f"{getattr(owner, '__name__', owner)}.{name}"

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[label] += time.perf_counter() - start
            COUNTS[label] += 1
    setattr(owner, name, timed)


def wall_us(step, calls: int = 300, rounds: int = 3) -> float:
    """Microseconds per call of `calls` back-to-back calls, the least over `rounds`."""
    for _ in range(30):
        step()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


@dataclass
class Steps:
    """One spec's calls: which families serve it, a forward (no_grad), a forward+backward by torch.autograd.grad,
    and what --loops builds its own loops from (the call, the leaves whose gradients it wants, dO)."""
    families: tuple[str, str]
    forward: Callable[[], None]
    forward_backward: Callable[[], None]
    call: Callable[[], torch.Tensor]
    leaves: list[torch.Tensor]
    dout: torch.Tensor


def _steps(path: str, B: int, H: int, N: int, D: int) -> Steps:
    spec = random_variants.scaled(Path(path).read_text(), N)
    attn = attngen.build(spec)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    inputs = testing.random_inputs(attn.spec, B, H, H, N, N, device="cuda", seed=2)
    leaves = [q, k, v] + [inputs[i.name].requires_grad_() for i in attn.spec.learnable_inputs]

    def forward():
        with torch.no_grad():
            attn(q, k, v, **inputs)

    def forward_backward():
        torch.autograd.grad(attn(q, k, v, **inputs), leaves, dout)
    families = (attn.forward_family(q, k, v, **inputs), attn.backward_family(q, k, v, **inputs))
    return Steps(families, forward, forward_backward, lambda: attn(q, k, v, **inputs), leaves, dout)


def event_us(step, before, flush: torch.Tensor | None, calls: int = 200) -> float:
    """The median over `calls` calls of step's time between CUDA events recorded around it, `before` run
    first (untimed) and, where `flush` is given (a 256 MB buffer), it zeroed before each call as do_bench does."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    for _ in range(20):
        before()
        step()
    torch.cuda.synchronize()
    for start, end in zip(starts, ends):
        before()
        if flush is not None:
            flush.zero_()
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))
    return times[len(times) // 2]


def loops(path: str, steps: Steps, trace: str | None) -> None:
    """Forward+backward of one spec in each benchmark loop (--loops)."""
    import triton

    forward_backward, cache = steps.forward_backward, torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")

    def backward_step():
        steps.call().backward(steps.dout)

    def before():
        bench._clear_grads(steps.leaves)

    def backward_b2b():
        before()
        backward_step()

    results = {
        "back to back, autograd.grad": wall_us(forward_backward),
        "back to back, .backward()": wall_us(backward_b2b),
        "do_bench, .backward()": 1e3 * triton.testing.do_bench(backward_step, warmup=25, rep=100,
                                                               grad_to_none=steps.leaves, return_mode="median"),
        "events, L2 flushed, .backward()": event_us(backward_step, before, flush=cache),
        "events, no flush, .backward()": event_us(backward_step, before, flush=None),
        "events, L2 flushed, autograd.grad": event_us(forward_backward, lambda: None, flush=cache),
        "events, no flush, autograd.grad": event_us(forward_backward, lambda: None, flush=None),
    }
    for name, us in results.items():
        print(f"  {us:8.1f} us  {name}", flush=True)
    if trace:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as profiler:
            for _ in range(10):
                before()
                cache.zero_()
                backward_step()
            torch.cuda.synchronize()
        Path(trace).mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(Path(trace) / f"{Path(path).stem}.json"))
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="+")
    parser.add_argument("--shape", default="4,16,4096,64", help="B,H,N,D")
    parser.add_argument("--loops", action="store_true", help="time forward+backward in each benchmark loop")
    parser.add_argument("--trace", help="with --loops: a folder for torch.profiler traces")
    args = parser.parse_args()
    B, H, N, D = (int(x) for x in args.shape.split(","))
    steps = {path: _steps(path, B, H, N, D) for path in args.specs}
    if args.loops:
        for path, spec_steps in steps.items():
            print(f"{path} {spec_steps.families}: forward+backward", flush=True)
            loops(path, spec_steps, args.trace)
        return
    for path, spec_steps in steps.items():
        print(f"{path} {spec_steps.families}: forward {wall_us(spec_steps.forward):.1f} us, forward+backward "
              f"{wall_us(spec_steps.forward_backward):.1f} us a call, back to back", flush=True)
    for owner, names in WRAPPED:
        for name in names:
            if hasattr(owner, name):
                _wrap(owner, name)
    for path, spec_steps in steps.items():
        for part, step in (("forward", spec_steps.forward), ("forward+backward", spec_steps.forward_backward)):
            TIMES.clear()
            COUNTS.clear()
            wall = wall_us(step)
            calls = 30 + 3 * 300
            print(f"\n{path} {part}: {wall:.1f} us a call with the wrappers; inclusive us and calls per call:")
            for label in sorted(TIMES, key=lambda label: -TIMES[label]):
                print(f"  {TIMES[label] / calls * 1e6:8.1f}  x{COUNTS[label] / calls:4.1f}  {label}")


if __name__ == "__main__":
    main()
