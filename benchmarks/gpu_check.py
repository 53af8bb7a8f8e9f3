"""Checks every catalog spec on the GPU against the float64 reference, then times attngen beside
FlexAttention and SDPA (flash, cuDNN) in the same process; prints a table and writes JSON.

    python benchmarks/gpu_check.py [--out results.json] [--quick]
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import platform
import sys
import time
import traceback
from datetime import date

import torch
import triton

import attngen
from attngen import testing

SPEC_DIR = os.path.join(os.path.dirname(__file__), "..", "specs")


def spec_path(name: str) -> str:
    return os.path.join(SPEC_DIR, f"{name}.attn")


# --- correctness -------------------------------------------------------------------------------

def check_catalog(shapes, dtypes, names=None) -> list[dict]:
    rows = []
    for path in sorted(glob.glob(os.path.join(SPEC_DIR, "*.attn"))):
        if names and os.path.basename(path)[:-5] not in names:
            continue
        attn = attngen.build(path)
        for (B, H, HKV, N, M, D, DV) in shapes:
            if attn.spec.name == "document_causal" and N != M:
                continue  # doc is indexed by q and k: the spec needs Q_LEN == KV_LEN
            for dtype in dtypes:
                row = dict(spec=attn.spec.name, shape=[B, H, HKV, N, M, D, DV], dtype=str(dtype))
                t0 = time.time()
                try:
                    q, k, v = testing.random_qkv(B, H, HKV, N, M, D, DV, dtype, device="cuda", seed=1)
                    inputs = testing.random_inputs(attn.spec, B, H, HKV, N, M, device="cuda", seed=1)
                    testing.check_against_reference(attn.spec, attn, q, k, v, inputs)
                    row["ok"] = True
                except Exception as e:  # report every failure, keep checking the rest
                    row["ok"] = False
                    row["error"] = f"{type(e).__name__}: {e}"[:2000]
                    traceback.print_exc()
                row["seconds"] = round(time.time() - t0, 2)
                print(("ok  " if row["ok"] else "FAIL"), row["spec"], row["shape"], row["dtype"],
                      row.get("error", "")[:300], flush=True)
                rows.append(row)
                torch.cuda.empty_cache()
    return rows


# --- the same variants for FlexAttention -------------------------------------------------------

def flex_variants(B, H, N, device):
    """name -> (score_mod or None, mask_mod or None, attngen inputs); the same data for both."""
    g = torch.Generator().manual_seed(0)
    slopes = (2.0 ** (-8.0 * (torch.arange(H) + 1) / H)).to(device)
    prefix = torch.randint(N // 8, N // 2, (B,), generator=g).to(device=device, dtype=torch.int32)
    cuts = torch.sort(torch.randint(0, N, (7,), generator=g)).values
    doc = torch.zeros(N, dtype=torch.int32)
    for c in cuts:
        doc[c:] += 1
    doc = doc.to(device)
    table = (0.1 * torch.randn(H, 257, generator=g)).to(device)
    nb = triton.cdiv(N, 128)
    layout = torch.rand(H, nb, nb, generator=g) < 0.3
    layout |= torch.eye(nb, dtype=torch.bool)[None]
    layout = layout.to(device)

    def causal(b, h, q, k):
        return q >= k

    def window(w):
        return lambda b, h, q, k: (q >= k) & (q - k < w)

    return {
        "full": (None, None, {}),
        "causal": (None, causal, {}),
        "sliding_window": (None, window(1024), {}),
        "alibi_causal": (lambda s, b, h, q, k: s + slopes[h] * (k - q), causal, {"slopes": slopes}),
        "gemma2_local": (lambda s, b, h, q, k: 50.0 * torch.tanh(s / 50.0), window(4096), {}),
        "prefix_lm": (None, lambda b, h, q, k: (k < prefix[b]) | (q >= k), {"prefix": prefix}),
        "document_causal": (None, lambda b, h, q, k: (doc[q] == doc[k]) & (q >= k), {"doc": doc}),
        "learned_rel_bias": (lambda s, b, h, q, k: s + table[h, torch.clamp(q - k, -128, 128) + 128],
                             None, {"table": table}),
        "block_sparse": (None, lambda b, h, q, k: layout[h, q // 128, k // 128], {"layout": layout}),
        "chunked_causal": (None, lambda b, h, q, k: (q // 256 == k // 256) & (q >= k), {}),
    }


def bench(fn, grad_to_none=None) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median")


def time_variants(B, H, N, D, dtype, names) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    device = "cuda"
    q, k, v = testing.random_qkv(B, H, H, N, N, D, D, dtype, device=device, seed=2)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    do = torch.randn_like(q)
    rows = []
    variants = flex_variants(B, H, N, device)
    for name in names:
        # A fresh compile per variant: past dynamo's recompile limit flex_attention would silently
        # run eagerly, and the comparison would be meaningless.
        torch._dynamo.reset()
        flex = torch.compile(flex_attention, dynamic=False)
        score_mod, mask_mod, inputs = variants[name]
        attn = attngen.build(spec_path(name))
        row = dict(variant=name, B=B, H=H, N=N, D=D, dtype=str(dtype))
        try:
            block_mask = None
            if mask_mod is not None:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                block_mask = create_block_mask(mask_mod, B, H, N, N, device=device)
                torch.cuda.synchronize()
                row["flex_block_mask_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
                row["flex_block_mask_ms_steady"] = round(bench(
                    lambda: create_block_mask(mask_mod, B, H, N, N, device=device)), 3)
            ours = lambda: attn(q, k, v, **inputs)  # noqa: E731
            theirs = lambda: flex(q, k, v, score_mod=score_mod, block_mask=block_mask)  # noqa: E731
            t0 = time.perf_counter()
            ours().backward(do)
            torch.cuda.synchronize()
            row["attngen_first_call_s"] = round(time.perf_counter() - t0, 2)
            t0 = time.perf_counter()
            theirs().backward(do)
            torch.cuda.synchronize()
            row["flex_first_call_s"] = round(time.perf_counter() - t0, 2)
            with torch.no_grad():
                row["attngen_fwd_ms"] = bench(ours)
                row["flex_fwd_ms"] = bench(theirs)
            row["attngen_fwdbwd_ms"] = bench(lambda: ours().backward(do), grad_to_none=[q, k, v])
            row["flex_fwdbwd_ms"] = bench(lambda: theirs().backward(do), grad_to_none=[q, k, v])
            if name in ("full", "causal"):
                is_causal = name == "causal"
                for backend, label in ((SDPBackend.FLASH_ATTENTION, "sdpa_flash"), (SDPBackend.CUDNN_ATTENTION, "cudnn")):
                    try:
                        with sdpa_kernel(backend):
                            f = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal)  # noqa: E731
                            with torch.no_grad():
                                row[f"{label}_fwd_ms"] = bench(f)
                            row[f"{label}_fwdbwd_ms"] = bench(lambda: f().backward(do), grad_to_none=[q, k, v])
                    except Exception as e:
                        row[f"{label}_error"] = str(e)[:300]
                flops = 4 * B * H * N * N * D / (2 if is_causal else 1)
                for key in list(row):
                    if key.endswith("_fwd_ms"):
                        row[key.replace("_ms", "_tflops")] = round(flops / row[key] / 1e9, 1)
                    if key.endswith("_fwdbwd_ms"):
                        row[key.replace("_ms", "_tflops")] = round(3.5 * flops / row[key] / 1e9, 1)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
            traceback.print_exc()
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def run_info() -> dict:
    """What a result file must say about where it was measured; printed as the run's first line."""
    info = dict(date=str(date.today()), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=triton.__version__, attngen=attngen.__version__, python=platform.python_version())
    print(json.dumps(info), flush=True)
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="gpu_results.json")
    parser.add_argument("--quick", action="store_true", help="small shapes only, no timing")
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--only", nargs="*", help="time only these variants")
    parser.add_argument("--check-only", nargs="*", help="check only these specs")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_check needs a CUDA GPU")
    info = run_info()
    results = dict(info=info)
    if not args.skip_check:
        odd = [(2, 8, 2, 1000, 1000, 80, 80), (1, 4, 4, 333, 517, 64, 96)]
        big = [] if args.quick else [(2, 8, 8, 4096, 4096, 128, 128)]
        results["check"] = check_catalog(odd + big, [torch.bfloat16, torch.float16], args.check_only)
        bad = [r for r in results["check"] if not r["ok"]]
        print(f"correctness: {len(results['check']) - len(bad)} ok, {len(bad)} failed", flush=True)
    if not args.quick:
        names = args.only or ["full", "causal", "sliding_window", "alibi_causal", "gemma2_local", "prefix_lm",
                              "document_causal", "learned_rel_bias", "block_sparse", "chunked_causal"]
        results["timing"] = time_variants(4, 16, 4096, 128, torch.bfloat16, names)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print("\nvariant           attngen fwd  flex fwd  | attngen f+b  flex f+b   (ms, B=4 H=16 N=4096 D=128 bf16)")
    for r in results.get("timing", []):
        if "error" in r:
            print(f"{r['variant']:<17} ERROR {r['error'][:100]}")
            continue
        print(f"{r['variant']:<17} {r['attngen_fwd_ms']:>10.3f} {r['flex_fwd_ms']:>9.3f}  | "
              f"{r['attngen_fwdbwd_ms']:>10.3f} {r['flex_fwdbwd_ms']:>9.3f}"
              + "".join(f"  {k}={v}" for k, v in r.items() if k.endswith("tflops")))


if __name__ == "__main__":
    main()
