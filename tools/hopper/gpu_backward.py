"""Checks and times the Gluon backward prototype (gluon_backward.py) on a Hopper GPU, in one run.

    python tools/hopper/gpu_backward.py [--out FILE] [--timeout 120] [--workers 8] [--skip-check] [--skip-time]

Check: for bf16/fp16 x D 64/128 x causal or not x awkward shapes (N = 1, 129, 1000 with GQA 8/2), the
prototype's dq, dk, dv against float64 autograd of the same attention, each within 8 eps of the input
dtype times the largest reference entry (the CPU model's bound, compile_backward.py); both dQ paths
(atomics, TMA reduce-add). Each configuration runs in a child process under --timeout, since a wrong
barrier phase hangs the GPU rather than failing.

Time: B4 H16 N4096 D128 (causal and not) and B4 H16 N8192 D64 causal: the prototype's backward against
the backward of SDPA's cuDNN and flash backends and of attngen's portable family (each a forward+backward
minus its forward, do_bench medians), in ms and TFLOP/s (FlashAttention's count: 2.5x the forward's).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
DTYPES = ("bf16", "fp16")
SHAPES = ((1, 2, 2, 1), (1, 4, 4, 129), (2, 8, 2, 1000))  # B, H, HKV, N
EPS = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}
TOLERANCE_EPS = 8


def check_one(dtype: str, head_dim: int, causal: bool, tma: bool, shape) -> dict:
    """In a child process: one configuration against float64 autograd; the worst error in eps."""
    import torch

    sys.path.insert(0, str(HERE))
    import gluon_backward

    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float16
    B, H, HKV, N = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, H, N, head_dim, device="cuda", generator=g).to(torch_dtype)
    k = torch.randn(B, HKV, N, head_dim, device="cuda", generator=g).to(torch_dtype)
    v = torch.randn(B, HKV, N, head_dim, device="cuda", generator=g).to(torch_dtype)
    dout = torch.randn(B, H, N, head_dim, device="cuda", generator=g).to(torch_dtype)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    groups = H // HKV
    scores = (q64 @ k64.repeat_interleave(groups, 1).transpose(-1, -2)) / math.sqrt(head_dim)
    if causal:
        scores = scores.masked_fill(torch.ones(N, N, device="cuda", dtype=torch.bool).triu(1), float("-inf"))
    lse64 = torch.logsumexp(scores, -1)
    out64 = torch.softmax(scores, -1) @ v64.repeat_interleave(groups, 1)
    out64.backward(dout.double())
    dq, dk, dv = gluon_backward.backward(q, k, v, out64.detach().to(torch_dtype), dout, lse64.detach().float(),
                                         causal=causal, dq_tma_reduce=tma)
    torch.cuda.synchronize()
    result = {}
    for name, got, want in (("dq", dq, q64.grad), ("dk", dk, k64.grad), ("dv", dv, v64.grad)):
        if got.isnan().any():
            result[name] = float("nan")
            continue
        scale = want.abs().max().item() or 1.0
        result[name] = (got.double() - want).abs().max().item() / scale / EPS[dtype]
    return result


def time_all() -> list[dict]:
    """The timing rows (in this process: timings do not hang once the checks passed)."""
    import torch
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    import attngen

    sys.path.insert(0, str(HERE))
    import gluon_backward

    rows = []
    for B, H, N, D, causal in ((4, 16, 4096, 128, False), (4, 16, 4096, 128, True), (4, 16, 8192, 64, True)):
        q, k, v, dout = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        leaves = [q, k, v]
        for t in leaves:
            t.requires_grad_()
        flops = 2.5 * 4 * B * H * N * N * D / (2 if causal else 1)
        row = {"B": B, "H": H, "N": N, "D": D, "causal": causal}

        def bench(fn, grad_to_none=None):
            return triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median")

        def backward_ms(forward):
            def both():
                forward().backward(dout)
            with torch.no_grad():
                fwd = bench(forward)
            return bench(both, grad_to_none=leaves) - fwd

        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            def sdpa(backend=backend):
                with sdpa_kernel(backend):
                    return scaled_dot_product_attention(q, k, v, is_causal=causal)
            row[name] = backward_ms(sdpa)
        portable = attngen.build("attention c\nmask: causal\n" if causal else "attention f\n", target="a100")
        row["attngen portable"] = backward_ms(lambda: portable(q, k, v))
        with torch.no_grad():
            out, lse = portable(q, k, v, return_lse=True)
        for tma in (False, True):
            row[f"gluon{' tma' if tma else ''}"] = bench(
                lambda tma=tma: gluon_backward.backward(q.detach(), k.detach(), v.detach(), out, dout, lse,
                                                        causal=causal, dq_tma_reduce=tma))
        row["tflops"] = {name: flops / ms / 1e9 for name, ms in row.items() if isinstance(ms, float)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--timeout", type=int, default=120)
    parser.add_argument("--workers", type=int, default=8, help="child processes at once")
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--skip-time", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(check_one(*json.loads(args.child))))
        return
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    checks, failed = [], 0
    if not args.skip_check:
        configs = [[dtype, head_dim, causal, tma, list(shape)] for dtype in DTYPES for head_dim in (64, 128)
                   for causal in (False, True) for tma in (False, True) for shape in SHAPES]

        def check(config):
            try:
                run = subprocess.run([sys.executable, __file__, "--child", json.dumps(config)], capture_output=True,
                                     text=True, env=env, timeout=args.timeout)
                return (json.loads(run.stdout.strip().splitlines()[-1]) if run.returncode == 0
                        else {"error": run.stderr[-600:]})
            except subprocess.TimeoutExpired:
                return {"error": f"timed out after {args.timeout} s (a hang?)"}

        # Children side by side: compiling dominates, and the GPU takes several small checks at once.
        with ThreadPoolExecutor(max_workers=args.workers) as pool:
            for config, errors in zip(configs, pool.map(check, configs)):
                ok = "error" not in errors and all(e <= TOLERANCE_EPS for e in errors.values())
                failed += not ok
                checks.append({"config": config, "errors_eps": errors, "ok": ok})
                print(("ok  " if ok else "FAIL"), config, errors, flush=True)
        print(f"{len(checks) - failed} of {len(checks)} configurations within {TOLERANCE_EPS} eps", flush=True)
    rows = [] if args.skip_time or failed else time_all()
    if args.out:
        Path(args.out).write_text(json.dumps({"checks": checks, "timings": rows}, indent=1))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
