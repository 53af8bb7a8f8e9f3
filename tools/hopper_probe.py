"""Probe for the Hopper family's forward kernel: TMA descriptors (host-side, 4-D, so any batch/head
strides work and out-of-range rows read as zeros), with and without automatic warp specialization,
against the portable kernel's loop structure. Prints correctness against SDPA's math backend and
times beside FlexAttention and cuDNN. Run on the GPU: python tools/hopper_probe.py"""

import math
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _inner(acc, l_i, m_i, q, desc_k, desc_v, j_lo, j_hi, n_masked, gap_at, gap, offs_m, qk_scale, KV_LEN,
           BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, WS: tl.constexpr,
           ONE_LOOP: tl.constexpr):
    # ONE_LOOP: masked tiles (numbers j_lo .. j_lo + n_masked, skipping the gap) then full ones, in
    # one loop: automatic warp specialization (triton 3.6) takes one loop per kernel.
    for j in tl.range(j_lo, j_hi, warp_specialize=WS):
        if ONE_LOOP:
            start_n = tl.where(j >= gap_at, j + gap, j) * BLOCK_N
            masked = j < j_lo + n_masked
        else:
            start_n = j * BLOCK_N
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = desc_k.load([start_n, 0])
        qk = tl.dot(q, k.T)
        s2 = qk * qk_scale
        if MASKED:
            allowed = offs_n[None, :] < KV_LEN
            if CAUSAL:
                allowed = allowed & (offs_m[:, None] >= offs_n[None, :])
            if ONE_LOOP:
                allowed = allowed | (not masked)
            s2 = tl.where(allowed, s2, float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(s2, 1))
        m_safe = tl.where(m_ij == float("-inf"), 0.0, m_ij)
        p = tl.exp2(s2 - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = desc_v.load([start_n, 0])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit
def _fwd(Q, K, V, O, Lse, qk_scale, H, HKV, Q_LEN, KV_LEN, stride_qz, stride_qh, stride_qm, stride_kz, stride_kh,
         stride_kn, stride_vz, stride_vh, stride_vn, stride_oz, stride_oh, stride_om, HEAD_DIM, HEAD_DIM_V,
         HEAD_DIM_PAD: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
         CAUSAL: tl.constexpr, WS: tl.constexpr):
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = off_bh // H
    off_h = off_bh % H
    off_hkv = off_h // (H // HKV)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    # Per-head 2-D descriptors: rows past the length and columns past the head dim read as zeros.
    desc_q = tl.make_tensor_descriptor(Q + off_b.to(tl.int64) * stride_qz + off_h.to(tl.int64) * stride_qh,
                                       [Q_LEN, HEAD_DIM], [stride_qm, 1], [BLOCK_M, HEAD_DIM_PAD])
    desc_k = tl.make_tensor_descriptor(K + off_b.to(tl.int64) * stride_kz + off_hkv.to(tl.int64) * stride_kh,
                                       [KV_LEN, HEAD_DIM], [stride_kn, 1], [BLOCK_N, HEAD_DIM_PAD])
    desc_v = tl.make_tensor_descriptor(V + off_b.to(tl.int64) * stride_vz + off_hkv.to(tl.int64) * stride_vh,
                                       [KV_LEN, HEAD_DIM_V], [stride_vn, 1], [BLOCK_N, HEAD_DIM_V_PAD])
    desc_o = tl.make_tensor_descriptor(O + off_b.to(tl.int64) * stride_oz + off_h.to(tl.int64) * stride_oh,
                                       [Q_LEN, HEAD_DIM_V], [stride_om, 1], [BLOCK_M, HEAD_DIM_V_PAD])
    q = desc_q.load([start_m * BLOCK_M, 0])
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_V_PAD], dtype=tl.float32)
    n_tiles = (KV_LEN + BLOCK_N - 1) // BLOCK_N
    if CAUSAL:
        hi = tl.minimum(n_tiles, ((start_m + 1) * BLOCK_M + BLOCK_N - 1) // BLOCK_N)
        full_hi = tl.minimum((start_m * BLOCK_M + 1) // BLOCK_N, KV_LEN // BLOCK_N)
    else:
        hi = n_tiles
        full_hi = KV_LEN // BLOCK_N
    if WS:
        # masked tiles [full_hi, hi) first, then the full ones [0, full_hi), in one loop
        acc, l_i, m_i = _inner(acc, l_i, m_i, q, desc_k, desc_v, 0, hi, hi - full_hi, 0, full_hi, offs_m,
                               qk_scale, KV_LEN, BLOCK_N, True, CAUSAL, True, True)
    else:
        acc, l_i, m_i = _inner(acc, l_i, m_i, q, desc_k, desc_v, 0, full_hi, 0, 0, 0, offs_m, qk_scale,
                               KV_LEN, BLOCK_N, False, CAUSAL, False, False)
        acc, l_i, m_i = _inner(acc, l_i, m_i, q, desc_k, desc_v, full_hi, hi, 0, 0, 0, offs_m, qk_scale,
                               KV_LEN, BLOCK_N, True, CAUSAL, False, False)
    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    acc = acc / l_safe[:, None]
    lse = tl.where(has_keys, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    desc_o.store([start_m * BLOCK_M, 0], acc.to(desc_o.dtype))
    tl.store(Lse + off_bh.to(tl.int64) * Q_LEN + offs_m, lse, mask=offs_m < Q_LEN)


def run(q, k, v, causal, bm, bn, warps, stages, ws):
    B, H, N, D = q.shape
    HKV, KV, DV = k.shape[1], k.shape[2], v.shape[3]
    out = torch.empty((B, H, N, DV), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, N), dtype=torch.float32, device=q.device)
    _fwd[(triton.cdiv(N, bm), B * H)](q, k, v, out, lse, 1.4426950408889634 / math.sqrt(D), H, HKV, N, KV,
                                      *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
                                      D, DV, D, DV, bm, bn, causal, ws, num_warps=warps, num_stages=stages)
    return out


def bench(fn):
    return triton.testing.do_bench(fn, warmup=50, rep=300)


def main():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    flex = torch.compile(flex_attention)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    torch.manual_seed(0)
    import attngen
    portable = {c: attngen.build(f"specs/{'causal' if c else 'full'}.attn", target="h200") for c in (False, True)}
    configs = [(128, 128, 8, 3, False), (128, 128, 4, 2, True), (128, 64, 4, 2, True), (128, 128, 4, 3, True),
               (128, 128, 8, 2, False), (128, 64, 8, 3, False)]
    for (B, H, N, D, causal) in [(4, 16, 4096, 128, False), (4, 16, 4096, 128, True), (4, 16, 8192, 64, True),
                                 (2, 16, 1000, 128, True)]:
        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
        flops = 4 * B * H * N * N * D / (2 if causal else 1)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            t_cudnn = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal))
        bm_ = create_block_mask((lambda b, h, qi, ki: qi >= ki) if causal else (lambda b, h, qi, ki: qi >= 0),
                                None, None, N, N)
        t_flex = bench(lambda: flex(q, k, v, block_mask=bm_))
        print(f"B{B} H{H} N{N} D{D} causal={causal}: cuDNN {t_cudnn:.3f} ms ({flops / t_cudnn / 1e9:.0f} TF/s), "
              f"Flex {t_flex:.3f}", flush=True)
        out = portable[causal](q, k, v)
        t = bench(lambda: portable[causal](q, k, v))
        print(f"  attngen portable: {t:.3f} ms {flops / t / 1e9:.0f} TF/s err {(out.float() - ref).abs().max().item():.2e} "
              f"vs cuDNN {t_cudnn / t:.3f} vs Flex {t_flex / t:.3f}", flush=True)
        for cfg in configs:
            try:
                out = run(q, k, v, causal, *cfg)
                err = (out.float() - ref).abs().max().item()
                nan = torch.isnan(out).any().item()
                t = bench(lambda: run(q, k, v, causal, *cfg))
                print(f"  {cfg}: {t:.3f} ms {flops / t / 1e9:.0f} TF/s  err {err:.2e} nan {nan}  "
                      f"vs cuDNN {t_cudnn / t:.3f} vs Flex {t_flex / t:.3f}", flush=True)
            except Exception as e:  # a probe: report and go on
                print(f"  {cfg}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
