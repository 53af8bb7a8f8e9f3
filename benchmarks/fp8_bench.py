"""FP8 forward speed: attngen's FP8 call (float8_e4m3fn q, k, v with descale factors) beside the same call in
bf16 (attngen, as planned for this GPU) and cuDNN's bf16 forward, in one process; issue 35's target 4 asks
the FP8 forward for >= 1.0 PFLOP/s at D=128 (non-causal, N >= 8k) and >= 1.1 at D=256.

    python benchmarks/fp8_bench.py [--out FILE]

FA3's convention: 16k tokens a batch, hidden 2048 (H = 2048 / D), B = 16384 / N; TFLOP/s count 4 * D FLOPs
per allowed (query, key) pair. Where the Hopper family runs the FP8 call, "attngen fp8 kernel" is its kernel
alone, launched on descriptors built once (HopperFamily.prepare: V's transposed copy made there, not timed).
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

import attngen

SHAPES = ((8192, 128, False), (8192, 128, True), (16384, 128, False), (8192, 256, False), (8192, 64, False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    full, causal = attngen.build("attention full\n"), attngen.build("attention causal\nmask: causal\n")
    rows = []
    with torch.no_grad():
        for N, D, is_causal in SHAPES:
            H, B = 2048 // D, 16384 // N
            attn = causal if is_causal else full
            q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
            scales = [torch.ones(B, H, device="cuda") for _ in range(3)]
            pairs = B * H * (N * (N + 1) // 2 if is_causal else N * N)
            calls = {
                "attngen fp8": lambda: attn(q8, k8, v8, q_descale=scales[0], k_descale=scales[1], v_descale=scales[2]),
                "attngen bf16": lambda: attn(q, k, v),
                "cudnn bf16": lambda: sdpa(q, k, v, is_causal=is_causal),
            }
            row = {"N": N, "D": D, "causal": is_causal, "B": B, "H": H, "family": attn.forward_family(q, k, v),
                   "fp8 family": attn.forward_family(q8, k8, v8)}
            if row["fp8 family"] == "hopper":
                rt = attn.module.ATTENTION
                block_m, block_n, _, stages, q_buffers = rt._family_tiles(q8, v8, "hopper")
                calls["attngen fp8 kernel"] = rt.families["hopper"].prepare(q8, k8, v8, [], (), block_m, block_n, stages,
                                                                            q_buffers, fp8=scales)
            for name, fn in calls.items():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION) if name.startswith("cudnn") else torch.no_grad():
                    ms = triton.testing.do_bench(fn, warmup=25, rep=200)
                row[name] = {"ms": round(ms, 4), "tflops": round(4 * D * pairs / ms / 1e9, 1)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out:
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
