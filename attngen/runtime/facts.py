"""What a generated module declares about its spec: the facts its host code reads (SpecFacts) and its
kernels (Kernels), each one frozen object."""

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Mapping


def shape_table(*rows):
    """A table keyed by (HEAD_DIM_PAD, HEAD_DIM_V_PAD, dtype), as a module writes it: rows
    ((head dims, value head dims, dtypes), value), each giving one value to every key of that product
    (the planner's choices repeat over most of the 75 keys; the emitter groups them, emit.module._shape_rows)."""
    table = {}
    for (head_dims, value_head_dims, dtypes), value in rows:
        for key in itertools.product(head_dims, value_head_dims, dtypes):
            if key in table:
                raise ValueError(f"shape_table: the key {key} is given twice")
            table[key] = value
    return table


@dataclass(frozen=True)
class SpecFacts:
    """The facts of one spec under one plan, written by the emitter (attngen.emit.module) as literals.

    Field by field: the spec's name and fingerprint; the digest of its module's code, which names its
    custom operators; inputs, name -> (dtype, dims, learnable), dims being B H HKV Q_LEN KV_LEN, ints or
    "*"; plan, (HEAD_DIM_PAD, HEAD_DIM_V_PAD, dtype) -> the tiles (BLOCK_M, BLOCK_N, num_warps, num_stages)
    of the forward, dK/dV and dQ kernels; tile_table, whether the kernels follow tile tables (the
    analysis does not prove the closed-form tile ranges exact), table_reads the inputs the mask reads
    and table_per_b/h whether a table differs per batch and head; table_steps, per index q and k, the
    step the mask reads it by (q // step: one point per block decides a tile; 0: every element; None:
    not read); static_tables, for a mask that reads no input, the sizes its tables depend on (the runtime
    builds each table once per tiling and those sizes, and keeps it), None for tables built in every call;
    one_launch_backward, whether dK/dV and dQ run as one launch; max_length and its reason,
    the longest Q_LEN and KV_LEN at which the kernels' int arithmetic is exact; max_batch_heads, the
    launch grid's limit on B * H; masked_width_floor, the least tile width of a head dim that is not a
    power of two; family_tiles, (HEAD_DIM_PAD, HEAD_DIM_V_PAD, dtype) -> family -> (BLOCK_M, BLOCK_N,
    num_warps, num_stages, buffers); softmax_scale(D), the score scale; and the families beside the
    portable one: forward_families in order of preference, table_families those whose forward follows
    the mask's tile tables, backward_families (family, its backward's tile key) in order of preference,
    packed_families and packed_backward_families those that serve packed calls, dropout_families those whose
    kernels apply dropout (a call's dropout_p > 0; the portable family does too), fp8_families those whose
    forward takes FP8 calls (the portable one does too); sink, the spec's `sink:`
    logit as a literal tree (attngen.runtime.sinks), or None without one; reductions, (name, op, source,
    dims) for each input the host computes from a call's inputs (sum(x[b, :])), the last ones of `inputs`;
    normalize, "softmax" or "sigmoid" (its kernels neither write nor read LSE and row terms).
    """
    name: str
    fingerprint: str
    digest: str
    inputs: Mapping[str, tuple]
    plan: Mapping[tuple, tuple]
    tile_table: bool
    table_reads: tuple
    table_per_b: bool
    table_per_h: bool
    table_steps: Mapping[str, Any]
    one_launch_backward: bool
    max_length: int
    max_length_reason: str
    max_batch_heads: int
    masked_width_floor: int
    family_tiles: Mapping[tuple, Mapping[str, tuple]]
    softmax_scale: Callable[[int], float]
    forward_families: tuple = ()
    table_families: tuple = ()
    backward_families: tuple = ()
    packed_families: tuple = ()
    packed_backward_families: tuple = ()
    dropout_families: tuple = ()
    fp8_families: tuple = ()
    sink: tuple | None = None
    reductions: tuple = ()
    normalize: str = "softmax"
    static_tables: tuple | None = None

    @property
    def sigmoid(self):
        return self.normalize == "sigmoid"


@dataclass(frozen=True)
class Kernels:
    """The portable family's kernels of one spec: its forward, the backward's row-terms pass and its
    backward, and the tile-table kernels (classify by query or key tile, compact)."""
    forward: Any
    bwd_preprocess: Any
    backward: Any
    table_by_query_classify: Any
    table_by_key_classify: Any
    table_compact: Any
