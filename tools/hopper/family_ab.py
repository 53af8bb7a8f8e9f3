"""Times the Hopper family against the portable kernels on the same specs, forward and forward+backward, to
see where the family's rule should send a spec: do_bench medians and GPU-only times (attngen.bench.kernel_ms).

    python tools/hopper/family_ab.py [SPEC.attn ...] [--random 15 36 44] [--shape 4,16,4096,64] [--flex]
                                     [--forward-only] [--warm 12] [--json FILE]

--random takes indices of benchmarks/random_variants.py's default list (50 specs, seed 0), scaled to the
shape's N as that script scales them. The portable kernels are the a100 target's build run on this GPU (its
plan's tiles, not tuned for Hopper). --flex times FlexAttention too (its BlockMask built outside the timed
region). --warm N first runs every spec once in N worker processes, so the kernels compile in parallel and the
timed pass finds them in the on-disk caches.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

import attngen
from attngen import bench, testing

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import random_variants  # noqa: E402


def _specs(args, n: int) -> list[tuple[str, object]]:
    specs = [(path, Path(path).read_text()) for path in args.specs]
    if args.random:
        texts = random_variants.draw_specs(50, 0)
        specs += [(f"random {i}", random_variants.scaled(texts[i], n)) for i in args.random]
    return specs


def _times(call, leaves, dout, backward: bool = True) -> dict:
    """Forward (no_grad) and forward+backward medians in ms, do_bench's and the GPU's own."""
    def forward_backward():
        call().backward(dout)

    with torch.no_grad():
        fwd = triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")
        fwd_gpu = bench.kernel_ms(call)
    if not backward:
        return {"fwd": fwd, "fwd_gpu": fwd_gpu}
    fwdbwd = triton.testing.do_bench(forward_backward, warmup=25, rep=100, grad_to_none=leaves, return_mode="median")
    fwdbwd_gpu = bench.kernel_ms(forward_backward, lambda: bench._clear_grads(leaves))
    return {"fwd": fwd, "fwd_gpu": fwd_gpu, "fwdbwd": fwdbwd, "fwdbwd_gpu": fwdbwd_gpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="*")
    parser.add_argument("--random", type=int, nargs="*", default=[])
    parser.add_argument("--shape", default="4,16,4096,64", help="B,H,N,D")
    parser.add_argument("--flex", action="store_true")
    parser.add_argument("--forward-only", action="store_true")
    parser.add_argument("--warm", type=int, default=0)
    parser.add_argument("--json")
    args = parser.parse_args()
    jobs = [(args, name, spec) for name, spec in _specs(args, int(args.shape.split(",")[2]))]
    if args.warm:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        with ProcessPoolExecutor(max_workers=args.warm, mp_context=context) as pool:
            list(pool.map(_measure, jobs))
    rows = [_measure(job, quiet=False) for job in jobs]
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                               "triton": triton.__version__, "shape": args.shape,
                                               "rows": rows}, indent=1))


def _measure(job, quiet: bool = True) -> dict:
    """The row of one spec (job: the arguments, its name and its text or Spec); a --warm worker's (quiet) only
    compiles, by one untimed call of each."""
    args, name, spec = job
    B, H, N, D = (int(x) for x in args.shape.split(","))
    hopper, portable = attngen.build(spec), attngen.build(spec, target="a100")
    q, k, v = testing.random_qkv(B, H, H, N, N, D, D, torch.bfloat16, device="cuda", seed=2)
    inputs = testing.random_inputs(hopper.spec, B, H, H, N, N, device="cuda", seed=2)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    leaves += [inputs[i.name].requires_grad_() for i in hopper.spec.learnable_inputs]
    dout = torch.randn_like(q)
    row = {"spec": name, "families": [hopper.forward_family(q, k, v, **inputs),
                                      hopper.backward_family(q, k, v, **inputs),
                                      portable.forward_family(q, k, v, **inputs)]}
    calls = {"hopper": lambda: hopper(q, k, v, **inputs), "portable": lambda: portable(q, k, v, **inputs)}
    if args.flex:
        from torch.nn.attention.flex_attention import flex_attention

        variant = attngen.to_flex(hopper.spec)
        torch._dynamo.reset()  # a fresh compile a spec: past dynamo's recompile limit Flex runs eagerly
        flex = torch.compile(flex_attention, dynamic=False)
        calls["flex"] = bench.flex_call(variant, q, k, v, inputs, block_mask=variant.block_mask(q, k, **inputs),
                                        flex_kernel=flex)
    for label, call in calls.items():
        if quiet:  # a --warm worker: compile only
            with torch.no_grad():
                call()
            if not args.forward_only:
                call().backward(dout)
            continue
        row[label] = _times(call, leaves, dout, backward=not args.forward_only)
    if not quiet:
        print(json.dumps(row), flush=True)
    return row


if __name__ == "__main__":
    main()
