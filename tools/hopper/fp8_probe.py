"""Does Gluon's warpgroup_mma take e4m3 operands on sm_90, as a Hopper FP8 forward needs: S = Q K^T from shared
memory, then O = P V with P (e4m3) in registers (k_width=4) and V^T's [D, N] tile (N contiguous: K-major, as
8-bit wgmma requires) permuted to [N, D]? Compiles for sm_90 on the CPU and counts what the PTX does.

    python tools/hopper/fp8_probe.py

Triton 3.6 (2026-12-07): yes. 8 wgmma m64n128k32 e4m3 (4 with A in registers); P's accumulator-to-operand
conversion stays in registers (256 prmt, 20 shfl, no shared-memory round trip); a [128, 64] e4m3 tile is too
narrow for the 128-byte swizzle (BLOCK_N >= 128, or a 64-byte swizzle).
"""
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma
from triton.backends.compiler import GPUTarget

@gluon.jit
def k(Q, K, VT, O, M: gl.constexpr, N: gl.constexpr, D: gl.constexpr):
    blocked: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 32])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    rm = gl.arange(0, M, layout=gl.SliceLayout(1, blocked))
    rn = gl.arange(0, N, layout=gl.SliceLayout(1, blocked))
    rd = gl.arange(0, D, layout=gl.SliceLayout(0, blocked))
    rd_rows = gl.arange(0, D, layout=gl.SliceLayout(1, blocked))
    rn_cols = gl.arange(0, N, layout=gl.SliceLayout(0, blocked))
    q = gl.load(Q + gl.expand_dims(rm, 1) * D + gl.expand_dims(rd, 0))
    kk = gl.load(K + gl.expand_dims(rn, 1) * D + gl.expand_dims(rd, 0))
    vt = gl.load(VT + gl.expand_dims(rd_rows, 1) * N + gl.expand_dims(rn_cols, 0))
    q_s = gl.allocate_shared_memory(gl.float8e4nv, [M, D], smem, q)
    k_s = gl.allocate_shared_memory(gl.float8e4nv, [N, D], smem, kk)
    vt_s = gl.allocate_shared_memory(gl.float8e4nv, [D, N], smem, vt)
    fence_async_shared()
    s = warpgroup_mma(q_s, k_s.permute((1, 0)), gl.zeros([M, N], gl.float32, s_layout))
    p = gl.exp2(s - gl.expand_dims(gl.max(s, 1), 1))
    p8 = gl.convert_layout(p.to(gl.float8e4nv), p_layout)
    o = warpgroup_mma(p8, vt_s.permute((1, 0)), gl.zeros([M, D], gl.float32, o_layout))
    o = gl.convert_layout(o, blocked)
    gl.store(O + gl.expand_dims(rm, 1) * D + gl.expand_dims(rd, 0), o.to(gl.bfloat16))

sig = {"Q": "*fp8e4nv", "K": "*fp8e4nv", "VT": "*fp8e4nv", "O": "*bf16", "M": "constexpr", "N": "constexpr", "D": "constexpr"}
from triton.experimental.gluon._runtime import GluonASTSource
out = triton.compile(GluonASTSource(k, sig, {(4,): 64, (5,): 128, (6,): 128}), target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
ptx = out.asm["ptx"]
print("compiled", "wgmma" in ptx, [l.strip() for l in ptx.splitlines() if "wgmma.mma_async" in l][:2])
lines = [l.strip() for l in ptx.splitlines() if "wgmma.mma_async" in l]
print(len(lines), "wgmma;", sum("}, {" in l for l in lines), "with A in registers")
print("shfl", ptx.count("shfl.sync"), "prmt", ptx.count("prmt"), "st.shared", ptx.count("st.shared"), "ld.shared", ptx.count("ld.shared"), "cvt e4m3", ptx.count("e4m3x2.f32"))
