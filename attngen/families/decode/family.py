"""The decode family's plan entry: which specs it serves, its per-call rule and its tiles."""

from __future__ import annotations

from attngen.analysis import Analysis
from attngen.plan.family import Family
from attngen.plan.targets import Target

# Rows of one decode tile: the queries of all the query heads that share a key/value head.
DECODE_MAX_ROWS = 64


def _decode_problem(facts: Analysis, target: Target) -> str | None:
    if facts.mask_reads_head:
        return ("its mask reads the query head h, and a decode tile packs the query heads of one key/value "
                "head together, whose tile bounds could then differ")
    return None


def _decode_tiles(target: Target, d: int, dv: int, dtype: str, plain: bool) -> tuple[tuple[int, int, int, int], str]:
    if target.interpreter:
        return (DECODE_MAX_ROWS, 16, 4, 1), "decode: BLOCK_N=16, 1 stage in the interpreter (tests cross tiles)"
    block_n = 64 if max(d, dv) <= 128 else 32
    if dtype == "f32":
        block_n //= 2
    return ((DECODE_MAX_ROWS, block_n, 4, 3),
            f"decode: BLOCK_N={block_n}, 4 warps, 3 stages: a memory-bound loop over key tiles; "
            f"{3 * block_n * (d + dv) * (4 if dtype == 'f32' else 2) // 1024} KiB of K/V in flight per program")


FAMILY = Family(
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
    gathers_every_tile=True,
)
