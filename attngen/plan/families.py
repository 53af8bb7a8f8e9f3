"""The kernel families, each a folder under attngen/emit/families/ with its entry here: which targets and
specs it serves, which kernels it provides, by what rule the host picks it for a call, and its tiles."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import triton

from attngen.analysis import Analysis
from attngen.plan.targets import Target

KERNELS: tuple[str, ...] = ("fwd", "bwd_dkdv", "bwd_dq")
# (target, d, dv, dtype) -> ((BLOCK_M, BLOCK_N, num_warps, num_stages[, buffers]), why): planner.Tiles' fields.
TileRule = Callable[[Target, int, int, str], tuple[tuple[int, ...], str]]


@dataclass(frozen=True)
class Family:
    """A kernel family: `name` is its template folder; `problem(analysis, target)` says why it cannot
    serve that spec on that target (None: it can), `strength` why it is chosen when it can.

    The portable family provides every kernel and serves every call. Another family provides
    `kernels` (a subset of KERNELS) for the calls its `per_call` rule admits, checked by the host on
    each call's shapes (its folder's launch.py); the other calls and kernels go to the portable
    family. `tiles` gives its forward's launch shape per padded head dim pair and dtype, and
    `backward_tiles` its backward's, if it has one (it then follows the tile tables, built for its
    tiles); `follows_tables` says whether its forward follows the mask's tile tables (built for its
    tiles) or decides every element of the mask's hull; `packed_forward` and `packed_backward` whether its
    forward and backward kernels also serve packed calls (sequences in FlashAttention's varlen layout,
    their grid following the sequences)."""
    name: str
    strength: str
    problem: Callable[[Analysis, Target], str | None]
    kernels: tuple[str, ...] = KERNELS
    per_call: str = "every call"
    tiles: TileRule | None = None
    backward_tiles: TileRule | None = None
    follows_tables: bool = False
    packed_forward: bool = False
    packed_backward: bool = False

    @property
    def backward_name(self) -> str:
        """The name the host knows this family's backward by (its tiles, its tile table)."""
        return f"{self.name}_bwd"


PORTABLE = Family(
    name="portable",
    strength=("FlashAttention-2-style Triton kernels (tl.dot, software-pipelined loads): any CUDA GPU and "
              "Triton's interpreter"),
    problem=lambda facts, target: None,
)

# Rows of one decode tile: the queries of all the query heads that share a key/value head.
DECODE_MAX_ROWS = 64


def _decode_problem(facts: Analysis, target: Target) -> str | None:
    if facts.mask_reads_head:
        return ("its mask reads the query head h, and a decode tile packs the query heads of one key/value "
                "head together, whose tile bounds could then differ")
    return None


def _decode_tiles(target: Target, d: int, dv: int, dtype: str) -> tuple[tuple[int, int, int, int], str]:
    if target.interpreter:
        return (DECODE_MAX_ROWS, 16, 4, 1), "decode: BLOCK_N=16, 1 stage in the interpreter (tests cross tiles)"
    block_n = 64 if max(d, dv) <= 128 else 32
    if dtype == "f32":
        block_n //= 2
    return ((DECODE_MAX_ROWS, block_n, 4, 3),
            f"decode: BLOCK_N={block_n}, 4 warps, 3 stages: a memory-bound loop over key tiles; "
            f"{3 * block_n * (d + dv) * (4 if dtype == 'f32' else 2) // 1024} KiB of K/V in flight per program")


DECODE = Family(
    name="decode",
    strength=("split-KV decoding: the queries of all query heads that share a key/value head in one tile, "
              "the keys split across programs by the SM count, the splits merged by their LSE"),
    problem=_decode_problem,
    kernels=("fwd",),
    per_call=(f"forward calls whose (H / HKV) * Q_LEN <= {DECODE_MAX_ROWS} (decoding, speculative "
              "decoding): one tile holds every query of a key/value head; and longer calls (chunked prefill) "
              "where the host's model of both kernels, from the call's shapes and the SM count, predicts "
              "the split kernel faster than the portable forward (masks without tile tables; calls a later "
              "family does not take)"),
    tiles=_decode_tiles,
)

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


