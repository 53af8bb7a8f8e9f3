"""The Hopper forward's host time with its per-stream work counter (families/hopper/runtime.py's
_hopper_work_counter) against a torch.zeros made for each call, the way it was before: causal, bf16, D=64,
forward calls back to back, the least of 15 rounds of 300 calls, the two ways taking turns.

    python tools/hopper/work_counter_ab.py
"""

from __future__ import annotations

import time

import torch

import attngen
from attngen.families.hopper import runtime as hopper


def main() -> None:
    kept = hopper._hopper_work_counter

    def fresh(device):
        return torch.zeros(2, dtype=torch.int32, device=device)

    attn = attngen.build("specs/causal.attn")
    try:
        for B, H, N, D in ((2, 16, 512, 64), (1, 8, 128, 64)):
            q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            best = {"per-stream counter": float("inf"), "torch.zeros a call": float("inf")}
            with torch.no_grad():
                for _ in range(50):
                    attn(q, k, v)
                for _ in range(15):
                    for name, counter in zip(best, (kept, fresh)):
                        hopper._hopper_work_counter = counter
                        torch.cuda.synchronize()
                        start = time.perf_counter()
                        for _ in range(300):
                            attn(q, k, v)
                        torch.cuda.synchronize()
                        best[name] = min(best[name], (time.perf_counter() - start) / 300 * 1e6)
            times = ", ".join(f"{name} {us:.1f} us" for name, us in best.items())
            print(f"B{B} H{H} N{N} D{D} ({attn.forward_family(q, k, v)}): {times} a forward", flush=True)
    finally:
        hopper._hopper_work_counter = kept


if __name__ == "__main__":
    main()
