"""Runs one spec's attngen call a few times on the GPU and nothing else: the program a profiler
(tools/hopper/ncu_profile.sh) watches.

    python tools/hopper/one_call.py --spec specs/causal.attn --shape 4,16,8192,64 [--backward] [--calls 4]
                                    [--target a100]

--target builds for another target (a100: the portable kernels, run on this GPU).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import attngen

from host_overhead import inputs_for


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="a .attn file")
    parser.add_argument("--shape", default="4,16,8192,128", help="B,H,N,D")
    parser.add_argument("--backward", action="store_true", help="forward+backward calls")
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--target")
    args = parser.parse_args()
    B, H, N, D = (int(x) for x in args.shape.split(","))
    attn = attngen.build(Path(args.spec).read_text(), target=args.target)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=args.backward)
               for _ in range(3))
    do = torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16)
    inputs = inputs_for(attn, B, H, N)
    print("families:", attn.forward_family(q, k, v, **inputs), attn.backward_family(q, k, v, **inputs))
    for _ in range(args.calls):
        if args.backward:
            attn(q, k, v, **inputs).backward(do)
        else:
            with torch.no_grad():
                attn(q, k, v, **inputs)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
