"""Per-kernel GPU time of one forward+backward step, attngen beside FlexAttention, from torch.profiler:
shows which kernel a gap comes from.

    python benchmarks/kernel_times.py [--n 8192] [--only sliding_window ...]
"""

from __future__ import annotations

import argparse
import collections
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from sparsity_bench import variants  # noqa: E402

import attngen  # noqa: E402
from attngen import testing  # noqa: E402

STEPS = 10


def kernel_times(fn) -> dict[str, float]:
    """Mean milliseconds per step of each CUDA kernel `fn` launches."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            fn()
        torch.cuda.synchronize()
    times: dict[str, float] = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name[:60]] += event.device_time / 1e3 / STEPS
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def main() -> None:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--only", nargs="*", default=["sliding_window", "document_causal"])
    args = parser.parse_args()
    B, H, N, D = 2, 16, args.n, 128
    q, k, v = testing.random_qkv(B, H, H, N, N, D, D, torch.bfloat16, device="cuda", seed=2)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    do = torch.randn_like(q)
    for name in args.only:
        torch._dynamo.reset()
        flex = torch.compile(flex_attention, dynamic=False)
        path, params, mask_mod, inputs = variants(B, H, N, "cuda")[name]
        attn = attngen.build(path, params=params)
        mask = create_block_mask(mask_mod, B, H, N, N, device="cuda")
        for label, fn in (("attngen", lambda: attn(q, k, v, **inputs).backward(do)),
                          ("flex", lambda: flex(q, k, v, block_mask=mask).backward(do))):
            times = kernel_times(fn)
            print(f"{name} {label}: total {sum(times.values()):.3f} ms")
            for kernel, ms in times.items():
                if ms > 0.005:
                    print(f"    {ms:8.3f}  {kernel}")


if __name__ == "__main__":
    main()
