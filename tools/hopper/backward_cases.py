"""GPU times of the Hopper backward on the cases its tile rules tell apart (head dim 64 plain, with dropout and
packed; causal at 64 and 128; full at 128; a score and a tile table at 64 and 128), for one version of attngen
(PYTHONPATH): run it once per version in the same device call to compare them side by side.

    PYTHONPATH=/tmp/old python tools/hopper/backward_cases.py --label old --out old.json
    PYTHONPATH=$PWD     python tools/hopper/backward_cases.py --label new --out new.json --cudnn

Each case's forward and forward+backward are timed by their kernels' GPU time (attngen.bench.kernel_ms), the
backward being the difference; its rate counts 2.5 times the forward's FLOPs over the allowed pairs
(bench.count_flops). --cudnn times SDPA's cuDNN backend beside each case SDPA can run (bench.sdpa_is_causal:
full and causal), dense and without dropout; --only-dropout keeps the dropout cases.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

import attngen
from attngen import bench, testing

# (spec, B, H, HKV, N, D, dropout_p, packed)
CASES = [("full", 2, 32, 32, 8192, 64, 0.0, False), ("full", 4, 16, 16, 4096, 64, 0.1, False),
         ("full", 8, 16, 16, 2048, 64, 0.0, True), ("causal", 4, 16, 16, 4096, 64, 0.0, False),
         ("causal", 2, 32, 32, 8192, 64, 0.0, False), ("alibi_causal", 4, 16, 16, 4096, 64, 0.0, False),
         ("document_causal", 4, 16, 16, 4096, 64, 0.0, False), ("alibi_causal", 2, 16, 16, 8192, 128, 0.0, False),
         ("causal", 2, 16, 16, 8192, 128, 0.0, False), ("full", 2, 16, 16, 8192, 128, 0.0, False)]


def _times(call, dout, leaves) -> tuple[float, float]:
    """(forward ms, backward ms) by GPU time."""
    def forward_backward():
        out = call()
        out.backward(dout)
        return out
    with torch.no_grad():
        call()
        forward = bench.kernel_ms(call)
    forward_backward()
    both = bench.kernel_ms(forward_backward, before=lambda: [setattr(x, "grad", None) for x in leaves])
    return forward, both - forward


def run_case(spec, B, H, HKV, N, D, p, packed, cudnn) -> dict:
    attn = attngen.build(f"specs/{spec}.attn")
    keywords = {}
    if packed:  # B sequences of N tokens each
        q, k, v = (torch.randn(B * N, heads, D, device="cuda", dtype=torch.bfloat16) for heads in (H, HKV, HKV))
        offsets = torch.arange(0, B * N + 1, N, dtype=torch.int32, device="cuda")
        keywords = dict(cu_seqlens_q=offsets, cu_seqlens_k=offsets, max_seqlen_q=N, max_seqlen_k=N)
    else:
        q, k, v = testing.random_qkv(B, H, HKV, N, N, D, D, torch.bfloat16, device="cuda")
        keywords = testing.random_inputs(attn.spec, B, H, HKV, N, N, device="cuda")
    leaves = [t.requires_grad_() for t in (q, k, v)]
    dout = torch.randn_like(q)
    forward, backward = _times(lambda: attn(q, k, v, dropout_p=p, **keywords), dout, leaves)
    # The backward's FLOPs over the mask's allowed pairs (a packed call's B sequences of N count as a batch of B).
    counted = bench.count_flops(attn.spec, bench.Problem(B, H, HKV, N, N, D, "bf16"), None if packed else keywords,
                                device="cuda")
    backward_flops = counted.forward_backward - counted.forward
    row = dict(case=f"{spec} B{B} H{H}/{HKV} N{N} D{D} dropout_p {p}{' packed' if packed else ''}",
               fwd_ms=round(forward, 4), bwd_ms=round(backward, 4),
               bwd_tflops=round(backward_flops / (backward * 1e-3) / 1e12),
               family=attn.backward_family(q, k, v, **keywords))
    is_causal, _ = bench.sdpa_is_causal(attn.spec, N, N)  # None: SDPA cannot run the spec
    if cudnn and not packed and not p and is_causal is not None:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention

        def sdpa():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=H != HKV)
        forward, backward = _times(sdpa, dout, leaves)
        row.update(cudnn_fwd_ms=round(forward, 4), cudnn_bwd_ms=round(backward, 4),
                   cudnn_bwd_tflops=round(backward_flops / (backward * 1e-3) / 1e12))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="attngen")
    parser.add_argument("--out", required=True)
    parser.add_argument("--cudnn", action="store_true")
    parser.add_argument("--only-dropout", action="store_true")
    args = parser.parse_args()
    rows = []
    for case in CASES:
        if args.only_dropout and not case[6]:
            continue
        row = dict(label=args.label, **run_case(*case, args.cudnn))
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                       rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
