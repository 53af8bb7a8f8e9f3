"""An eager decoding step against the same step in a CUDA graph: issue 35's "eager within 1.1x of its graph",
with the host's time per call and any sync the call makes, beside cuDNN.

    python benchmarks/decode_eager.py [--out FILE]

Full attention, 32 query heads over 8 key/value heads, D=128 bf16, one query over the cache, at the three
decode shapes of issue 35. A decoding loop writes kv_len in place every step, so every call below but
"plain" and "kv_len, same tensor" does `lengths.add_(0)` first (an in-place write: the tensor's version
changes, as a loop's `kv_len += 1` changes it); the paged and sink rows are for issue 35's "<= 1.05x
plain". Columns: eager and graph are triton.testing.do_bench medians (ms) of the call and of its CUDA-graph
replay; host_us is the host's time per call when calls are queued back to back, idle_host_us that of one
call issued on an idle GPU (the median); syncs are the messages of
torch's sync debug mode over two calls (empty: none).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
import warnings

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

import attngen
from attngen.testing import strategies
from decode_bench import graphed  # the capture decode_bench's graph rows use

H, HKV, D = 32, 8, 128
SHAPES = ((8, 32768), (64, 4096), (1, 131072))  # (B, cache length)


def host_us(fn, calls=200):
    """The host's time per call, calls queued back to back (the GPU may still be busy when it returns)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def idle_us(fn, calls=100):
    """The host's time for one call issued on an idle GPU (synchronized before it, its return timed): the
    host cost a decoding step pays before its launches reach the GPU; the median of `calls`."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2] * 1e6


def syncs(fn):
    """The sync debug mode's messages over two calls of fn."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sorted({str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)})


def calls(full, causal, sinks, B, length):
    """The calls of one shape, by name."""
    q = torch.randn(B, H, 1, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, HKV, length, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, HKV, length, D, device="cuda", dtype=torch.bfloat16)
    lengths = torch.full((B,), length, dtype=torch.int32, device="cuda")
    k_pages, v_pages, table = strategies.paged(k, v, 16, seed=1)
    sink_logits = torch.randn(H, device="cuda")
    return {
        "plain": lambda: full(q, k, v),
        "kv_len, same tensor": lambda: full(q, k, v, kv_len=lengths),
        "kv_len written each call": lambda: (lengths.add_(0), full(q, k, v, kv_len=lengths)),
        "causal, kv_len written each call": lambda: (lengths.add_(0), causal(q, k, v, kv_len=lengths)),
        "kv_len written each call, check_values=True":
            lambda: (lengths.add_(0), full(q, k, v, kv_len=lengths, check_values=True)),
        "paged 16, kv_len written each call":
            lambda: (lengths.add_(0), full(q, k_pages, v_pages, kv_len=lengths, page_table=table)),
        "sink, kv_len written each call":
            lambda: (lengths.add_(0), sinks(q, k, v, kv_len=lengths, sink_logits=sink_logits)),
        "cudnn": lambda: sdpa(q, k, v, enable_gqa=True),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    full = attngen.build("attention full\n")
    causal = attngen.build("attention causal\nmask: causal\n")
    sinks = attngen.build("attention sinks\ninput sink_logits: f32[H]\nsink: sink_logits[h]\n")
    rows = []
    torch.manual_seed(0)
    with torch.no_grad():
        for B, length in SHAPES:
            for name, fn in calls(full, causal, sinks, B, length).items():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION) if name == "cudnn" else contextlib.nullcontext():
                    row = {"B": B, "KV": length, "call": name, "host_us": round(host_us(fn), 1),
                           "idle_host_us": round(idle_us(fn), 1),
                           "eager_ms": round(triton.testing.do_bench(fn, warmup=25, rep=200), 4),
                           "graph_ms": round(triton.testing.do_bench(graphed(fn), warmup=25, rep=200), 4),
                           "syncs": syncs(fn)}
                row["eager_over_graph"] = round(row["eager_ms"] / row["graph_ms"], 3)
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.out:
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
