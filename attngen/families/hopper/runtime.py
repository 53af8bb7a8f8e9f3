"""The Hopper family's runtime side: its per-call rules, TMA descriptors and the launches of its Gluon kernels
(whose device side no spec changes is device.py), and the one kernel it launches itself (an FP8 call's V^T)."""

import math

import torch
import triton
import triton.language as tl
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ...runtime.arguments import _call_sizes, _fp8_launch, _packed_launch, _sizes, _sm_count
from ...runtime.checks import CHECKED_VALUES
from ...runtime.helpers import LOG2E
from ...runtime.launch import _launch
from ...runtime.plans import _plan_site
from ...runtime.shared import _cdiv, _empty_in_layout, _next_power_of_2, _token_sequences


# The dtypes its wgmma reads from shared memory (float8_e4m3fn: FP8 calls, forward only), and the head dims
# its tiles take: TMA boxes are the padded widths (zero-filled past the head dim on loads, clipped on
# stores), rows must be 16-byte multiples (8 elements), and below 64 the padding would double the work.
HOPPER_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
HOPPER_HEAD_DIMS = range(64, 257, 8)
# The kernels address q, k, v and out by TMA as (B, heads, length, D) tensors, whose coordinates are
# int32: a row, and a tile's overhang past a head's last one, must stay below 2**31.
HOPPER_MAX_LENGTH = 2**31 - 256
# TMA's bounds on a tensor's layout: a 16-byte-aligned base, the last dim dense, the other strides
# multiples of 16 bytes below 2**40 (cuTensorMapEncodeTiled).
HOPPER_TMA_ALIGN = 16
HOPPER_TMA_MAX_STRIDE = 2**40
# The query rows a dropout call's backward step walks at most: the keep-mask's Philox draws spill the registers
# of the 128-row step that plain specs take at head dims up to 64 (family.py), 18% slower than 64-row steps
# (full, B4 H16 N4096 D64, dropout_p 0.1, H100). Such specs have no tile table to keep the plan's rows for.
HOPPER_DROPOUT_QUERY_ROWS = 64
# The query rows of a forward tile with dropout or FP8 at most: three consumer warpgroups' 160 registers spill
# the keep-mask's Philox draws (512 spill stores, full at D=64), and FP8's 192-row tile is not yet measured. Only
# plain specs take 192 rows (family.py), and they have no tile table to keep the plan's rows for.
HOPPER_NARROW_FORWARD_ROWS = 128
# The query rows of a backward step whose row terms start its accumulators (FOLD_ROWS) at most. On an H100
# (tools/hopper/backward_cases.py, ms): causal D64 B2 H32 N8192 3.66-3.68 -> 3.48-3.52, full D128 B2 H16 N8192
# 5.33-5.43 -> 4.78-4.98, document_causal D64 0.52 -> 0.505; at 128 rows (full D64) 6.34-6.41 -> 6.52. Only the
# plain score: alibi_causal's steps at D128 went 3.08-3.09 -> 3.19-3.21 with dP^T's fold alone.
HOPPER_FOLD_ROWS_UP_TO = 64
# The query rows of one consumer warpgroup of the pingpong forward (a 64-row wgmma accumulator of 4 warps):
# a tile of block_m rows runs block_m / 64 of them.
HOPPER_CONSUMER_ROWS = 64


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


def _hopper_forward_rows(block_m, dropout, fp8):
    """The query rows of a forward call's tile: the plan's, at most HOPPER_NARROW_FORWARD_ROWS with dropout or FP8."""
    return min(block_m, HOPPER_NARROW_FORWARD_ROWS) if dropout or fp8 else block_m


def _hopper_backward_rows(block_m, dropout, table):
    """The query rows of a backward call's step: the plan's, at most HOPPER_DROPOUT_QUERY_ROWS for a dropout call
    without a tile table (a table is built for the plan's rows)."""
    return min(block_m, HOPPER_DROPOUT_QUERY_ROWS) if dropout and not table else block_m


def _hopper_folds(block_m, softmax, dropout, plain_score, sm_scale):
    """(FOLD_ROWS, FOLD_LSE) of a backward launch of block_m-row steps: whether they start dP^T's accumulator at
    -delta (softmax steps of the plain score, at most HOPPER_FOLD_ROWS_UP_TO rows, not a dropout call's, which
    scales dP before delta comes off), and S^T's at -LSE / qk_scale (besides, a finite scale other than 0: the
    plain score's s2 is qk_scale * S^T)."""
    fold_rows = softmax and plain_score and not dropout and block_m <= HOPPER_FOLD_ROWS_UP_TO
    return fold_rows, fold_rows and math.isfinite(sm_scale) and sm_scale != 0


