"""First call: how long a variant's first forward and backward take, compiles included, for attngen (its
kernels compiled ahead, side by side: attngen/runtime/ahead.py), attngen compiling each kernel at its first
launch (ATTNGEN_COMPILE_AHEAD=0) and FlexAttention, every one with cold caches.

    python benchmarks/first_call.py [--specs causal document_causal ...] [--shape 2,16,4096,128] [--json FILE]

Each (spec, implementation) runs in a process of its own, whose Triton, Inductor and attngen caches are fresh
empty folders, so nothing any earlier run compiled is found on disk. Its clock starts after torch, attngen and
CUDA are up and q, k, v and the inputs made: attngen's first call is `attngen.build` and one forward and backward
(`out.backward(dO)`); Flex's is `to_flex`, its BlockMask and one forward and backward of
`torch.compile(flex_attention)`. Each row also has the next four calls' times, for scale. Issue 35's target: attngen's
first call no longer than Flex's for every catalog spec. bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IMPLEMENTATIONS = ("attngen", "attngen_at_launch", "flex")
CACHES = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "ATTNGEN_CACHE_DIR")


def child(implementation: str, spec_name: str, shape: tuple[int, int, int, int]) -> dict:
    """One first call in this process (whose caches the parent emptied); its row."""
    import torch

    import attngen
    from attngen import bench, testing

    B, H, N, D = shape
    path = ROOT / "specs" / f"{spec_name}.attn"
    spec = attngen.load_spec(path)[0]
    q, k, v = testing.random_qkv(B, H, H, N, N, D, D, torch.bfloat16, device="cuda", seed=2)
    inputs = testing.random_inputs(spec, B, H, H, N, N, device="cuda", seed=2)
    for t in (q, k, v, *(inputs[i.name] for i in spec.learnable_inputs)):
        t.requires_grad_()
    dout = torch.randn_like(q)
    torch.cuda.synchronize()
    start = time.perf_counter()
    if implementation == "flex":
        from torch.nn.attention.flex_attention import flex_attention

        variant = attngen.to_flex(spec)
        call = bench.flex_call(variant, q, k, v, inputs, block_mask=variant.block_mask(q, k, **inputs),
                               flex_kernel=torch.compile(flex_attention, dynamic=False))
    else:
        attn = attngen.build(path)
        call = lambda: attn(q, k, v, **inputs)  # noqa: E731
    call().backward(dout)
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    later = []
    for _ in range(4):
        start = time.perf_counter()
        call().backward(dout)
        torch.cuda.synchronize()
        later.append(round((time.perf_counter() - start) * 1e3, 2))
    row = dict(spec=spec_name, implementation=implementation, first_s=round(first, 3), later_ms=later)
    if implementation != "flex":
        from attngen.runtime import ahead

        row["family"] = attn.forward_family(q, k, v, **inputs)
        row["ahead_error"] = repr(ahead.LAST_ERROR) if ahead.LAST_ERROR is not None else None
    return row


def run_one(implementation: str, spec_name: str, shape: str) -> dict:
    """A child process's row, its caches fresh folders."""
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, **{name: str(Path(folder, name)) for name in CACHES}}
        if implementation == "attngen_at_launch":
            env["ATTNGEN_COMPILE_AHEAD"] = "0"
        done = subprocess.run([sys.executable, __file__, "--child", implementation, spec_name, "--shape", shape],
                              env=env, capture_output=True, text=True, timeout=600)
    rows = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not rows:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return dict(spec=spec_name, implementation=implementation, error=tail[:300])
    return json.loads(rows[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--specs", nargs="+", default=sorted(p.stem for p in (ROOT / "specs").glob("*.attn")))
    parser.add_argument("--shape", default="2,16,4096,128", help="B,H,N,D (default 2,16,4096,128)")
    parser.add_argument("--implementations", nargs="+", default=list(IMPLEMENTATIONS), choices=IMPLEMENTATIONS)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--child", nargs=2, metavar=("IMPLEMENTATION", "SPEC"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = tuple(int(n) for n in args.shape.split(","))
    if args.child:
        print(json.dumps(child(*args.child, shape)), flush=True)
        return
    rows = []
    print(f"{'spec':22} " + " ".join(f"{name:>18}" for name in args.implementations) + "   attngen / flex")
    for spec_name in args.specs:
        found = {name: run_one(name, spec_name, args.shape) for name in args.implementations}
        rows += found.values()
        cells = [f"{found[name]['first_s']:>17.2f}s" if "first_s" in found[name] else f"{'error':>18}"
                 for name in args.implementations]
        ratio = ""
        if "first_s" in found.get("attngen", {}) and "first_s" in found.get("flex", {}):
            ratio = f"{found['attngen']['first_s'] / found['flex']['first_s']:.2f}"
        print(f"{spec_name:22} " + " ".join(cells) + f"   {ratio}", flush=True)
        for row in found.values():
            if row.get("error") or row.get("ahead_error"):
                print(f"  {row['implementation']}: {row.get('error') or row.get('ahead_error')}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
