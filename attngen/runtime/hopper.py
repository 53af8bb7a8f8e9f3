"""The Hopper family's host side: its per-call rules, TMA descriptors and the launches of its Gluon kernels."""

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .helpers import LOG2E
from .launch import _launch
from .plans import _plan_site
from .portable import _call_sizes, _in_input_dtypes, _packed_launch, _sizes, _sm_count
from .shared import _cdiv, _empty_in_layout


# The dtypes its wgmma reads from shared memory, and the head dims its tiles take: TMA boxes are the
# padded widths (zero-filled past the head dim on loads, clipped on stores), rows must be 16-byte
# multiples (8 elements), and below 64 the padding would double the work.
HOPPER_DTYPES = (torch.bfloat16, torch.float16)
HOPPER_HEAD_DIMS = range(64, 257, 8)
# The kernels address q, k, v and out by TMA as (B, heads, length, D) tensors, whose coordinates are
# int32: a row, and a tile's overhang past a head's last one, must stay below 2**31.
HOPPER_MAX_LENGTH = 2**31 - 256
# TMA's bounds on a tensor's layout: a 16-byte-aligned base, the last dim dense, the other strides
# multiples of 16 bytes below 2**40 (cuTensorMapEncodeTiled).
HOPPER_TMA_ALIGN = 16
HOPPER_TMA_MAX_STRIDE = 2**40


# Per device: whether it is a Hopper GPU. A module built for --target h100/h200 on another machine may
# be run on any GPU; the family's kernels compile for sm_90 only.
_HOPPER_DEVICES = {}


def _hopper_device(device):
    if device not in _HOPPER_DEVICES:
        _HOPPER_DEVICES[device] = torch.cuda.get_device_capability(device)[0] == 9
    return _HOPPER_DEVICES[device]


def _hopper_tma_strides(t):
    """The strides of t's TMA descriptor: its own (any layout: a transposed (B, length, heads, D) view
    costs nothing), except that a dim of size 1, which TMA never steps, gets a stride TMA takes (the
    last dim's size: 16-byte multiples for the tensors _hopper_addressable admits)."""
    strides = t.stride()
    if 1 in t.shape:
        strides = tuple(stride if size > 1 else (t.shape[-1] if i < t.dim() - 1 else 1)
                        for i, (size, stride) in enumerate(zip(t.shape, strides)))
    return strides


