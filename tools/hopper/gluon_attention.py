"""FlashAttention-3-style forward attention for Hopper (sm_90) written in Gluon (triton 3.6).

The kernels are the Hopper family's (attngen/emit/families/hopper), taken from a module built for
the H200; this file gives gpu_bench.py the names it calls, with
the knobs the family fixes (BLOCK_N, STAGES, the one-consumer variant) open for sweeps. Plain
attention: q (B, H, N, D), k/v (B, HKV, N, D) with GQA (query head h reads kv head h // (H // HKV)),
bf16 or fp16, D in {64, 128}, optional top-left causal mask (key k allowed iff k <= q), any N. Returns O (B, H, N, D) in the input dtype and the natural-log
LSE (B, H, N) in float32.

What the kernel uses:
  * TMA: host-side 2-D `TensorDescriptor`s over (B*H*N, D) / (B*HKV*N, D); Q is loaded once per CTA,
    K and V tiles stream through a STAGES-deep ring of shared-memory buffers, each stage with its own
    ready/empty mbarriers, K and V on separate barriers so QK^T can start before V lands.
  * Warp specialization (`gl.warp_specialize`): a 1-warp producer partition that only issues TMA
    loads (register budget 24 via setmaxnreg), and consumers doing the MMAs and the softmax with the
    registers left over under the kernel's `maxnreg` (240 each). Two variants (constexpr PINGPONG):
      - PINGPONG=False: one 8-warp consumer partition (2 warpgroups, 64 rows each, of a 128-row tile);
        Triton's partition-wide `bar.sync`s (emitted with every mbarrier.arrive) keep both in lockstep.
      - PINGPONG=True: two 4-warp consumer partitions (the default one and a worker), 64 query rows
        each, sharing the K/V ring (empty barriers count two arrivals), taking turns at the tensor cores
        through a pair of mbarriers (FA3's inter-warpgroup pingpong: one warpgroup's softmax runs while
        the other's GEMMs are issued).
  * `warpgroup_mma(..., is_async=True)` + `warpgroup_mma_wait` for S = Q K^T (both from shared
    memory, K^T a permuted view) and for O += P V with P kept in registers as the A operand
    (DotOperandLayout(0, O's wgmma layout, k_width=2)), never written to shared memory.
  * FA3's intra-warpgroup overlap: in step j the QK^T of tile j and the PV of tile j-1 are both in
    flight while the softmax of tile j waits only on the QK^T (wait with num_outstanding=1), so the
    exponentials overlap the PV tensor-core work.
  * Online softmax in base 2 (scale folded with log2(e) into one multiply-subtract), masked
    steps guarded so a row with no allowed key yields O = 0 and LSE = -inf, never NaN.
  * Causal: key tiles beyond the query tile's diagonal are never loaded; only the diagonal tiles
    (and the ragged last tile when N is not a multiple of BLOCK_N) pay for the mask, in a second
    loop compiled with MASKED=True; query tiles are scheduled heaviest-first.

What it does not do (yet):
  * The pingpong turn-taking uses mbarriers, not FA3's named barriers (bar.sync/bar.arrive with ids);
    Gluon 3.6 exposes no named-barrier primitive. Whether it actually overlaps as intended is for the
    profiler on the GPU to tell.
  * 12-warp (3 consumer warpgroups, FA3's 192-row tile for D=64) is not possible as one partition:
    num_warps must be a power of two.
  * No persistent/tile-scheduled grid, no cluster / TMA multicast of K/V, no FP8.
  * The O epilogue TMA-stores full tiles (through Q's shared buffer, dead by then) but falls back to a
    masked pointer store from the accumulator layout for the ragged last tile of a head: a 2-D TMA
    store would spill into the next head's rows (a 3-D/4-D descriptor would fix it; not tried yet).
  * Ragged K/V tiles read the next head's rows (or TMA's zero fill at the tensor's end) and mask them;
    harmless (finite values, P = 0) but wasted bandwidth on the last tile.
  * No backward pass, no dropout, no bottom-right causal, no varlen/paged KV.
"""

from __future__ import annotations

import attngen

# Specs the family serves, built for Hopper: their modules hold the Gluon kernels and their host code.
_MODULES = {False: attngen.build("attention hopper_tools\n", target="h200").module,
            True: attngen.build("attention hopper_tools_causal\nmask: causal\n", target="h200").module}
_MODULE = _MODULES[False]

# head_dim -> (BLOCK_M, BLOCK_N, STAGES): the plan's tiles for the family (bf16; fp16 takes the same).
CONFIGS = {d: tuple(tiles["hopper"][i] for i in (0, 1, 3))
           for (d, dv, dtype), tiles in _MODULE.FAMILY_TILES.items() if d == dv and dtype == "bf16"
           and d in _MODULE.HOPPER_HEAD_DIMS}


def launch_config(head_dim: int, causal: bool, block_n: int | None = None, stages: int | None = None,
                  pingpong: bool = False):
    """(BLOCK_M, BLOCK_N, STAGES, num_warps, maxnreg): the family's, or the overrides of a sweep."""
    block_m, default_n, default_stages = CONFIGS[head_dim]
    block_n = block_n or default_n
    # gl.arange (the mask's key offsets) needs a power of two; TMA boxes are at most 256 rows.
    assert block_n in (32, 64, 128, 256), f"BLOCK_N={block_n} must be a power of two in [32, 256]"
    return (block_m, block_n, stages or default_stages, *_MODULE._hopper_launch_config(block_m, pingpong))


def prepare(q, k, v, causal: bool = False, sm_scale: float | None = None, block_n: int | None = None,
            stages: int | None = None, pingpong: bool = False):
    """run() -> (out, lse) for these tensors, descriptors built once (so timing leaves their host cost out)."""
    D = q.shape[-1]
    assert sm_scale in (None, D ** -0.5), "the specs here take the default scale, 1 / sqrt(D)"
    block_m, block_n, stages, _, _ = launch_config(D, causal, block_n, stages, pingpong)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return _MODULES[causal]._hopper_prepare(q, k, v, [], (), block_m, block_n, stages, pingpong)


def attention(q, k, v, causal: bool = False, sm_scale: float | None = None, block_n: int | None = None,
              stages: int | None = None, pingpong: bool = False):
    """out, lse = attention(q, k, v); q (B, H, N, D), k/v (B, HKV, N, D) on a Hopper GPU."""
    return prepare(q, k, v, causal, sm_scale, block_n, stages, pingpong)()
