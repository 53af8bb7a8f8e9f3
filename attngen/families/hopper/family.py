"""The Hopper family's plan entry: which targets it serves (sm_90, triton 3.6's Gluon), its per-call rule,
and the tiles of its forward and backward within the target's shared memory."""

from __future__ import annotations

import triton

from attngen.analysis import Analysis
from attngen.plan.family import Family
from attngen.plan.targets import Target

# The Gluon API the Hopper family's kernels are written against: it changes between releases.
HOPPER_TRITON = "3.6."


def _hopper_problem(facts: Analysis, target: Target) -> str | None:
    if target.capability is None or target.capability[0] != 9:
        return f"its kernels need a Hopper GPU (sm_90: TMA, wgmma, setmaxnreg); the target is {target.name}"
    if not triton.__version__.startswith(HOPPER_TRITON):
        return f"its Gluon kernels are written against triton {HOPPER_TRITON}x's API, found {triton.__version__}"
    return None


# What the family's tiles leave of the target's shared memory per block (227 KiB on sm_90) for barriers, the
# LSE/delta rows, work item numbers and reductions' scratch (1-1.3 KB in the compiled kernels:
# tools/compile_sm90.py).
HOPPER_SHARED_MARGIN = 2048


def _hopper_forward_shared_bytes(block_m: int, block_n: int, stages: int, q_buffers: int, d: int, dv: int) -> int:
    # Q_BUFFERS Q tiles (BLOCK_M x d) and STAGES K and V tiles (BLOCK_N x d, BLOCK_N x dv) at 16 bits.
    return (q_buffers * block_m * d + stages * block_n * (d + dv)) * 2


# Up to this width a plain spec's forward tile (plan.family.plain_steps) holds 192 query rows, three consumer
# warpgroups of 64 (FA3's D=64 tile): a narrow head's softmax costs about as much as its two GEMMs, and with
# three warpgroups each one's softmax runs behind two others' GEMMs. full at D=64, B2 H16 N8192: 1.12-1.17 ms
# against 1.20-1.22 at 128 rows (cuDNN 1.20; H100, 2026-12-07). Mask or score code loses at 192 rows (160
# registers a consumer): alibi_causal 24% slower, sliding_window 2x (52 spill stores); causal level.
HOPPER_THREE_CONSUMERS_UP_TO = 64


def _hopper_tiles(target: Target, d: int, dv: int, dtype: str, plain: bool) -> tuple[tuple[int, ...], str]:
    # At d = dv = 128 a third K/V stage leaves no room for a second Q tile; at 256 the key tiles halve.
    # A persistent CTA holds two Q tiles where they fit (the next work item's loads during this one).
    widest = max(d, dv)
    block_m = 192 if widest <= HOPPER_THREE_CONSUMERS_UP_TO and plain else 128
    block_n = 128 if widest <= 128 else 64
    stages = 3 if widest <= 64 else 2
    budget = target.smem_per_block - HOPPER_SHARED_MARGIN
    q_buffers = 2 if _hopper_forward_shared_bytes(block_m, block_n, stages, 2, d, dv) <= budget else 1
    shared_bytes = _hopper_forward_shared_bytes(block_m, block_n, stages, q_buffers, d, dv)
    return ((block_m, block_n, 4, stages, q_buffers),
            f"hopper: {block_m}x{block_n} tiles, a persistent CTA an SM taking query tiles from a counter, "
            f"{'three' if block_m == 192 else 'two'} 4-warp consumer warpgroups taking turns at the tensor cores "
            f"and a TMA producer warp, {stages} K/V stages, {q_buffers} Q tile{'s' if q_buffers > 1 else ''} "
            f"({shared_bytes // 1024} KiB of shared memory)")


# Above this width dK and dV (2 * d fp32 a key row) no longer fit the registers of 128-key tiles: the
# tiles hold 64 keys, and their two warpgroups split the head dims' columns (SPLIT_D).
HOPPER_BACKWARD_SPLIT_ABOVE = 128


# Up to this width a spec whose backward step runs no code of its own (plan.family.plain_steps) walks
# 128 query rows a step, as FA3 does at D=64: its S^T and dP^T (64 fp32 registers a thread each), dK and dV (32
# each) fit the registers. A step with mask or score code spills at that width (alibi_causal at D=64: 301 spill
# stores, 2.2x slower; causal 50, 9% slower; H100, 2026-12-07), so those keep 64 query rows.
HOPPER_BACKWARD_WIDE_QUERIES = 64


