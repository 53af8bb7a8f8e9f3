"""Each kernel's GPU time in an eager decoding call (torch.profiler, us a call, 20 calls after 5):

    python benchmarks/decode_kernels.py [LABEL]

Full attention, 32 query heads over 8 key/value heads, D=128 bf16, one query, at the three decode shapes of
issue 35: without kv_len ("plain"), with kv_len over a contiguous cache, over pages of 16, and a `sinks[h]`
spec with kv_len. LABEL (optional) starts each printed line, to tell runs of two trees apart.
"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

import attngen
from attngen.testing import strategies


def main() -> None:
    full = attngen.build("attention full\n")
    sinks = attngen.build("attention sinks\ninput sink_logits: f32[H]\nsink: sink_logits[h]\n")
    for B, L in ((8, 32768), (64, 4096), (1, 131072)):
        q = torch.randn(B, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, 8, L, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, 8, L, 128, device="cuda", dtype=torch.bfloat16)
        lengths = torch.full((B,), L, dtype=torch.int32, device="cuda")
        kp, vp, table = strategies.paged(k, v, 16, seed=1)
        logits = torch.randn(32, device="cuda")
        for name, fn in (("plain", lambda: full(q, k, v)), ("kv_len", lambda: full(q, k, v, kv_len=lengths)),
                         ("paged16", lambda: full(q, kp, vp, kv_len=lengths, page_table=table)),
                         ("sink", lambda: sinks(q, k, v, kv_len=lengths, sink_logits=logits))):
            with torch.no_grad():
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as trace:
                    for _ in range(20):
                        fn()
                    torch.cuda.synchronize()
            rows = {e.key[:24]: round(e.device_time_total / e.count, 1)
                    for e in trace.key_averages() if e.device_time_total > 0}
            print(sys.argv[1] if len(sys.argv) > 1 else "", B, L, name, rows, flush=True)


if __name__ == "__main__":
    main()
