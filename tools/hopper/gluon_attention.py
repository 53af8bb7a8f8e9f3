"""The Hopper family's Gluon forward for the tools here (gpu_bench.py), with the knobs the family fixes
(BLOCK_N, STAGES, the one-consumer variant) open for sweeps.

The kernels are the family's (attngen/families/hopper: its template's comments say what they do and
how), taken from modules built for the H200 of two specs, plain attention and `causal`: q (B, H, N, D),
k/v (B, HKV, N, D) with GQA, bf16 or fp16. `attention()` returns O in the input dtype and the natural-log
LSE (B, H, N) in float32. What the family does not do yet is in issue 13's closing notes and NOTES.md.
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
    return _MODULES[causal]._hopper_prepare(q, k, v, [], (), block_m, block_n, stages, pingpong=pingpong)


def attention(q, k, v, causal: bool = False, sm_scale: float | None = None, block_n: int | None = None,
              stages: int | None = None, pingpong: bool = False):
    """out, lse = attention(q, k, v); q (B, H, N, D), k/v (B, HKV, N, D) on a Hopper GPU."""
    return prepare(q, k, v, causal, sm_scale, block_n, stages, pingpong)()
