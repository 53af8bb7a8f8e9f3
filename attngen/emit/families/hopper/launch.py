"""The Hopper family's host code: its per-call rule and its launch (plan.families.HOPPER)."""

import torch

from attngen.emit.static.shared import _DTYPES, _cdiv

# ---- inlined into every generated module from here on ----

# --- hopper family: the Gluon forward -----------------------------------------------------------
# The head dims its tiles are written for, and the dtypes its wgmma reads from shared memory.
HOPPER_HEAD_DIMS = (64, 128)
HOPPER_DTYPES = (torch.bfloat16, torch.float16)
# The kernels address q, k, v and out as (B * heads * N, D) matrices by TMA, whose coordinates are
# int32: every row, and a tile's overhang past the last one, must stay below 2**31.
HOPPER_MAX_ROWS = 2**31 - 256


def _hopper_serves(q, k, v, HKV, KV_LEN, cached):
    """Whether this forward call goes to the Hopper family (plan.families.HOPPER.per_call): not a
    cache call, bf16 or fp16 on the GPU, D = DV of a written tile, as many queries as keys, q, k, v
    contiguous (the TMA descriptors view them as (rows, D) matrices) and their rows int32-addressable."""
    B, H, Q_LEN, D = q.shape
    return (not cached and q.is_cuda and q.dtype in HOPPER_DTYPES and D in HOPPER_HEAD_DIMS
            and v.shape[-1] == D and Q_LEN == KV_LEN and B * H * Q_LEN <= HOPPER_MAX_ROWS
            and q.is_contiguous() and k.is_contiguous() and v.is_contiguous())


def _hopper_launch_config(block_m, pingpong):
    """(num_warps, maxnreg) of a launch: pingpong runs two 4-warp consumer warpgroups (the default
    partition and a worker) and a 1-warp producer; otherwise one consumer of block_m / 16 warps."""
    num_warps, worker_warps = (4, 4 + 1) if pingpong else (block_m // 16, 1)
    # Registers are granted per warpgroup: the 1-warp producer still takes a whole warpgroup's slots.
    # Cap the kernel so all warps (rounded up to warpgroups) fit the 64K-register file; setmaxnreg then
    # moves the producer down to HOPPER_PRODUCER_REGS and the consumers up to what is left.
    total_threads = (num_warps + _cdiv(worker_warps, 4) * 4) * 32
    return num_warps, min(256, (65536 // total_threads) // 8 * 8)


def _hopper_shared_layout(block_shape, torch_dtype):
    return gl.NVMMASharedLayout.get_default_for(block_shape, gl.bfloat16 if torch_dtype == torch.bfloat16 else gl.float16)


def _hopper_prepare(q, k, v, causal, sm_scale, block_m, block_n, stages, pingpong=True):
    """The outputs, the TMA descriptors and the grid of one call, built once; returns run() -> (out,
    lse), which only launches (the tools time it apart from the descriptors' host cost)."""
    B, H, N, D = q.shape
    HKV = k.shape[1]
    out = torch.empty_like(q)
    lse = torch.empty((B, H, N), device=q.device, dtype=torch.float32)
    num_warps, maxnreg = _hopper_launch_config(block_m, pingpong)
    rows = block_m // 2 if pingpong else block_m
    # 2-D views (B * heads * N, D): a tile that runs past a head's last row reads the next head's
    # first rows (masked) or TMA's zero fill at the tensor's end.
    q_desc = TensorDescriptor.from_tensor(q.view(B * H * N, D), [rows, D], _hopper_shared_layout([rows, D], q.dtype))
    k_desc = TensorDescriptor.from_tensor(k.view(B * HKV * N, D), [block_n, D],
                                          _hopper_shared_layout([block_n, D], q.dtype))
    v_desc = TensorDescriptor.from_tensor(v.view(B * HKV * N, D), [block_n, D],
                                          _hopper_shared_layout([block_n, D], q.dtype))
    o_desc = TensorDescriptor.from_tensor(out.view(B * H * N, D), [rows, D], _hopper_shared_layout([rows, D], q.dtype))
    grid = (_cdiv(N, block_m), B * H)

    def run():
        _hopper_fwd_kernel[grid](q_desc, k_desc, v_desc, o_desc, out, lse, float(sm_scale), N, H, H // HKV,
                                 HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages, CAUSAL=causal,
                                 PINGPONG=pingpong, num_warps=num_warps, maxnreg=maxnreg)
        return out, lse

    return run


def _hopper_forward(q, k, v, tensors, table, cache=None, page_table=None):
    """Runs the Gluon forward on a call _hopper_serves admitted (no cache, no table: the family serves
    no spec with inputs or a mask beyond causal). Returns out and the natural-log LSE, as the
    portable forward does; the backward kernels are the portable family's."""
    D = q.shape[-1]
    block_m, block_n, _, stages = FAMILY_TILES[(*_widths(D, D), _DTYPES[q.dtype])]["hopper"]
    return _hopper_prepare(q, k, v, HOPPER_CAUSAL, softmax_scale(D), block_m, block_n, stages)()
