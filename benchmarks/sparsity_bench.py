"""Issue 3 on the GPU: masked variants beside FlexAttention, with its BlockMask built outside the
timed region and inside it; the tile-table kernel against create_block_mask; bf16 correctness and
the kernels' visit counts against `attngen explain`'s prediction, all in one process.

    python benchmarks/sparsity_bench.py [--out sparsity.json] [--n 8192] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import torch
import triton

import attngen
from attngen import testing
from attngen.report.tilemap import EMPTY, FULL, tile_map

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gpu_check import bench, run_info, spec_path  # noqa: E402


def variants(B, H, N, device):
    """name -> (spec path, params, mask_mod for Flex, attngen inputs): the same mask for both."""
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(N // 8, N // 2, (B,), generator=g).to(device=device, dtype=torch.int32)
    lengths = torch.randint(N // 32, N // 4, (64,), generator=g)  # packed documents of mixed length
    doc = torch.repeat_interleave(torch.arange(64), lengths)[:N].to(torch.int32)
    doc = torch.cat([doc, torch.full((N - doc.numel(),), 64, dtype=torch.int32)]).to(device)
    nb = triton.cdiv(N, 128)
    layout = torch.rand(H, nb, nb, generator=g) < 0.2
    layout |= torch.eye(nb, dtype=torch.bool)[None]
    layout = layout.to(device)
    return {
        "sliding_window": (spec_path("sliding_window"), {"window": 1024},
                           lambda b, h, q, k: (q >= k) & (q - k < 1024), {}),
        "document_causal": (spec_path("document_causal"), {},
                            lambda b, h, q, k: (doc[q] == doc[k]) & (q >= k), {"doc": doc}),
        "prefix_lm": (spec_path("prefix_lm"), {}, lambda b, h, q, k: (k < prefix[b]) | (q >= k),
                      {"prefix": prefix}),
        "block_sparse": (spec_path("block_sparse"), {"block": 128},
                         lambda b, h, q, k: layout[h, q // 128, k // 128], {"layout": layout}),
        "chunked_causal": (spec_path("chunked_causal"), {"chunk": 1024},
                           lambda b, h, q, k: (q // 1024 == k // 1024) & (q >= k), {}),
    }


def check(names, device="cuda") -> list[dict]:
    """bf16 forward, LSE and gradients against the float64 reference at a size the reference can hold."""
    rows = []
    B, H, N, D = 2, 4, 2048, 128
    for name in names:
        path, params, _, inputs = variants(B, H, N, device)[name]
        attn = attngen.build(path, params=params)
        row = dict(spec=name, shape=[B, H, N, D], dtype="bf16")
        try:
            q, k, v = testing.random_qkv(B, H, H, N, N, D, D, torch.bfloat16, device=device, seed=3)
            testing.check_against_reference(attn.spec, attn, q, k, v, inputs)
            row["ok"] = True
        except Exception as e:  # report, keep going
            row.update(ok=False, error=f"{type(e).__name__}: {e}"[:1500])
            traceback.print_exc()
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def visits_match_explain(name, B, H, N, D, device="cuda") -> dict:
    """The forward kernel's visit counters on the GPU against the tile map `attngen explain` prints."""
    path, params, _, inputs = variants(B, H, N, device)[name]
    attn = attngen.build(path, params=params)
    q, k, v = testing.random_qkv(B, H, H, N, N, D, D, torch.bfloat16, device=device, seed=4)
    counts = attn.visit_counts(q, k, v, **inputs)["fwd"][0, 0].cpu()
    bm, bn = attn.module._tiles(q, v, 0)[:2]
    sizes = {"B": B, "H": H, "HKV": H, "Q_LEN": N, "KV_LEN": N, "D": D}
    predicted = tile_map(attn.spec, sizes, bm, bn, inputs=inputs).grid
    return dict(variant=name, tiles=[bm, bn], visited=int((counts != 0).sum()),
                predicted_visited=int((predicted != EMPTY).sum()), unmasked=int((counts == 16).sum()),
                predicted_full=int((predicted == FULL).sum()),
                identical=bool(torch.equal((counts == 16), predicted == FULL)
                               and torch.equal(counts != 0, predicted != EMPTY)))