def _hopper_addressable(t):
    """Whether TMA can address t in _hopper_tma_strides: a 16-byte-aligned base, the last stride 1, the
    others positive multiples of 16 bytes below 2**40."""
    strides = _hopper_tma_strides(t)
    step = HOPPER_TMA_ALIGN // t.element_size()
    return (t.data_ptr() % HOPPER_TMA_ALIGN == 0 and strides[-1] == 1
            and all(0 < s < HOPPER_TMA_MAX_STRIDE // t.element_size() and s % step == 0 for s in strides[:-1]))


def _hopper_launch_config(block_m, pingpong):
    """(num_warps, maxnreg) of a launch: pingpong runs two 4-warp consumer warpgroups (the default
    partition and a worker) and a 1-warp producer; otherwise one consumer of block_m / 16 warps."""
    num_warps, worker_warps = (4, 4 + 1) if pingpong else (block_m // 16, 1)
    # Registers are granted per warpgroup: the 1-warp producer still takes a whole warpgroup's slots.
    # Cap the kernel so all warps (rounded up to warpgroups) fit the 64K-register file; setmaxnreg then
    # moves the producer down to HOPPER_PRODUCER_REGS and the consumers up to what is left.
    total_threads = (num_warps + _cdiv(worker_warps, 4) * 4) * 32
    return num_warps, min(256, (65536 // total_threads) // 8 * 8)


def _hopper_backward_config(block_n, warps):
    """(num_warps, maxnreg, SPLIT_D) of a backward launch of `warps` consumer warps over key tiles of block_n:
    one consumer partition, a 16-key slab a warp; where the warps outnumber the tile's slabs (64-key tiles,
    head dims above 128), two warpgroups side by side split the head dims' columns (SPLIT_D)."""
    return (*_hopper_launch_config(16 * warps, False), 16 * warps > block_n)


class _HopperDescriptor(TensorDescriptor):
    """A TMA descriptor without TensorDescriptor's checks, which cost ~5 us each on the host and a call
    builds up to seven: the family builds descriptors only of tensors its per-call rule admitted or that
    it allocated (16-byte aligned bases, rows of 16-byte multiples, sizes of at least 1), in boxes of its
    tiles (tests/test_hopper.py runs the checks on them)."""

    def __post_init__(self):
        pass


def _hopper_tile_box(rows, width):
    """The TMA box of one head's `rows` rows and `width` columns of a (B, heads, length, D) tensor."""
    return [1, 1, rows, width]


def _hopper_descriptor(t, rows, width):
    """A TMA descriptor of t (B, heads, length, D) in its own strides (_hopper_tma_strides), read and
    written in boxes of _hopper_tile_box (zero-filled past the head's length and D on loads, clipped there
    on stores and reductions)."""
    box = _hopper_tile_box(rows, width)
    return _HopperDescriptor(t, t.shape, _hopper_tma_strides(t), box, _hopper_layout(box, t.dtype))


def _hopper_row_descriptor(t, rows):
    """A TMA descriptor of t (B, H, rows padded to whole tiles) fp32 as (B * H, padded rows), in boxes of
    one head's `rows` rows."""
    box = [1, rows]
    view = t.view(-1, t.shape[-1])
    return _HopperDescriptor(view, view.shape, view.stride(), box, _hopper_layout(box, t.dtype))


# The shared-memory layout of each box shape and dtype, computed once: get_default_for is pure Python
# and took a sixth of a call's host time on the H200 (tools/hopper/host_overhead.py).
_HOPPER_LAYOUTS = {}


def _hopper_sequence_rows(rows, packed, fill, block_m):
    """A packed call's row terms (1, H, rows) fp32, moved so that sequence b's rows start at column
    4 * (cu_seqlens_q[b] // 4 + b), 16-byte aligned as TMA reads them (the backward kernel's row_start),
    the columns between sequences `fill`; padded to whole query tiles. Made on the device, no sync."""
    cu, TOTAL_Q = packed[0], packed[4]
    B = cu.shape[0] - 1
    starts = cu[:-1].long()
    sequence = torch.repeat_interleave(torch.arange(B, device=cu.device), cu[1:] - cu[:-1], output_size=TOTAL_Q)
    columns = torch.arange(TOTAL_Q, device=cu.device) + 4 * sequence - (starts % 4)[sequence]
    moved = rows.new_full((*rows.shape[:2], _cdiv(TOTAL_Q + 4 * B, block_m) * block_m), fill)
    moved[..., columns] = rows[..., :TOTAL_Q]
    return moved


def _hopper_layout(block_shape, dtype):
    key = (*block_shape, dtype)
    if key not in _HOPPER_LAYOUTS:
        element = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]
        _HOPPER_LAYOUTS[key] = gl.NVMMASharedLayout.get_default_for(list(block_shape), element)
    return _HOPPER_LAYOUTS[key]


# Elements of dQ a program of _hopper_dq_finish scales and rounds: 16 a thread of 4 warps.
HOPPER_DQ_FINISH_BLOCK = 2048


class HopperFamily:
    """The Hopper family (plan.families.HOPPER) serving the Attention `rt`: its Gluon forward, its backward
    and dQ's finishing pass; plain_score is the emitter's word that the score is the plain scaled dot
    product (the forward may then scale once per tile: DEFER_SCALE)."""

    def __init__(self, rt, forward_kernel, backward_kernel, dq_finish_kernel, plain_score):
        self.rt = rt
        self.forward_kernel, self.backward_kernel = forward_kernel, backward_kernel
        self.dq_finish_kernel, self.plain_score = dq_finish_kernel, plain_score

    def serves(self, q, k, v, HKV, KV_LEN, cached):
        """Whether this forward call goes to the Hopper family (plan.families.HOPPER.per_call): not a
        cache call, bf16 or fp16 on a Hopper GPU, head dims of HOPPER_HEAD_DIMS, q, k, v in layouts TMA
        addresses (_hopper_addressable: any strides of 16-byte multiples), lengths int32-addressable."""
        B, H, Q_LEN, D = q.shape
        return (not cached and q.is_cuda and q.dtype in HOPPER_DTYPES and _hopper_device(q.device)
                and D in HOPPER_HEAD_DIMS and v.shape[-1] in HOPPER_HEAD_DIMS and max(Q_LEN, KV_LEN) <= HOPPER_MAX_LENGTH
                and all(_hopper_addressable(t) for t in (q, k, v)))

    def backward_serves(self, q, k, v):
        """Whether this call's backward goes to the Hopper family (plan.families.HOPPER.per_call): a call
        whose forward it could serve (every head dim: above 128 on tiles of its own, _hopper_backward_config)."""
        return self.serves(q, k, v, k.shape[1], k.shape[2], False)

    def prepare(self, q, k, v, tensors, table, block_m, block_n, stages, q_buffers=1, pingpong=True, plan=None,
                        packed=None):
        """The outputs, the TMA descriptors and the grid of one call, built once; returns run() -> (out,
        lse), which only launches (the tools time it apart from the descriptors' host cost). `table` is
        the call's tile table for these tiles, () without one; `q_buffers` the Q tiles a CTA holds (the
        plan's: 2 where shared memory has room); `plan` the call's _CallPlan; `packed` a packed call's
        (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, TOTAL_Q), whose q, k and v are (1, heads,
        TOTAL, D) views (_packed_view), or None."""
        D, DV = q.shape[3], v.shape[3]
        B, H, HKV, Q_LEN, KV_LEN = _call_sizes(q, k, packed)
        d_pad, dv_pad = self.rt._widths(D, DV)
        out = _empty_in_layout(q, DV)
        lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
        num_warps, maxnreg = _hopper_launch_config(block_m, pingpong)
        rows = block_m // 2 if pingpong else block_m
        q_desc, k_desc = _hopper_descriptor(q, rows, d_pad), _hopper_descriptor(k, block_n, d_pad)
        v_desc, o_desc = _hopper_descriptor(v, block_n, dv_pad), _hopper_descriptor(out, rows, dv_pad)
        # Persistent: one CTA an SM, at most one a work item (_hopper_fwd_work), taking items from a counter
        # (and counting the CTAs done, to set it back to zero at the end: run() may launch again).
        grid = (min(_cdiv(Q_LEN, block_m) * B * H, _sm_count(q.device)),)
        work_counter = torch.zeros(2, dtype=torch.int32, device=q.device)
        sm_scale = self.rt.facts.softmax_scale(D)
        table_args = self.rt._table_args((True, block_m, block_n), table, _sizes(q, k), placeholder=lse)
        packed_args, packed_flags = _packed_launch(packed, lse)

        def run():
            _launch(self.forward_kernel, grid, q_desc, k_desc, v_desc, o_desc, out, *out.stride()[:3], lse, work_counter,
                    sm_scale, sm_scale * LOG2E.value, *self.rt._input_args(tensors), *table_args, B, H, HKV, Q_LEN, KV_LEN,
                    *packed_args, HEAD_DIM=D, HEAD_DIM_V=DV, HEAD_DIM_PAD=d_pad, HEAD_DIM_V_PAD=dv_pad, BLOCK_M=block_m,
                    BLOCK_N=block_n, STAGES=stages, Q_BUFFERS=q_buffers, PINGPONG=pingpong, FOLLOW_TABLE=bool(table),
                    DEFER_SCALE=self.plain_score and sm_scale > 0, num_warps=num_warps, maxnreg=maxnreg,
                    bind=_plan_site(plan, "hopper", bool(table)), **packed_flags)
            return out, lse

        return run

    def forward(self, q, k, v, tensors, table, cache=None, page_table=None, plan=None, packed=None):
        """Runs the Gluon forward on a call _hopper_serves admitted (never a cache call); `table` is its
        tile table (built for the family's tiles: _table_key(q, v, "hopper")), () without one; `plan` the
        call's _CallPlan; `packed` a packed call's, as for _hopper_prepare. Returns out and the natural-log
        LSE, as the portable forward does."""
        block_m, block_n, _, stages, q_buffers = self.rt._family_tiles(q, v, "hopper")
        return self.prepare(q, k, v, tensors, table, block_m, block_n, stages, q_buffers, plan=plan, packed=packed)()

    def backward(self, q, k, v, out, lse, do, dlse, tensors, table, plan=None, packed=None):
        """Runs the Gluon backward on a call _hopper_backward_serves admitted; `table` is its tile table
        (_table_key(q, v, "hopper_bwd")), () for a mask without tables; `plan` the backward's
        (_backward_plan); `packed` a packed call's, as for _hopper_prepare. Returns dq, dk, dv and one
        gradient per input (None for inputs that are not learnable), as the portable backward does."""
        D, DV, TOTAL_Q = q.shape[3], v.shape[3], q.shape[2]
        B, H, HKV, Q_LEN, KV_LEN = _call_sizes(q, k, packed)
        # TMA reads dO in its own strides where it can: the gradient of a transposed view of O comes as one.
        if not _hopper_addressable(do):
            do = do.clone(memory_format=torch.contiguous_format)
        block_m, block_n, warps, stages, _ = self.rt._family_tiles(q, v, "hopper_bwd")
        # dQ is summed over the key tiles by TMA reduce-adds into fp32 (zeroed by the row terms' pass),
        # scaled and rounded once at the end, element by element: dq_sum and dq share one layout (q's).
        dq_sum = _empty_in_layout(q, D, torch.float32)
        # Both padded to whole query tiles, so a TMA box never reads another head's rows.
        delta, lse2 = self.rt._row_terms(out, do, dlse, lse, _cdiv(TOTAL_Q, block_m) * block_m, dq_sum, plan=plan)
        if packed is not None:
            delta, lse2 = (_hopper_sequence_rows(rows, packed, fill, block_m) for rows, fill in ((delta, 0.0),
                                                                                              (lse2, float("inf"))))
        d_pad, dv_pad = self.rt._widths(D, DV)
        sm_scale = self.rt.facts.softmax_scale(D)
        dk, dv = _empty_in_layout(k, D), _empty_in_layout(v, DV)
        grads = self.rt._input_grads(tensors, q.device)
        num_warps, maxnreg, split_d = _hopper_backward_config(block_n, warps)
        descriptors = (_hopper_descriptor(q, block_m, d_pad), _hopper_descriptor(k, block_n, d_pad),
                       _hopper_descriptor(v, block_n, dv_pad), _hopper_descriptor(do, block_m, dv_pad),
                       _hopper_row_descriptor(lse2, block_m), _hopper_row_descriptor(delta, block_m),
                       _hopper_descriptor(dq_sum, block_m, d_pad))
        table_args = self.rt._table_args(self.rt._table_key(q, v, "hopper_bwd"), table, _sizes(q, k))
        packed_args, packed_flags = _packed_launch(packed, delta)
        _launch(
            self.backward_kernel, (_cdiv(KV_LEN, block_n), B * HKV), *descriptors, dk, dv, *dk.stride()[:3],
            *dv.stride()[:3], sm_scale, sm_scale * LOG2E.value,
            *self.rt._input_args(tensors), *[g for g in grads if g is not None], *table_args, B, H, HKV, Q_LEN, KV_LEN,
            *packed_args, HEAD_DIM=D, HEAD_DIM_V=DV, HEAD_DIM_PAD=d_pad, HEAD_DIM_V_PAD=dv_pad, BLOCK_M=block_m,
            BLOCK_N=block_n, STAGES=stages, FOLLOW_TABLE=bool(table), SPLIT_D=split_d, num_warps=num_warps,
            maxnreg=maxnreg, bind=_plan_site(plan, "hopper backward", bool(table)), **packed_flags)
        dq = _empty_in_layout(q, D)
        _launch(self.dq_finish_kernel, (_cdiv(dq.numel(), HOPPER_DQ_FINISH_BLOCK),), dq_sum, dq, sm_scale, dq.numel() // 8,
                BLOCK=HOPPER_DQ_FINISH_BLOCK, num_warps=4, bind=_plan_site(plan, "hopper dq finish"))
        return dq, dk, dv, _in_input_dtypes(grads, tensors)
