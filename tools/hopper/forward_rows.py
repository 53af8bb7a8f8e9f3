"""The Hopper forward's kernel alone at 192 query rows a tile (three consumer warpgroups) and at 128 (two),
in one process, beside cuDNN's forward where SDPA can run the spec: the A/B behind the family's rule
(families/hopper/family.py, HOPPER_THREE_CONSUMERS_UP_TO). Each row count runs twice, in turn.

    python tools/hopper/forward_rows.py [--specs full causal alibi_causal sliding_window] [--shape 2,16,8192,64]
                                        [--out rows.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

import attngen
from attngen import testing

ROOT = Path(__file__).resolve().parents[2]
CUDNN_CAUSAL = {"full": False, "causal": True}  # the specs SDPA's cuDNN backend runs, and how


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--specs", nargs="*", default=["full", "causal", "alibi_causal", "sliding_window"])
    parser.add_argument("--shape", default="2,16,8192,64", help="B,H,N,D (bf16, D = DV)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    B, H, N, D = (int(x) for x in args.shape.split(","))
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "shape": dict(B=B, H=H, N=N, D=D, dtype="bf16"), "ms": {}}
    for name in args.specs:
        attn = attngen.build(ROOT / "specs" / f"{name}.attn")
        q, k, v = testing.random_qkv(B, H, H, N, N, D, D, torch.bfloat16, device="cuda")
        inputs = testing.random_inputs(attn.spec, B, H, H, N, N, device="cuda")
        rt = attn.module.ATTENTION
        tiles = rt._family_tiles(q, v, "hopper")
        print(f"{name}: the plan's tiles {tiles}, family {attn.forward_family(q, k, v, **inputs)}", flush=True)
        family, tensors = rt.families["hopper"], [inputs[i] for i in rt.facts.inputs]
        row = results["ms"][name] = {}
        first = None
        for label, block_m in (("192", 192), ("128", 128), ("192 again", 192), ("128 again", 128)):
            run = family.prepare(q, k, v, tensors, (), block_m, tiles[1], tiles[3], tiles[4])
            out, _ = run()
            if not torch.isfinite(out).all():
                raise SystemExit(f"{name} at {block_m} rows: non-finite output")
            first = out.clone() if first is None else first
            row[label] = triton.testing.do_bench(run, warmup=50, rep=300)
            print(f"  {label} rows: {row[label]:.4f} ms, max |O - O at 192 rows| "
                  f"{(out.float() - first.float()).abs().max().item():.3g}", flush=True)
        if name in CUDNN_CAUSAL:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                row["cudnn"] = triton.testing.do_bench(lambda: sdpa(q, k, v, is_causal=CUDNN_CAUSAL[name]),
                                                       warmup=50, rep=300)
            print(f"  cudnn: {row['cudnn']:.4f} ms", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
