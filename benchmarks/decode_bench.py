"""Decoding on the GPU: the decode family's split-KV forward beside the portable forward, FlexAttention
and SDPA (flash, cuDNN), in one process; prints a table and writes JSON.

The shapes are issue 14's: bf16, D=128, 32 query heads over 8 key/value heads, one (or 16) new queries
attending the whole cache. Effective bandwidth counts the K and V bytes read once.

    python benchmarks/decode_bench.py [--out results.json]

Until query positions can be offset (q_offset), decode specs spell the cache's alignment themselves:
the new queries are the last Q_LEN positions, so query q sits at q + KV_LEN - Q_LEN.
"""

from __future__ import annotations

import argparse
import json
import platform
from datetime import date

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

import attngen
import attngen.reference

SPECS = {
    "full": "attention full\n",
    "causal_decode": "attention causal_decode\nmask: k <= q + KV_LEN - Q_LEN\n",
    "window_decode": ("attention window_decode\nparam window = 4096\n"
                      "mask: k <= q + KV_LEN - Q_LEN and q + KV_LEN - Q_LEN - k < window\n"),
    "softcap_decode": ("attention softcap_decode\nparam cap = 30.0\nmask: k <= q + KV_LEN - Q_LEN\n"
                       "score: softcap(score, cap)\n"),
    "alibi_decode": ("attention alibi_decode\ninput slopes: f32[H]\nmask: k <= q + KV_LEN - Q_LEN\n"
                     "score: score - slopes[h] * (q + KV_LEN - Q_LEN - k)\n"),
    "causal": "attention causal\nmask: causal\n",  # with kv_len: positions are the cache's
}
# Cache calls: (spec, B, Q_LEN, KV_LEN, layout): kv_len given (the queries are the newest tokens), the
# cache contiguous or in shuffled pages of 16 or 64 keys.
CACHE_CASES = [
    ("full", 8, 1, 32768, "contiguous"), ("full", 8, 1, 32768, "paged16"), ("full", 8, 1, 32768, "paged64"),
    ("causal", 8, 16, 32768, "contiguous"), ("causal", 8, 16, 32768, "paged16"),
    ("causal", 4, 512, 16384, "contiguous"), ("causal", 4, 512, 16384, "paged64"),
]
# (spec, B, Q_LEN, KV_LEN)
CASES = [
    ("full", 8, 1, 32768), ("full", 64, 1, 4096), ("full", 1, 1, 131072), ("full", 8, 16, 32768),
    ("causal_decode", 8, 16, 32768), ("window_decode", 8, 1, 32768), ("softcap_decode", 8, 1, 32768),
    ("alibi_decode", 8, 1, 32768),
]
H, HKV, D = 32, 8, 128


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200)


def flex_mask(name, q_len, kv_len):
    from torch.nn.attention.flex_attention import create_block_mask
    shift = kv_len - q_len
    if name == "full":
        return None, None
    if name == "window_decode":
        mask = lambda b, h, q, k: (k <= q + shift) & (q + shift - k < 4096)  # noqa: E731
    else:
        mask = lambda b, h, q, k: k <= q + shift  # noqa: E731
    score = None
    if name == "softcap_decode":
        score = lambda s, b, h, q, k: 30.0 * torch.tanh(s / 30.0)  # noqa: E731
    return create_block_mask(mask, None, None, q_len, kv_len), score


def sweep() -> None:
    """The decode tiles (BLOCK_N, warps, stages) and programs per SM on plain decoding: how the plan's
    choice compares with its neighbours."""
    attn = attngen.build(SPECS["full"])
    module = attn.module
    key = (128, 128, "bf16")
    planned = module.FAMILY_TILES[key]["decode"]
    for B, q_len, kv_len in ((8, 1, 32768), (64, 1, 4096), (1, 1, 131072)):
        q = torch.randn(B, H, q_len, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, HKV, kv_len, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, HKV, kv_len, D, device="cuda", dtype=torch.bfloat16)
        cache = 2 * k.numel() * 2
        for block_n in (32, 64, 128):
            for warps in (4, 8):
                for stages in (2, 3, 4):
                    for per_sm in (2, 4, 8):
                        module.FAMILY_TILES[key] = {"decode": (planned[0], block_n, warps, stages)}
                        module.DECODE_PROGRAMS_PER_SM = per_sm
                        try:
                            t = bench(lambda: attn(q, k, v))
                            print(f"sweep B{B} Q{q_len} KV{kv_len} BLOCK_N={block_n} {warps}w {stages}s "
                                  f"{per_sm}/SM: {t:.4f} ms {cache / t / 1e9:.2f} TB/s", flush=True)
                        except Exception as e:  # out of resources: report and go on
                            print(f"sweep {block_n} {warps} {stages}: {type(e).__name__}", flush=True)
    module.FAMILY_TILES[key] = {"decode": planned}
    module.DECODE_PROGRAMS_PER_SM = 2


def _pages(x, page_size, order):
    B, HKV, N, Dx = x.shape
    n = N // page_size
    pages = x.view(B, HKV, n, page_size, Dx).permute(0, 2, 3, 1, 4).reshape(B * n, page_size, HKV, Dx)
    out = torch.empty_like(pages)
    out[order] = pages
    return out