def time_variants(B, H, N, D, names, device="cuda") -> list[dict]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v = testing.random_qkv(B, H, H, N, N, D, D, torch.bfloat16, device=device, seed=2)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    do = torch.randn_like(q)
    rows = []
    for name in names:
        torch._dynamo.reset()  # a fresh compile per variant (dynamo's recompile limit)
        flex = torch.compile(flex_attention, dynamic=False)
        path, params, mask_mod, inputs = variants(B, H, N, device)[name]
        attn = attngen.build(path, params=params)
        row = dict(variant=name, B=B, H=H, N=N, D=D, dtype="bf16", tile_table=bool(attn.module.FACTS.tile_table))
        try:
            def block_mask():
                return create_block_mask(mask_mod, B, H, N, N, device=device)
            mask = block_mask()
            row["flex_sparsity_pct"] = round(float(mask.sparsity()), 2)
            # attngen's default builds its tile tables inside every call, like block_mask() inside
            # Flex's; passing tables built once is the like of Flex's BlockMask built outside.
            ours = lambda: attn(q, k, v, **inputs)  # noqa: E731
            tables = attn.tile_tables(q, k, v, **inputs)
            ours_reusing = lambda: attn(q, k, v, tile_tables=tables, **inputs)  # noqa: E731
            theirs = lambda: flex(q, k, v, block_mask=mask)  # noqa: E731
            theirs_with_mask = lambda: flex(q, k, v, block_mask=block_mask())  # noqa: E731
            for fn in (ours, ours_reusing, theirs):
                fn().backward(do)
            torch.cuda.synchronize()
            with torch.no_grad():
                row["attngen_fwd_ms"] = bench(ours)
                row["flex_fwd_ms"] = bench(theirs)
                row["flex_fwd_with_block_mask_ms"] = bench(theirs_with_mask)
                if attn.module.FACTS.tile_table:
                    row["attngen_fwd_reusing_tables_ms"] = bench(ours_reusing)
            row["attngen_fwdbwd_ms"] = bench(lambda: ours().backward(do), grad_to_none=[q, k, v])
            row["flex_fwdbwd_ms"] = bench(lambda: theirs().backward(do), grad_to_none=[q, k, v])
            row["flex_fwdbwd_with_block_mask_ms"] = bench(lambda: theirs_with_mask().backward(do),
                                                          grad_to_none=[q, k, v])
            if attn.module.FACTS.tile_table:
                row["attngen_fwdbwd_reusing_tables_ms"] = bench(lambda: ours_reusing().backward(do),
                                                                grad_to_none=[q, k, v])
            row["create_block_mask_ms"] = bench(block_mask)
            if attn.module.FACTS.tile_table:
                tensors = [inputs[n].contiguous() for n in attn.module.FACTS.inputs]
                bm, bn = attn.module._tiles(q, v, 0)[:2]
                sizes = (B, H, H, N, N)
                row["attngen_table_kernel_ms"] = bench(
                    lambda: attn.module._build_table((True, bm, bn), sizes, q.device, tensors))
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:1500]
            traceback.print_exc()
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="sparsity.json")
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--skip-check", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("sparsity_bench needs a CUDA GPU")
    names = args.only or ["sliding_window", "document_causal", "prefix_lm", "block_sparse", "chunked_causal"]
    info = run_info()
    results = dict(info=info)
    t0 = time.time()
    if not args.skip_check:
        results["check"] = check(names)
        closed_form = [n for n in names if n not in ("document_causal", "block_sparse")]  # others: tile tables
        results["visits"] = [visits_match_explain(n, 1, 2, args.n, 128) for n in closed_form]
        for r in results["visits"]:
            print(json.dumps(r), flush=True)
    results["timing"] = time_variants(args.batch, 16, args.n, 128, names)
    results["seconds"] = round(time.time() - t0, 1)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nms, B={args.batch} H=16 N={args.n} D=128 bf16: attngen (tables built in the call) | Flex "
          f"(BlockMask outside / inside the timing); attngen reusing its tables")
    for r in results["timing"]:
        if "error" in r:
            print(f"{r['variant']:<16} ERROR {r['error'][:200]}")
            continue
        print(f"{r['variant']:<16} fwd {r['attngen_fwd_ms']:.3f} | {r['flex_fwd_ms']:.3f} / "
              f"{r['flex_fwd_with_block_mask_ms']:.3f}   fwd+bwd {r['attngen_fwdbwd_ms']:.3f} | "
              f"{r['flex_fwdbwd_ms']:.3f} / {r['flex_fwdbwd_with_block_mask_ms']:.3f}   "
              f"table {r.get('attngen_table_kernel_ms', '-')} vs create_block_mask {r['create_block_mask_ms']:.3f}   "
              f"reusing tables fwd {r.get('attngen_fwd_reusing_tables_ms', '-')} "
              f"fwd+bwd {r.get('attngen_fwdbwd_reusing_tables_ms', '-')}")


if __name__ == "__main__":
    main()