def _hopper_tiles(target: Target, d: int, dv: int, dtype: str) -> tuple[tuple[int, ...], str]:
    # At d = dv = 128 a third K/V stage leaves no room for a second Q tile; at 256 the key tiles halve.
    # A persistent CTA holds two Q tiles where they fit (the next work item's loads during this one).
    widest = max(d, dv)
    block_n = 128 if widest <= 128 else 64
    stages = 3 if widest <= 64 else 2
    budget = target.smem_per_block - HOPPER_SHARED_MARGIN
    q_buffers = 2 if _hopper_forward_shared_bytes(128, block_n, stages, 2, d, dv) <= budget else 1
    shared_bytes = _hopper_forward_shared_bytes(128, block_n, stages, q_buffers, d, dv)
    return ((128, block_n, 4, stages, q_buffers),
            f"hopper: 128x{block_n} tiles, a persistent CTA an SM taking query tiles from a counter, two 4-warp "
            f"consumer warpgroups taking turns at the tensor cores and a TMA producer warp, {stages} K/V stages, "
            f"{q_buffers} Q tile{'s' if q_buffers > 1 else ''} ({shared_bytes // 1024} KiB of shared memory)")


# Above this width dK and dV (2 * d fp32 a key row) no longer fit the registers of 128-key tiles: the
# tiles hold 64 keys, and their two warpgroups split the head dims' columns (SPLIT_D).
HOPPER_BACKWARD_SPLIT_ABOVE = 128


def _hopper_backward_shared_bytes(block_m: int, block_n: int, stages: int, d: int, dv: int) -> int:
    # K and V; STAGES of Q and dO; dS^T (and P^T) at 16 bits; dQ's fp32 staging box.
    return (block_n * (d + dv) + stages * block_m * (d + dv) + block_n * block_m) * 2 + block_m * d * 4


def _hopper_backward_tiles(target: Target, d: int, dv: int, dtype: str) -> tuple[tuple[int, int, int, int], str]:
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


HOPPER = Family(
    name="hopper",
    strength=("FlashAttention-3-style Gluon kernels. Forward: TMA loads by a producer warp, asynchronous wgmma "
              "with P in registers, softmax overlapped with the previous tile's P.V, two consumer warpgroups in "
              "pingpong. Backward: a CTA per key tile with dK/dV in registers over the query heads of its group, "
              "dQ by TMA reduce-add. The spec's score and mask run on the wgmma accumulators, over the same tile "
              "ranges and tables"),
    problem=_hopper_problem,
    kernels=KERNELS,
    per_call=("calls that are not cache calls, bf16 or fp16 on a Hopper GPU, D and DV multiples of 8 from 64 to 256, "
              "q, k, v with 16-byte-aligned bases and strides (any layout with D innermost: transposed views cost "
              "nothing), Q_LEN and KV_LEN below 2**31 - 256 (TMA's int32 coordinates); packed calls too, the "
              "total query and key lengths below that"),
    tiles=_hopper_tiles,
    backward_tiles=_hopper_backward_tiles,
    follows_tables=True,
    packed_forward=True,
    packed_backward=True,
)

# In order of preference; the portable family comes last and serves what the others do not.
FAMILIES: tuple[Family, ...] = (DECODE, HOPPER, PORTABLE)


def deterministic_backward(facts: Analysis, families: tuple[str, ...]) -> str:
    """Which backward a call in deterministic mode (the same bits run after run) runs, and how, for a module
    of these families: what `attngen explain` says of it."""
    portable = "each dQ program writes its query tile's rows once, each dK/dV program its key tile's"
    if HOPPER.name not in families:
        how = f"portable ({portable})"
    elif facts.score_derivative_bound is None:
        how = (f"portable ({portable}); not hopper: its dQ is an int64 fixed-point sum scaled by a bound on "
               "|d score'/d score|, and the analysis knows none for this score")
    else:
        how = (f"hopper for the calls its rule admits, dQ added in int64 fixed point (each row scaled by 2**s from "
               f"a bound on its terms, |d score'/d score| <= {facts.score_derivative_bound:g}), so its key tiles add "
               f"in any order with no turns; portable for the others ({portable})")
    if facts.spec.learnable_inputs:
        how += ("; learnable inputs' gradients summed exactly (int64 words of 24-bit digits), the same in any order "
                "of their adds")
    return how


def choose_families(facts: Analysis, target: Target) -> tuple[tuple[Family, ...], str]:
    """The families of this spec's module on `target`, in order of preference (the portable family
    last), and why (including why a family was passed over)."""
    chosen, reasons = [], []
    for family in FAMILIES:
        problem = family.problem(facts, target)
        if problem is not None:
            reasons.append(f"not {family.name}: {problem}")
            continue
        chosen.append(family)
        scope = "" if family is PORTABLE else f" ({'/'.join(family.kernels)} for {family.per_call})"
        reasons.append(f"{family.name}{scope}: {family.strength}")
    assert chosen and chosen[-1] is PORTABLE, "the portable family serves every spec on every target, last"
    return tuple(chosen), "; ".join(reasons)
