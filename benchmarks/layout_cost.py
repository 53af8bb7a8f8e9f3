"""What a model's layout costs: attngen's forward and forward+backward on transposed views of (B, N, H, D)
projections against the same values as dense (B, H, N, D) tensors, and cuDNN's on dense tensors beside.

    python benchmarks/layout_cost.py [--json FILE]

Each row times one call shape both ways in one process (triton.testing.do_bench, median ms). dO comes in
O's layout, as a model that reads O back as (B, N, H, D) passes it; with the layout contract O, dQ, dK
and dV follow the inputs' layout, so the transposed call allocates and copies nothing the dense one does
not. The ratio is dense time over transposed time: 1.00 means the layout costs nothing.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import attngen
from attngen import testing

# (name, spec, B, H, HKV, N, D): the shapes of the table.
CASES = [
    ("full D128", "specs/full.attn", 4, 16, 16, 4096, 128),
    ("causal D128", "specs/causal.attn", 4, 16, 16, 4096, 128),
    ("causal D64", "specs/causal.attn", 4, 16, 16, 8192, 64),
    ("causal GQA 32/8", "specs/causal.attn", 4, 32, 8, 4096, 128),
]


def _time(call, leaves, dout, backward):
    if not backward:
        with torch.no_grad():
            return triton.testing.do_bench(call, warmup=50, rep=300)

    def step():
        torch.autograd.grad(call(), leaves, dout)
    return triton.testing.do_bench(step, warmup=50, rep=300)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    rows = []
    for name, spec, B, H, HKV, N, D in CASES:
        attn = attngen.build(spec)
        causal = "causal" in spec
        row = {"case": name, "B": B, "H": H, "HKV": HKV, "N": N, "D": D}
        for layout in ("dense", "transposed"):
            q, k, v = testing.random_qkv(B, H, HKV, N, N, D, D, torch.bfloat16, device="cuda", seed=2, layout=layout)
            leaves = [t.requires_grad_() for t in (q, k, v)]
            out = attn(q, k, v)
            dout = torch.randn_like(out)
            assert attn.forward_family(q, k, v) == "hopper" and attn.backward_family(q, k, v) == "hopper"
            for backward in (False, True):
                row[f"{layout} {'fwd+bwd' if backward else 'fwd'} ms"] = _time(lambda: attn(q, k, v), leaves, dout,
                                                                               backward)
            if layout == "dense":
                # cuDNN on the same dense tensors (GQA by SDPA's enable_gqa), for scale; nan where it refuses.
                def cudnn():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                                enable_gqa=H != HKV)
                for part, backward in (("fwd", False), ("fwd+bwd", True)):
                    try:
                        row[f"cudnn {part} ms"] = _time(cudnn, leaves, dout, backward)
                    except RuntimeError:
                        row[f"cudnn {part} ms"] = float("nan")
        for part in ("fwd", "fwd+bwd"):
            row[f"{part} dense/transposed"] = row[f"dense {part} ms"] / row[f"transposed {part} ms"]
        rows.append(row)
        print(f"{name:18s} fwd dense {row['dense fwd ms']:.3f} transposed {row['transposed fwd ms']:.3f} "
              f"({row['fwd dense/transposed']:.3f})  fwd+bwd dense {row['dense fwd+bwd ms']:.3f} transposed "
              f"{row['transposed fwd+bwd ms']:.3f} ({row['fwd+bwd dense/transposed']:.3f}); cuDNN dense "
              f"{row['cudnn fwd ms']:.3f} / {row['cudnn fwd+bwd ms']:.3f} ms", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "triton": triton.__version__,
                       "gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
