"""Which Hopper launch of a packed call faults: runs one case per process (a fault poisons the CUDA
context), printing ok or the error. Usage: python tools/hopper/packed_probe.py [CASE ...]; no CASE runs
CASES. A case is `dense:B,H,Q_LEN,KV_LEN` or `packed[_fwd]:LEN,LEN,...` (q and k of the same lengths)."""

import subprocess
import sys

import torch

CASES = ["dense:2,8,512,512", "dense:1,4,129,300", "dense:2,8,1000,1000", "packed_fwd:300,1,0,700",
         "packed:256,256", "packed:300,300", "packed:256,1", "packed:256,0", "packed:1,256", "packed:300,700",
         "packed:300,1,0,700"]


def run(case, spec="specs/causal.attn"):
    import attngen
    attn = attngen.build(spec)
    kind, sizes = case.split(":")
    sizes = [int(s) for s in sizes.split(",")]
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()

    if kind == "dense":
        B, H, Q_LEN, KV_LEN = sizes
        q, k, v = randn(B, H, Q_LEN, 128), randn(B, H, KV_LEN, 128), randn(B, H, KV_LEN, 128)
        attn(q, k, v).sum().backward()
    else:
        total = sum(sizes)
        q, k, v = (randn(total, 8, 128) for _ in range(3))
        cu = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        packed = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(sizes), max_seqlen_k=max(sizes))
        print(attn.forward_family(q, k, v, **packed), attn.backward_family(q, k, v, **packed))
        out = attn(q, k, v, **packed)
        if kind == "packed":
            out.sum().backward()
    torch.cuda.synchronize()


if __name__ == "__main__":
    if len(sys.argv) == 2:
        run(sys.argv[1])
        print("ok")
    else:
        for case in sys.argv[1:] or CASES:
            r = subprocess.run([sys.executable, __file__, case], capture_output=True, text=True)
            tail = (r.stdout + r.stderr).strip().splitlines()
            print(f"{case}: {tail[-1] if tail else r.returncode}", flush=True)
