"""Which Hopper launch of a packed call faults: runs one case per process (a fault poisons the CUDA
context), printing ok or the error. Usage: python tools/hopper/packed_probe.py [CASE]; no CASE runs all."""

import subprocess
import sys

import torch

CASES = ["dense_bwd", "packed_fwd", "packed_bwd_equal", "packed_bwd_ragged"]


def run(case):
    import attngen
    attn = attngen.build("specs/causal.attn")
    g = torch.Generator(device="cuda").manual_seed(0)
    if case == "dense_bwd":
        q, k, v = (torch.randn(2, 8, 512, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
                   for _ in range(3))
        attn(q, k, v).sum().backward()
    else:
        lengths = [256, 256] if case == "packed_bwd_equal" else [300, 1, 0, 700]
        total = sum(lengths)
        q, k, v = (torch.randn(total, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
                   for _ in range(3))
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        out = attn(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths), max_seqlen_k=max(lengths))
        if case != "packed_fwd":
            out.sum().backward()
    torch.cuda.synchronize()


if __name__ == "__main__":
    if len(sys.argv) > 1:
        run(sys.argv[1])
        print("ok")
    else:
        for case in CASES:
            r = subprocess.run([sys.executable, __file__, case], capture_output=True, text=True)
            tail = (r.stdout + r.stderr).strip().splitlines()
            print(f"{case}: {tail[-1] if tail else r.returncode}", flush=True)