def _hopper_deterministic(facts: Analysis) -> tuple[bool, str]:
    # Its backward never serves a deterministic call (HopperFamily.backward_serves): the dispatcher chooses each
    # call's backward family apart from its forward's, so such a call keeps the Hopper forward. Measured on an
    # H100 (B2 H16 N8192 bf16, causal), that pair costs 1.19x, 1.26x and 2.0x the default forward+backward at
    # D 128, 64 and 256, against 2.22x, 1.69x and 3.73x for dQ summed in int64 fixed point by the Hopper backward.
    return False, ("its key tiles add their dQ tiles concurrently, so a deterministic call runs the portable "
                   "backward after the hopper forward, whose dQ pass writes each tile once (1.2-2.0x the default "
                   "forward+backward against 1.7-3.7x for an int64 fixed-point dQ, H100, B2 H16 N8192 causal "
                   "D64/128/256)")


def _hopper_backward_shared_bytes(block_m: int, block_n: int, stages: int, d: int, dv: int) -> int:
    # K and V; STAGES of Q and dO; dS^T (and P^T) at 16 bits; dQ's fp32 staging box.
    return (block_n * (d + dv) + stages * block_m * (d + dv) + block_n * block_m) * 2 + block_m * d * 4


def _hopper_backward_tiles(target: Target, d: int, dv: int, dtype: str,
                           plain: bool) -> tuple[tuple[int, int, int, int], str]:
    if max(d, dv) <= HOPPER_BACKWARD_WIDE_QUERIES and plain:
        shared_bytes = _hopper_backward_shared_bytes(128, 128, 2, d, dv)
        return (128, 128, 8, 2), (
            f"hopper backward: 128 queries x 128 keys (FA3's D=64 tile: a spec with no mask, score or sink code "
            f"fits its registers; 64 queries in dropout calls, whose keep-mask does not), two consumer warpgroups "
            f"holding dK and dV in registers, 2 Q/dO stages, dQ by TMA reduce-add ({shared_bytes // 1024} KiB of "
            f"shared memory)")
    if max(d, dv) <= HOPPER_BACKWARD_SPLIT_ABOVE:
        shared_bytes = _hopper_backward_shared_bytes(64, 128, 2, d, dv)
        return (64, 128, 8, 2), (
            f"hopper backward: 64 queries x 128 keys (FA3's D=128 tile), two consumer warpgroups holding dK and dV "
            f"in registers, 2 Q/dO stages, dQ by TMA reduce-add ({shared_bytes // 1024} KiB of shared memory)")
    # FA3's sm_90 tiles at head dim 256: 64 x 64, one stage where two do not fit.
    budget = target.smem_per_block - HOPPER_SHARED_MARGIN
    stages = 2 if _hopper_backward_shared_bytes(64, 64, 2, d, dv) <= budget else 1
    shared_bytes = _hopper_backward_shared_bytes(64, 64, stages, d, dv)
    return (64, 64, 8, stages), (
        f"hopper backward: 64 queries x 64 keys (FA3's D=256 tile), two consumer warpgroups side by side, each "
        f"holding half the head dims of dK and dV in registers, P^T and dS^T shared through shared memory, "
        f"{stages} Q/dO stage{'s' if stages > 1 else ''}, dQ by TMA reduce-add ({shared_bytes // 1024} KiB of "
        f"shared memory)")


FAMILY = Family(
    name="hopper",
    strength=("FlashAttention-3-style Gluon kernels. Forward: TMA loads by a producer warp, asynchronous wgmma "
              "with P in registers, softmax overlapped with the previous tile's P.V, two consumer warpgroups in "
              "pingpong (three for plain specs at head dims up to 64). Backward: a CTA per key tile with dK/dV in "
              "registers over the query heads of its group, "
              "dQ by TMA reduce-add. The spec's score and mask run on the wgmma accumulators, over the same tile "
              "ranges and tables"),
    problem=_hopper_problem,
    per_call=("calls that are not cache calls, bf16 or fp16 on a Hopper GPU, D and DV multiples of 8 from 64 to 256, "
              "q, k, v with 16-byte-aligned bases and strides (any layout with D innermost: transposed views cost "
              "nothing), Q_LEN and KV_LEN below 2**31 - 256 (TMA's int32 coordinates); packed calls too, the "
              "total query and key lengths below that; FP8 calls (float8_e4m3fn q, k, v) of the same shapes"),
    tiles=_hopper_tiles,
    backward_tiles=_hopper_backward_tiles,
    follows_tables=True,
    packed_forward=True,
    packed_backward=True,
    deterministic=_hopper_deterministic,
    dropout=True,
    fp8_forward=True,
)
