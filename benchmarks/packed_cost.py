"""What a packed batch costs: attngen's packed call (FlashAttention's varlen layout) against the same
tokens as one long sequence under a document mask, in attngen and in FlexAttention (its document
BlockMask), with cuDNN on the sequences padded to a batch for scale.

    python benchmarks/packed_cost.py [--json FILE] [--kernels] [--only CASE]

--kernels also prints where each attngen call's GPU time goes: every kernel's microseconds per
forward+backward call, under torch.profiler (benchmarks/kernel_times.py's measure).

A packed call's grid follows the sequences, so it should cost what its sequences cost (for equal lengths,
the dense batch of them, timed beside it); the document mask visits the block diagonal of the whole
batch (tile tables skip the rest), and padding computes the longest sequence's tiles for every sequence. Each row: forward and forward+backward median ms
(triton.testing.do_bench), bf16, H = 16, D = 128, and TFLOP/s counted on the allowed pairs only.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import flex_attention

import attngen
from kernel_times import kernel_times  # benchmarks/ is the script's folder, first on sys.path
H, D = 16, 128
# (name, mask, sequence lengths): a training stack's packed batches of 16k tokens, documents of mixed length.
CASES = [
    ("16 x 1k causal", "causal", [1024] * 16),
    ("mixed 16k causal", "causal", [3000, 517, 4096, 129, 2048, 1, 1800, 2500, 1000, 1273, 12]),
    ("mixed 16k full", "full", [3000, 517, 4096, 129, 2048, 1, 1800, 2500, 1000, 1273, 12]),
]

# The same batch as one sequence: a token attends (causally) within its own document.
DOCUMENT_MASK = """attention document_{mask}
input doc: i32[KV_LEN]
mask: doc[q] == doc[k]{causal}
"""


def _time(call, leaves, dout, backward):
    if not backward:
        with torch.no_grad():
            return triton.testing.do_bench(call, warmup=25, rep=200)

    def step():
        torch.autograd.grad(call(), leaves, dout)
    return triton.testing.do_bench(step, warmup=25, rep=200)


def _pairs(lengths, causal):
    return sum(n * (n + 1) // 2 if causal else n * n for n in lengths)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument("--kernels", action="store_true", help="each attngen call's kernels' GPU times too")
    parser.add_argument("--only", help="the one case to run (its name, e.g. '16 x 1k causal')")
    args = parser.parse_args()
    flex_kernel = torch.compile(flex_attention)
    rows = []
    for name, mask, lengths in CASES:
        if args.only and name != args.only:
            continue
        causal = mask == "causal"
        total, longest = sum(lengths), max(lengths)
        g = torch.Generator(device="cuda").manual_seed(0)
        # q, k, v as a model's fused projection gives them: (TOTAL, 3, H, D) unbound.
        fused = torch.randn(total, 3, H, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        q, k, v = fused.unbind(1)
        offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        dout = torch.randn(total, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
        calls = {}

        packed_attn = attngen.build(f"specs/{mask}.attn")
        packed = dict(cu_seqlens_q=offsets, cu_seqlens_k=offsets, max_seqlen_q=longest, max_seqlen_k=longest)
        calls["attngen packed"] = (lambda: packed_attn(q, k, v, **packed), [fused], dout)

        # The same tokens as one sequence (1, H, TOTAL, D) with a document mask.
        doc_spec = DOCUMENT_MASK.format(mask=mask, causal=" and causal" if causal else "")
        doc_attn = attngen.build(doc_spec)
        doc = torch.repeat_interleave(torch.arange(len(lengths), device="cuda", dtype=torch.int32),
                                      torch.tensor(lengths, device="cuda"))
        views = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
        doc_dout = dout.transpose(0, 1).unsqueeze(0)
        calls["attngen document mask"] = (lambda: doc_attn(*views, doc=doc), [fused], doc_dout)
        flex_kwargs = attngen.to_flex(doc_spec).kwargs(views[0], views[1], doc=doc)  # its BlockMask, built once
        calls["flex document BlockMask"] = (lambda: flex_kernel(*views, **flex_kwargs), [fused], doc_dout)

        if len(set(lengths)) == 1:  # equal lengths are a dense batch: what the packed call should cost
            batch = [t.unflatten(0, (len(lengths), longest)).transpose(1, 2) for t in (q, k, v)]
            calls["attngen dense batch"] = (lambda: packed_attn(*batch), [fused],
                                            dout.unflatten(0, (len(lengths), longest)).transpose(1, 2))

        # cuDNN on the sequences padded to (B, H, longest, D): what a padded batch costs.
        padded = [torch.randn(len(lengths), H, longest, D, device="cuda", dtype=torch.bfloat16,
                              generator=g).requires_grad_() for _ in range(3)]
        pad_dout = torch.randn_like(padded[0])

        def cudnn_padded():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(*padded, is_causal=causal)
        calls["cuDNN padded batch"] = (cudnn_padded, padded, pad_dout)

        # The exact answer first: the packed call against the document-mask call on the same tokens.
        with torch.no_grad():
            as_one = calls["attngen document mask"][0]()[0].transpose(0, 1)
            torch.testing.assert_close(calls["attngen packed"][0](), as_one, rtol=2e-2, atol=2e-2)
        families = (packed_attn.forward_family(q, k, v, **packed), packed_attn.backward_family(q, k, v, **packed))
        fwd_flop = 4 * _pairs(lengths, causal) * H * D
        row = {"case": name, "lengths": lengths, "H": H, "D": D, "packed families": families}
        for impl, (call, leaves, grad) in calls.items():
            for part, backward in (("fwd", False), ("fwd+bwd", True)):
                try:
                    ms = _time(call, leaves, grad, backward)
                except RuntimeError as e:
                    print(f"  {impl} {part}: {str(e).splitlines()[0]}")
                    ms = float("nan")
                row[f"{impl} {part} ms"] = ms
                flop = fwd_flop * (3.5 if backward else 1.0)
                row[f"{impl} {part} TFLOP/s"] = flop / ms / 1e9
        rows.append(row)
        if args.kernels:
            for impl in ("attngen packed", "attngen document mask"):
                call, _, grad = calls[impl]
                times = kernel_times(lambda call=call, grad=grad: call().backward(grad))
                row[f"{impl} fwd+bwd kernels us"] = times
                print(f"{name}, {impl}, forward+backward: {sum(times.values()):.1f} us of kernels per call")
                for kernel, us in times.items():
                    print(f"  {us:9.1f}  {kernel}")
        print(f"{name} (packed families {families}):")
        for impl in calls:
            print(f"  {impl:26s} fwd {row[f'{impl} fwd ms']:7.3f} ms ({row[f'{impl} fwd TFLOP/s']:5.0f} TFLOP/s)"
                  f"  fwd+bwd {row[f'{impl} fwd+bwd ms']:7.3f} ms ({row[f'{impl} fwd+bwd TFLOP/s']:5.0f} TFLOP/s)",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "triton": triton.__version__,
                       "gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
