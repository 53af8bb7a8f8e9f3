"""Plain attention at one (D, DV) pair under one tiling variant, forward and backward against the
float64 reference, in its own process (an illegal address poisons the CUDA context). The sweep
behind plan.MASKED_WIDTH_FLOOR; results in benchmarks/history/results/2026-11-30-h200-s3-head-dims.txt.

    for D in 17 40 64 65 128; do for DV in 8 12 23 32 64 128; do for var in planned m64 pad64; do
        python tools/head_dim_sweep.py $D $DV $var; done; done; done

Variants: planned (the plan's tiles), m64 (64x128 forward tiles), pad64 (tile widths >= 64).
The sweep ran before the floor existed; with it, `planned` is what pad64 was.
"""

import sys

import torch
import triton

import attngen
from attngen import testing


def main() -> None:
    D, DV, variant = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    attn = attngen.build("attention plain\n")
    module = attn.module
    if variant == "pad64":
        module._widths = lambda d, dv: (max(64, triton.next_power_of_2(d)), max(64, triton.next_power_of_2(dv)))
    elif variant == "m64":
        for key in module.FACTS.plan:
            module.FACTS.plan[key] = ((64, 128, 8, 3), *module.FACTS.plan[key][1:])
    elif variant != "planned":
        sys.exit(f"variant must be planned, m64 or pad64, got {variant!r}")
    q, k, v = testing.random_qkv(2, 2, 1, 300, 300, D, DV, torch.float16, device="cuda", seed=1)
    try:
        testing.check_against_reference(attn.spec, attn, q, k, v, {}, grads=True)
        torch.cuda.synchronize()
        print(f"RESULT D={D:<4} DV={DV:<4} {variant:<7} ok", flush=True)
    except Exception as e:  # a wrong value or an illegal address: report it, the sweep goes on
        print(f"RESULT D={D:<4} DV={DV:<4} {variant:<7} {type(e).__name__}: {str(e)[:90]}", flush=True)


if __name__ == "__main__":
    main()
