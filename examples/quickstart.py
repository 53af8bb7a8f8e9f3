"""Quickstart: write an attention variant in a few lines, build it, run it forward and backward.

    python examples/quickstart.py
"""

import torch

import attngen

SPEC = """
attention alibi_window                 # ALiBi biases inside a causal sliding window
param window = 64
input slopes: f32[H]
mask: causal and q - k < window
score: score + slopes[h] * (k - q)
"""


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"  # on the CPU: Triton's interpreter
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    B, H, N, D = 1, 4, 200, 64
    attn = attngen.build(SPEC, params={"window": 32})
    q, k, v = (torch.randn(B, H, N, D, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    slopes = 2.0 ** (-torch.arange(1, H + 1, device=device, dtype=torch.float32))
    out, lse = attn(q, k, v, slopes=slopes, return_lse=True)
    out.float().sum().backward()
    print(f"out {tuple(out.shape)} {out.dtype}, lse {tuple(lse.shape)}, |dq| = {q.grad.float().norm():.3f}")
    print(f"generated module: {attn.path}")


if __name__ == "__main__":
    main()