def _hopper_consumers(block_m):
    """The pingpong forward's consumer warpgroups on a tile of block_m query rows: one per HOPPER_CONSUMER_ROWS."""
    return block_m // HOPPER_CONSUMER_ROWS


def _hopper_launch_config(block_m, consumers):
    """(num_warps, maxnreg) of a launch: with `consumers` > 1 as many 4-warp consumer warpgroups (the default
    partition and workers) take turns beside a 1-warp producer; otherwise one consumer of block_m / 16 warps."""
    num_warps, worker_warps = (4, 4 * (consumers - 1) + 1) if consumers > 1 else (block_m // 16, 1)
    # Registers are granted per warpgroup: the 1-warp producer still takes a whole warpgroup's slots.
    # Cap the kernel so all warps (rounded up to warpgroups) fit the 64K-register file; setmaxnreg then
    # moves the producer down to HOPPER_PRODUCER_REGS and the consumers up to what is left.
    total_threads = (num_warps + _cdiv(worker_warps, 4) * 4) * 32
    return num_warps, min(256, (65536 // total_threads) // 8 * 8)


def _hopper_backward_config(block_n, warps):
    """(num_warps, maxnreg, SPLIT_D) of a backward launch of `warps` consumer warps over key tiles of block_n:
    one consumer partition, a 16-key slab a warp; where the warps outnumber the tile's slabs (64-key tiles,
    head dims above 128), two warpgroups side by side split the head dims' columns (SPLIT_D)."""
    return (*_hopper_launch_config(16 * warps, 1), 16 * warps > block_n)


class _HopperDescriptor(TensorDescriptor):
    """A TMA descriptor without TensorDescriptor's checks, which cost ~5 us each on the host and a call
    builds up to seven: the family builds descriptors only of tensors its per-call rule admitted or that
    it allocated (16-byte aligned bases, rows of 16-byte multiples, sizes of at least 1), in boxes of its
    tiles (tests/test_hopper.py runs the checks on them)."""

    def __post_init__(self):
        pass


# Keys a program of _hopper_keys_inner moves (a tile of at most 64 x 256 bytes), and the chunks of keys its
# order permutes (the keys of one 8-bit wgmma's K, 32): V^T's rows are padded to whole chunks, zero-filled.
HOPPER_TRANSPOSE_KEYS = 64
HOPPER_KEY_CHUNK = 32


@triton.jit
def _hopper_keys_inner(V, VT, KV_LEN, KV_PAD, DV, HKV, n_blocks, stride_vz, stride_vh, stride_vn, stride_tz,
                       stride_th, stride_td, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    # An FP8 call's V^T, (DV, KV_PAD) bytes a (batch, kv head), one such a program row: column t holds key
    # 32 (t // 32) + 16 h + 8 a + 2 c + b, for t % 32 = 16 h + 4 c + 2 a + b, the order in which each thread of
    # the PV wgmma holds P's keys as its A operand (_hopper_p_operand); keys at or past KV_LEN are 0 (P is 0
    # there, and 0 * V must be too). Rows are read in V's strides and written along the keys. torch's copy of
    # a transposed uint8 view moved 0.3 TB/s on an H100 (223 us for 32 MB, 12% of a D=128 FP8 forward).
    pid = tl.program_id(0)
    bh = pid // n_blocks
    offs_t = (pid % n_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    within = offs_t % 32
    keys = offs_t - within + within // 16 * 16 + within % 4 // 2 * 8 + within % 16 // 4 * 2 + within % 2
    offs_d = tl.arange(0, BLOCK_D)
    b, h = (bh // HKV).to(tl.int64), (bh % HKV).to(tl.int64)
    tile = tl.load(V + b * stride_vz + h * stride_vh + keys[:, None].to(tl.int64) * stride_vn + offs_d[None, :],
                   mask=(keys[:, None] < KV_LEN) & (offs_d[None, :] < DV), other=0)
    tl.store(VT + b * stride_tz + h * stride_th + offs_d[:, None].to(tl.int64) * stride_td + offs_t[None, :],
             tl.trans(tile), mask=(offs_d[:, None] < DV) & (offs_t[None, :] < KV_PAD))


def _hopper_transposed_descriptor(v, rows, width):
    """A TMA descriptor of V^T for an FP8 call: V (B, HKV, KV_LEN, DV) copied to (B, HKV, DV, KV_PAD) with
    the keys innermost, since wgmma reads 8-bit B operands only with K (here the keys) contiguous, in the
    order of P's keys in the PV wgmma's registers within each chunk of HOPPER_KEY_CHUNK (_hopper_keys_inner),
    zeros past KV_LEN to KV_PAD, the chunks' end; in boxes of `rows` head dims and `width` keys (TMA fills past
    DV and KV_PAD with zeros). The descriptor holds the copy (its base)."""
    B, HKV, KV_LEN, DV = v.shape
    KV_PAD = _cdiv(KV_LEN, HOPPER_KEY_CHUNK) * HOPPER_KEY_CHUNK
    padded = torch.empty((B, HKV, DV, KV_PAD), dtype=v.dtype, device=v.device)
    n_blocks = _cdiv(KV_PAD, HOPPER_TRANSPOSE_KEYS)
    # As bytes (uint8 views: the same bits, and pointers every Triton backend and its interpreter know).
    _launch(_hopper_keys_inner, (n_blocks * B * HKV,), v.view(torch.uint8), padded.view(torch.uint8), KV_LEN, KV_PAD,
            DV, HKV, n_blocks, *v.stride()[:3], *padded.stride()[:3], BLOCK_N=HOPPER_TRANSPOSE_KEYS,
            BLOCK_D=_next_power_of_2(DV), num_warps=4)
    box = _hopper_tile_box(rows, width)
    return _HopperDescriptor(padded, [B, HKV, DV, KV_PAD], padded.stride(), box, _hopper_layout(box, v.dtype))


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


def _hopper_sequence_columns(packed, block_m, store):
    """Where a packed call's row terms go for the backward kernel: each token's column, sequence b's rows
    from column 4 * (cu_seqlens_q[b] // 4 + b), 16-byte aligned as TMA reads them (the kernel's row_start),
    and the width of the moved rows, padded to whole query tiles. Made on the device without a sync
    (_token_sequences), once per offsets tensor while it is unchanged (every layer of a model's step
    passes the same one), and kept (CHECKED_VALUES) only where `store` (an eager call, with a plan: see
    _WORK_COUNTERS), outside a CUDA graph's capture, for offsets on a GPU (not the meta stand-ins of
    runtime/ahead.py or the CPU tests' tensors, whose entries would only push real ones out)."""
    cu, TOTAL_Q = packed[0], packed[4]
    keep = cu.is_cuda and not torch.cuda.is_current_stream_capturing()
    facts = ("hopper sequence columns", TOTAL_Q, block_m)
    known = CHECKED_VALUES.value((cu,), facts) if keep else None
    if known is not None:
        return known
    sequence, tokens = _token_sequences(cu, TOTAL_Q)
    # 4 * (start // 4 + b) + (token - start), with start = cu[b]
    columns = tokens + 4 * sequence - cu[:-1].long()[sequence] % 4
    known = columns, _cdiv(TOTAL_Q + 4 * (cu.shape[0] - 1), block_m) * block_m
    if keep and store:
        CHECKED_VALUES.keep((cu,), facts, known)
    return known


def _hopper_sequence_rows(rows, sequence_columns, fill):
    """A packed call's row terms (1, H, TOTAL_Q) fp32 at the columns _hopper_sequence_columns gives, the
    columns between sequences `fill`."""
    columns, width = sequence_columns
    moved = rows.new_full((*rows.shape[:2], width), fill)
    moved[..., columns] = rows[..., :columns.shape[0]]
    return moved


def _hopper_layout(block_shape, dtype):
    key = (*block_shape, dtype)
    if key not in _HOPPER_LAYOUTS:
        element = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32,
                   torch.float8_e4m3fn: gl.float8e4nv}[dtype]
        _HOPPER_LAYOUTS[key] = gl.NVMMASharedLayout.get_default_for(list(block_shape), element)
    return _HOPPER_LAYOUTS[key]


# Per (device, stream): the forward's work counter, two int32 that the kernel's last CTA sets back to zero,
# so every launch on that stream finds them zero without a torch.zeros of its own (13 us of host time on an
# H100's host, a seventh of a short forward's). Launches on one stream run in order; other streams get their
# own counters; a CUDA graph being captured gets a fresh one from the graph's memory, zeroed in the graph.
# Only eager calls (those with a call plan) keep one: a call without a plan may be a compiled graph's custom
# operator, which uses a kept counter but keeps none (runtime/tables.py's STATIC_TABLES says why).
_WORK_COUNTERS = {}


def _hopper_work_counter(device, store):
    # (A device other than CUDA is the CPU tests' stand-in for one, with the launches stubbed.)
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return torch.zeros(2, dtype=torch.int32, device=device)
    key = (device, torch._C._cuda_getCurrentRawStream(device.index))
    counter = _WORK_COUNTERS.get(key)
    if counter is None:
        counter = torch.zeros(2, dtype=torch.int32, device=device)
        if store:
            _WORK_COUNTERS[key] = counter
    return counter


# Elements of dQ a program of _hopper_dq_finish scales and rounds: 16 a thread of 4 warps.
HOPPER_DQ_FINISH_BLOCK = 2048


class HopperFamily:
    """The Hopper family (families/hopper/family.py) serving the Attention `rt`: its Gluon forward, its backward
    and dQ's finishing pass; plain_score is the emitter's word that the score is the plain scaled dot
    product (the forward may then scale once per tile: DEFER_SCALE)."""

    def __init__(self, rt, forward_kernel, backward_kernel, dq_finish_kernel, plain_score):
        self.rt = rt
        self.forward_kernel, self.backward_kernel = forward_kernel, backward_kernel
        self.dq_finish_kernel, self.plain_score = dq_finish_kernel, plain_score

    def serves(self, q, k, v, HKV, KV_LEN, cached):
        """Whether this forward call goes to the Hopper family (its family entry's per_call): not a
        cache call, bf16 or fp16 on a Hopper GPU, head dims of HOPPER_HEAD_DIMS, q, k, v in layouts TMA
        addresses (_hopper_addressable: any strides of 16-byte multiples), lengths int32-addressable."""
        B, H, Q_LEN, D = q.shape
        return (not cached and q.is_cuda and q.dtype in HOPPER_DTYPES and _hopper_device(q.device)
                and D in HOPPER_HEAD_DIMS and v.shape[-1] in HOPPER_HEAD_DIMS and max(Q_LEN, KV_LEN) <= HOPPER_MAX_LENGTH
                and all(_hopper_addressable(t) for t in (q, k, v)))

    def backward_serves(self, q, k, v, deterministic=False):
        """Whether this call's backward goes to the Hopper family (its family entry's per_call): a call
        whose forward it could serve (every head dim: above 128 on tiles of its own, _hopper_backward_config),
        never a deterministic one: its key tiles add their dQ tiles concurrently, in an order the GPU decides,
        so the dispatcher runs the portable backward (whose dQ pass writes each tile once) after this
        family's forward (the family's `deterministic` rule, family.py, says why)."""
        return not deterministic and self.serves(q, k, v, k.shape[1], k.shape[2], False)

    def prepare(self, q, k, v, tensors, table, block_m, block_n, stages, q_buffers=1, pingpong=True, plan=None,
                        packed=None, sink=None, dropout=None, fp8=None):
        """The outputs, the TMA descriptors and the grid of one call, built once; returns run() -> (out,
        lse), which only launches (the tools time it apart from the descriptors' host cost). `table` is
        the call's tile table for these tiles, () without one; `q_buffers` the Q tiles a CTA holds (the
        plan's: 2 where shared memory has room); `plan` the call's _CallPlan; `packed` a packed call's
        (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, TOTAL_Q), whose q, k and v are (1, heads,
        TOTAL, D) views (_packed_view), or None; `sink` the spec's sink of every row and `dropout` the call's
        (Dispatch._forward); `fp8` an FP8 call's descale factors of q, k and v ((B, HKV) fp32 each; q, k and v
        are float8_e4m3fn, never packed), whose O is bfloat16."""
        D, DV = q.shape[3], v.shape[3]
        B, H, HKV, Q_LEN, KV_LEN = _call_sizes(q, k, packed)
        d_pad, dv_pad = self.rt._widths(D, DV)
        out = _empty_in_layout(q, DV, torch.bfloat16 if fp8 is not None else None)
        lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
        # Pingpong: a 4-warp consumer warpgroup per 64 query rows of the tile (two, or three at D=64).
        consumers = _hopper_consumers(block_m) if pingpong else 1
        num_warps, maxnreg = _hopper_launch_config(block_m, consumers)
        rows = block_m // consumers
        q_desc, k_desc = _hopper_descriptor(q, rows, d_pad), _hopper_descriptor(k, block_n, d_pad)
        if fp8 is not None:
            v_desc = _hopper_transposed_descriptor(v, dv_pad, block_n)
        else:
            v_desc = _hopper_descriptor(v, block_n, dv_pad)
        o_desc = _hopper_descriptor(out, rows, dv_pad)
        # Persistent: one CTA an SM, at most one a work item (_hopper_fwd_work), taking items from a counter
        # (and counting the CTAs done, to set it back to zero at the end: run() may launch again).
        grid = (min(_cdiv(Q_LEN, block_m) * B * H, _sm_count(q.device)),)
        work_counter = _hopper_work_counter(q.device, store=plan is not None)
        sm_scale = self.rt.facts.softmax_scale(D)
        table_args = self.rt._table_args((True, block_m, block_n), table, _sizes(q, k), placeholder=lse)
        packed_args, packed_flags = _packed_launch(packed, lse)
        dropout_args, dropout_flag = self.rt._dropout_args(dropout, lse)
        fp8_args, fp8_flag = _fp8_launch(fp8, lse)
        # Scaling after the row max needs a scale >= 0: an FP8 call's also takes the descale factors, whose
        # negative values make NaN rows (helpers._fp8_descales) in every family.
        defer_scale = self.plain_score and sm_scale > 0

        def run():
            _launch(self.forward_kernel, grid, q_desc, k_desc, v_desc, o_desc, out, *out.stride()[:3],
                    *self.rt._row_args(lse), *self.rt._sink_args(sink), work_counter,
                    sm_scale, sm_scale * LOG2E.value, *dropout_args, *fp8_args, *self.rt._input_args(tensors),
                    *table_args, B, H,
                    HKV, Q_LEN, KV_LEN,
                    *packed_args, HEAD_DIM=D, HEAD_DIM_V=DV, HEAD_DIM_PAD=d_pad, HEAD_DIM_V_PAD=dv_pad, BLOCK_M=block_m,
                    BLOCK_N=block_n, STAGES=stages, Q_BUFFERS=q_buffers, CONSUMERS=consumers, FOLLOW_TABLE=bool(table),
                    DEFER_SCALE=defer_scale, num_warps=num_warps, maxnreg=maxnreg,
                    bind=_plan_site(plan, "hopper", bool(table)), **packed_flags, **dropout_flag, **fp8_flag)
            return out, lse

        return run

    def forward(self, q, k, v, tensors, table, cache=None, page_table=None, plan=None, packed=None, sink=None,
                dropout=None, fp8=None):
        """Runs the Gluon forward on a call _hopper_serves admitted (never a cache call); `table` is its
        tile table (built for the family's tiles: _table_key(q, v, "hopper")), () without one; `plan` the
        call's _CallPlan; `packed`, `sink`, `dropout` and `fp8` as for prepare. Returns out and the natural-log
        LSE, as the portable forward does."""
        block_m, block_n, _, stages, q_buffers = self.rt._family_tiles(q, v, "hopper")
        block_m = _hopper_forward_rows(block_m, dropout is not None, fp8 is not None)
        return self.prepare(q, k, v, tensors, table, block_m, block_n, stages, q_buffers, plan=plan, packed=packed,
                            sink=sink, dropout=dropout, fp8=fp8)()

    def backward(self, q, k, v, out, lse, do, dlse, tensors, table, plan=None, packed=None, deterministic=False,
                 sink=None, dropout=None):
        """Runs the Gluon backward on a call backward_serves admitted; `table` is its tile table
        (_table_key(q, v, "hopper_bwd")), () for a mask without tables; `plan` the backward's
        (_backward_plan); `packed` a packed call's, as for prepare; `deterministic` is the family interface's
        (runtime/families.py) and must be False: backward_serves declines deterministic calls, which run the
        portable backward; `sink` the sink rows whose gradient is wanted; `dropout` the forward's, whose mask
        it regenerates. Returns dq, dk, dv, one gradient per input (None for inputs that are not learnable) and
        the sink rows' gradient, as the portable backward does."""
        if deterministic:
            raise ValueError("the hopper family's backward is not deterministic (its key tiles add their dQ tiles "
                             "concurrently): backward_serves declines deterministic calls, which run the portable "
                             "backward")
        D, DV, TOTAL_Q = q.shape[3], v.shape[3], q.shape[2]
        B, H, HKV, Q_LEN, KV_LEN = _call_sizes(q, k, packed)
        # TMA reads dO in its own strides where it can: the gradient of a transposed view of O comes as one.
        if not _hopper_addressable(do):
            do = do.clone(memory_format=torch.contiguous_format)
        block_m, block_n, warps, stages, _ = self.rt._family_tiles(q, v, "hopper_bwd")
        block_m = _hopper_backward_rows(block_m, dropout is not None, bool(table))
        # dQ is summed over the key tiles by TMA reduce-adds into fp32 (zeroed by the row terms' pass),
        # scaled and rounded once at the end, element by element: dq_sum and dq share one layout (q's).
        dq_sum = _empty_in_layout(q, D, torch.float32)
        q_rows = _cdiv(TOTAL_Q, block_m) * block_m
        dsink = None
        if self.rt.facts.sigmoid:
            # No row terms (dS = P * (1 - P) * dP), so no pass over O and dO: dQ's sum is zeroed on its own.
            dq_sum.zero_()
            rows = ()
        else:
            # Both padded to whole query tiles, so a TMA box never reads another head's rows.
            delta, lse2, dsink = self.rt._row_terms(out, do, dlse, lse, q_rows, dq_sum, plan=plan,
                                                    sink=(sink, lse) if sink is not None else None)
            if packed is not None:
                columns = _hopper_sequence_columns(packed, block_m, store=plan is not None)
                delta, lse2 = (_hopper_sequence_rows(delta, columns, 0.0),
                               _hopper_sequence_rows(lse2, columns, float("inf")))
            rows = (_hopper_row_descriptor(lse2, block_m), _hopper_row_descriptor(delta, block_m))
        d_pad, dv_pad = self.rt._widths(D, DV)
        sm_scale = self.rt.facts.softmax_scale(D)
        dk, dv = _empty_in_layout(k, D), _empty_in_layout(v, DV)
        grads = self.rt._input_grads(tensors, q.device)
        num_warps, maxnreg, split_d = _hopper_backward_config(block_n, warps)
        fold_rows, fold_lse = _hopper_folds(block_m, not self.rt.facts.sigmoid, dropout is not None,
                                            self.plain_score, sm_scale)
        descriptors = (_hopper_descriptor(q, block_m, d_pad), _hopper_descriptor(k, block_n, d_pad),
                       _hopper_descriptor(v, block_n, dv_pad), _hopper_descriptor(do, block_m, dv_pad), *rows)
        dq_desc = _hopper_descriptor(dq_sum, block_m, d_pad)
        table_args = self.rt._table_args(self.rt._table_key(q, v, "hopper_bwd"), table, _sizes(q, k))
        packed_args, packed_flags = _packed_launch(packed, dq_sum)
        dropout_args, dropout_flag = self.rt._dropout_args(dropout, dq_sum)
        _launch(
            self.backward_kernel, (_cdiv(KV_LEN, block_n), B * HKV), *descriptors, dq_desc, dk, dv, *dk.stride()[:3],
            *dv.stride()[:3], sm_scale, sm_scale * LOG2E.value, *dropout_args,
            *self.rt._input_args(tensors), *[g for g in grads if g is not None], *table_args, B, H, HKV, Q_LEN, KV_LEN,
            *packed_args, HEAD_DIM=D, HEAD_DIM_V=DV, HEAD_DIM_PAD=d_pad, HEAD_DIM_V_PAD=dv_pad, BLOCK_M=block_m,
            BLOCK_N=block_n, STAGES=stages, FOLLOW_TABLE=bool(table), SPLIT_D=split_d, FOLD_ROWS=fold_rows,
            FOLD_LSE=fold_lse, num_warps=num_warps,
            maxnreg=maxnreg, bind=_plan_site(plan, "hopper backward", bool(table)), **packed_flags, **dropout_flag)
        dq = _empty_in_layout(q, D)
        _launch(self.dq_finish_kernel, (_cdiv(dq.numel(), HOPPER_DQ_FINISH_BLOCK),), dq_sum, dq, sm_scale,
                dq.numel() // 8, BLOCK=HOPPER_DQ_FINISH_BLOCK, num_warps=4, bind=_plan_site(plan, "hopper dq finish"))
        return dq, dk, dv, self.rt._summed_input_grads(grads, tensors), dsink


# The class the runtime serves a spec's Attention with (runtime.families).
FAMILY = HopperFamily