def graphed(fn):
    """fn captured in a CUDA graph (warmed up outside the capture): its replay."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    return graph.replay


def cache_case(attn, flex, name, B, q_len, kv_len, layout) -> dict:
    """One cache call (kv_len = the cache's length, default offsets) beside FlexAttention on the same
    positions (a causal mask shifted by KV_LEN - Q_LEN)."""
    from torch.nn.attention.flex_attention import create_block_mask
    torch.manual_seed(0)
    q = torch.randn(B, H, q_len, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, HKV, kv_len, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, HKV, kv_len, D, device="cuda", dtype=torch.bfloat16)
    lengths = torch.full((B,), kv_len, dtype=torch.int32, device="cuda")
    call = {"kv_len": lengths}
    kc, vc = k, v
    if layout.startswith("paged"):
        page = int(layout[5:])
        order = torch.randperm(B * kv_len // page, device="cuda")
        kc, vc = _pages(k, page, order), _pages(v, page, order)
        call["page_table"] = order.view(B, kv_len // page).to(torch.int32)
    row = {"spec": name, "B": B, "Q_LEN": q_len, "KV_LEN": kv_len, "layout": layout,
           "family": attn.forward_family(q, kc, vc, **call)}
    with torch.no_grad():
        out = attn(q, kc, vc, **call)
        ref, _ = attngen.reference.evaluate(attn.spec, q[:1].double(), k[:1].double(), v[:1].double(),
                                            kv_len=lengths[:1])
        row["max_err"] = (out[:1].double() - ref).abs().max().item()
        row["nan"] = bool(torch.isnan(out).any())
        row["attngen_ms"] = bench(lambda: attn(q, kc, vc, **call))
        row["attngen_graph_ms"] = bench(graphed(lambda: attn(q, kc, vc, **call)))
        shift = kv_len - q_len
        mask = None if name == "full" else create_block_mask(lambda b, h, i, j: j <= i + shift, None, None,
                                                             q_len, kv_len)
        torch._dynamo.reset()  # a fresh compile per shape: Flex's recompile limit would fall back to eager
        row["flex_ms"] = bench(lambda: flex(q, k, v, block_mask=mask, enable_gqa=True))
    row["attngen_TBps"] = 2 * k.numel() * k.element_size() / row["attngen_graph_ms"] / 1e9
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--sweep", action="store_true", help="time other decode tiles on the full spec instead")
    args = parser.parse_args()
    if args.sweep:
        sweep()
        return
    from torch.nn.attention.flex_attention import flex_attention
    flex = torch.compile(flex_attention)
    rows = []
    built = {name: attngen.build(text) for name, text in SPECS.items()}
    for name, B, q_len, kv_len in CASES:
        torch.manual_seed(0)
        q = torch.randn(B, H, q_len, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, HKV, kv_len, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, HKV, kv_len, D, device="cuda", dtype=torch.bfloat16)
        inputs = {"slopes": torch.rand(H, device="cuda")} if name == "alibi_decode" else {}
        attn = built[name]
        family = attn.module.forward_family(q, k, v, **inputs)
        cache_bytes = 2 * k.numel() * k.element_size()
        row = {"spec": name, "B": B, "Q_LEN": q_len, "KV_LEN": kv_len, "family": family,
               "cache_GB": cache_bytes / 1e9}
        # Correctness against the float64 reference on this very shape (rows of a few batches).
        with torch.no_grad():
            out = attn(q, k, v, **inputs)
            ref, _ = attngen.reference.evaluate(attn.spec, q[:2].double(), k[:2].double(), v[:2].double(), inputs)
            row["max_err"] = (out[:2].double() - ref).abs().max().item()
            row["nan"] = bool(torch.isnan(out).any())
            row["attngen_ms"] = bench(lambda: attn(q, k, v, **inputs))
            # In a CUDA graph, as a serving loop runs it: no host time between launches.
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                attn(q, k, v, **inputs)  # warm up (compile) outside the capture
                with torch.cuda.graph(graph, stream=stream):
                    graphed = attn(q, k, v, **inputs)
            torch.cuda.current_stream().wait_stream(stream)
            graph.replay()
            torch.cuda.synchronize()
            row["graph_matches"] = bool(torch.equal(graphed, out))
            row["attngen_graph_ms"] = bench(graph.replay)
            saved = attn.module.FORWARD_FAMILIES
            attn.module.FORWARD_FAMILIES = ()
            row["portable_ms"] = bench(lambda: attn(q, k, v, **inputs))
            attn.module.FORWARD_FAMILIES = saved
            block_mask, score_mod = flex_mask(name, q_len, kv_len)
            if name != "alibi_decode":
                row["flex_ms"] = bench(lambda: flex(q, k, v, block_mask=block_mask, score_mod=score_mod,
                                                    enable_gqa=True))
            if name == "full":
                for backend, key in ((SDPBackend.FLASH_ATTENTION, "sdpa_flash_ms"),
                                     (SDPBackend.CUDNN_ATTENTION, "sdpa_cudnn_ms")):
                    try:
                        with sdpa_kernel(backend):
                            row[key] = bench(lambda: sdpa(q, k, v, enable_gqa=True))
                    except RuntimeError as e:
                        row[key] = None
                        row[key + "_error"] = str(e)[:120]
        row["attngen_TBps"] = cache_bytes / row["attngen_ms"] / 1e9
        rows.append(row)
        print(json.dumps(row), flush=True)
    for name, B, q_len, kv_len, layout in CACHE_CASES:
        rows.append(cache_case(built[name], flex, name, B, q_len, kv_len, layout))
        print(json.dumps(rows[-1]), flush=True)
    meta = {"date": str(date.today()), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "python": platform.python_version(), "H": H, "HKV": HKV, "D": D}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
