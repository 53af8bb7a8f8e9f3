"""Decoding on the GPU: the decode family's split-KV forward beside the portable forward, FlexAttention
and SDPA (flash, cuDNN), in one process; prints a table and writes JSON.

The shapes are issue 14's: bf16, D=128, 32 query heads over 8 key/value heads, one (or 16) new queries
attending the whole cache. Effective bandwidth counts the K and V bytes read once.

    python benchmarks/decode_bench.py [--out results.json]            # the targets table
    python benchmarks/decode_bench.py --prefill [--out results.json]  # chunked prefill, both families
    python benchmarks/decode_bench.py --sweep                         # decode tiles

CASES are training calls whose specs spell the cache's alignment themselves (the new queries are the
last Q_LEN positions: query q sits at q + KV_LEN - Q_LEN); CACHE_CASES and TABLE_SPECS are cache calls
(kv_len given), contiguous or paged.
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
from attngen.families.decode import runtime as runtime_decode

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
    planned = module.FACTS.family_tiles[key]["decode"]
    for B, q_len, kv_len in ((8, 1, 32768), (64, 1, 4096), (1, 1, 131072)):
        q = torch.randn(B, H, q_len, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, HKV, kv_len, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, HKV, kv_len, D, device="cuda", dtype=torch.bfloat16)
        cache = 2 * k.numel() * 2
        for block_n in (32, 64, 128):
            for warps in (4, 8):
                for stages in (2, 3, 4):
                    for per_sm in (2, 4, 8):
                        module.FACTS.family_tiles[key] = {"decode": (planned[0], block_n, warps, stages)}
                        runtime_decode.DECODE_PROGRAMS_PER_SM = per_sm
                        try:
                            t = bench(lambda: attn(q, k, v))
                            print(f"sweep B{B} Q{q_len} KV{kv_len} BLOCK_N={block_n} {warps}w {stages}s "
                                  f"{per_sm}/SM: {t:.4f} ms {cache / t / 1e9:.2f} TB/s", flush=True)
                        except Exception as e:  # out of resources: report and go on
                            print(f"sweep {block_n} {warps} {stages}: {type(e).__name__}", flush=True)
    module.FACTS.family_tiles[key] = {"decode": planned}
    runtime_decode.DECODE_PROGRAMS_PER_SM = 2


def prefill_sweep() -> list[dict]:
    """Chunked prefill, a cache call of Q_LEN in the tens to thousands over a long cache, run by the
    portable forward and by the split kernel on the same calls (CUDA-graph replays: no host time),
    causal, the queries the newest tokens: the data the per-call choice between them is fitted to."""
    attn = attngen.build(SPECS["causal"])
    module = attn.module
    rows = []
    for kv_len in (4096, 16384, 65536):
        for B in (1, 4, 16):
            for q_len in (16, 32, 64, 128, 256, 512, 1024):
                torch.manual_seed(0)
                q = torch.randn(B, H, q_len, D, device="cuda", dtype=torch.bfloat16)
                k = torch.randn(B, HKV, kv_len, D, device="cuda", dtype=torch.bfloat16)
                v = torch.randn(B, HKV, kv_len, D, device="cuda", dtype=torch.bfloat16)
                lengths = torch.full((B,), kv_len, dtype=torch.int32, device="cuda")
                cache = (lengths, lengths - q_len)
                with torch.no_grad():
                    portable = module._portable_forward(q, k, v, [], (), None, cache)[0]
                    split = module.families["decode"].forward(q, k, v, [], (), cache)[0]
                    row = {"B": B, "Q_LEN": q_len, "KV_LEN": kv_len,
                           "max_diff": (portable.float() - split.float()).abs().max().item(),
                           "portable_ms": bench(graphed(lambda: module._portable_forward(q, k, v, [], (), None, cache))),
                           "split_ms": bench(graphed(lambda: module.families["decode"].forward(q, k, v, [], (), cache))),
                           "chosen": attn.forward_family(q, k, v, kv_len=lengths)}
                rows.append(row)
                print("prefill", json.dumps(row), flush=True)
    return rows


# Masks that read inputs at q or k (tile-table masks), decoded: the kernel decides them key by key and
# loads only allowed keys. (name, spec text): documents of 4096 keys, the query in the last one; and
# transformers' padded causal mask (attngen.hf's spec) with 100 left-padding keys per row.
TABLE_SPECS = {
    "document_decode": "attention document_decode\ninput doc: i32[KV_LEN]\nmask: doc[q] == doc[k] and causal\n",
    "padded_decode": ("attention padded_decode\ninput keep: bool[B, KV_LEN]\ninput offset: i32[]\n"
                      "mask: keep[b, k] and k <= q + offset\n"),
}


def table_case(name: str, flex, B: int = 8, kv_len: int = 32768) -> dict:
    """One decoding step of a tile-table mask (a cache call: kv_len given), beside the same step of
    plain causal decoding and FlexAttention with the same mask."""
    from torch.nn.attention.flex_attention import create_block_mask
    attn = attngen.build(TABLE_SPECS[name])
    torch.manual_seed(0)
    q = torch.randn(B, H, 1, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, HKV, kv_len, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, HKV, kv_len, D, device="cuda", dtype=torch.bfloat16)
    lengths = torch.full((B,), kv_len, dtype=torch.int32, device="cuda")
    if name == "document_decode":
        inputs = {"doc": torch.arange(kv_len, device="cuda", dtype=torch.int32) // 4096}
        doc = inputs["doc"]
        mask = create_block_mask(lambda b, h, i, j: (doc[i + kv_len - 1] == doc[j]) & (j <= i + kv_len - 1),
                                 None, None, 1, kv_len)
    else:
        keep = torch.ones(B, kv_len, dtype=torch.bool, device="cuda")
        keep[:, :100] = False
        inputs = {"keep": keep, "offset": torch.zeros((), dtype=torch.int32, device="cuda")}
        mask = create_block_mask(lambda b, h, i, j: keep[b, j] & (j <= i + kv_len - 1), B, None, 1, kv_len)
    row = {"spec": name, "B": B, "Q_LEN": 1, "KV_LEN": kv_len,
           "family": attn.forward_family(q, k, v, kv_len=lengths, **inputs)}
    with torch.no_grad():
        out = attn(q, k, v, kv_len=lengths, **inputs)
        ref, _ = attngen.reference.evaluate(attn.spec, q[:2].double(), k[:2].double(), v[:2].double(),
                                            {n: (t[:2] if n == "keep" else t) for n, t in inputs.items()},
                                            kv_len=lengths[:2])
        row["max_err"] = (out[:2].double() - ref).abs().max().item()
        row["nan"] = bool(torch.isnan(out).any())
        row["attngen_graph_ms"] = bench(graphed(lambda: attn(q, k, v, kv_len=lengths, **inputs)))
        causal = attngen.build(SPECS["causal"])
        row["causal_graph_ms"] = bench(graphed(lambda: causal(q, k, v, kv_len=lengths)))
        torch._dynamo.reset()
        row["flex_ms"] = bench(lambda: flex(q, k, v, block_mask=mask, enable_gqa=True))
    return row


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
    parser.add_argument("--prefill", action="store_true",
                        help="time chunked prefill on both forward families instead (prefill_sweep)")
    args = parser.parse_args()
    meta = {"date": str(date.today()), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "python": platform.python_version(), "H": H, "HKV": HKV, "D": D}
    if args.sweep:
        sweep()
        return
    if args.prefill:
        rows = prefill_sweep()
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
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
            saved = attn.module.forward_families
            attn.module.forward_families = ()
            row["portable_ms"] = bench(lambda: attn(q, k, v, **inputs))
            attn.module.forward_families = saved
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
    for name in TABLE_SPECS:
        rows.append(table_case(name, flex))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
