"""Runs every analysis of a spec once: the one frozen Analysis that planning, emission and reports read."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from attngen import intervals, ir
from attngen.errors import SpecWarning
from attngen.analysis import spans
from attngen.analysis import derivatives
from attngen.analysis import gathers
from attngen.analysis import integers
from attngen.analysis.spans import Region


@dataclass(frozen=True, eq=False)
class Analysis:
    """What the later stages need to know about a spec, computed once by `analyze`.

    regions: per loop index ('k': the loop over keys for one query tile, as the forward and dQ
    kernels run it; 'q': over queries for one key tile, dK/dV) the closed-form spans of allowed
    and fully allowed elements (spans.region). loop_bounds: the same spans as the kernels compute
    them, in int64 that provably cannot wrap (integers.exact_span), which the emitted loop bounds
    and the tile map follow.
    tile_table: the kernels follow tile tables (spans.needs_tile_table: the closed-form spans are not
    proven exact), built from the inputs in `table_reads` (at call time; kept per sizes when there are
    none: plan.visits), with one point per `block_steps` block; a table differs per
    batch (per head) only when the mask reads b (h or hkv): table_per_batch, table_per_head.
    table_sizes: the call's sizes a tile table depends on: Q_LEN and KV_LEN (its grid), and of B, H and HKV
    those the mask reads, itself or through b, h and hkv (a table for masks that read no inputs is kept per
    these: runtime.tables).
    mask_reads_head: the mask reads the query head h (not only hkv), so its tile bounds may differ
    between the query heads of one key/value head.
    narrow: most visited tiles are partial, so the planner starts from smaller tiles.
    gather_bytes: what the spec's loads indexed by both q and k read per score element.
    score_gathers: the score's loads read at both q and k, each with whether the kernels read it as
    point loads (gathers.score_gathers).
    score_derivative: d score'/d score (None without a score expression); learnable_derivatives:
    each learnable input's load in the score with d score'/d load, for the backward kernels.
    length_limit, length_culprit: the longest Q_LEN/KV_LEN at which the kernels' ints are exact,
    and the expression that overflows beyond it (None: positions are int32).
    ranges: every int's range at lengths up to length_limit (the kernels' int widths).
    source: the spec as written; `spec` is what the kernels run, each of its `reductions` (sum(x[b, :]))
    read as an input of its own that the host computes before the kernels (ir.without_reductions).
    """
    spec: ir.Spec
    source: ir.Spec
    reductions: tuple[ir.Reduction, ...]
    params: Mapping[str, int | float]
    regions: Mapping[str, Region]
    loop_bounds: Mapping[str, Region]
    tile_table: bool
    table_reads: tuple[str, ...]
    table_per_batch: bool
    table_per_head: bool
    table_sizes: tuple[str, ...]
    mask_reads_head: bool
    block_steps: Mapping[str, int | None]
    narrow: bool
    gather_bytes: int
    score_gathers: tuple[tuple[ir.Load, bool], ...]
    score_derivative: ir.Expr | None
    learnable_derivatives: tuple[tuple[ir.Load, ir.Expr], ...]
    length_limit: int
    length_culprit: ir.Expr | None
    ranges: intervals.Ranges


def _warn_mask_allows_nothing(spec: ir.Spec) -> None:
    read = [f"{p.name}={p.value}" for p in spec.params if ir.uses(spec.mask, ir.Param, p.name)]
    warnings.warn(SpecWarning(
        f"spec {spec.name!r}: the mask allows no key to any query, at every length"
        f"{' with ' + ', '.join(read) if read else ''}: every output row is 0 and its LSE -inf"), stacklevel=3)


# The sizes each index variable stands for: a table of a mask reading hkv = h // (H // HKV) differs with H and HKV.
_VAR_SIZES = {"b": ("B",), "h": ("H",), "hkv": ("H", "HKV")}


def _table_sizes(mask: ir.Expr | None) -> tuple[str, ...]:
    """The sizes a tile table of `mask` depends on, of the table kernels' (B, H, HKV, Q_LEN, KV_LEN)."""
    read = {"Q_LEN", "KV_LEN"}
    for node in ir.walk(mask) if mask is not None else ():
        if isinstance(node, ir.Size):
            read.add(node.name)
        elif isinstance(node, ir.Var):
            read.update(_VAR_SIZES.get(node.name, ()))
    return tuple(n for n in ("B", "H", "HKV", "Q_LEN", "KV_LEN") if n in read)


def analyze(spec: ir.Spec) -> Analysis:
    """Every fact about `spec` that planning, emission and the reports use."""
    source = spec
    spec, reductions = ir.without_reductions(source)
    params = spec.param_values
    if spans.allows_nothing(spec.mask, params):
        _warn_mask_allows_nothing(spec)
    # The limit and its culprit from the text as written (a reduction is bounded the same either way).
    limit, culprit = intervals.length_limit(source)
    regions = spans.regions(spec.mask, params)
    steps = spans.block_steps(spec.mask, params)
    mask_vars = {n.name for n in ir.walk(spec.mask) if isinstance(n, ir.Var)} if spec.mask is not None else set()
    ranges = intervals.Ranges(intervals.box(spec, limit, reductions))
    score_derivative = derivatives.derivative(spec.score, ir.Score()) if spec.score is not None else None
    loop_bounds = {loop: spans.Region(integers.exact_span(region.visit, ranges, limit, inner=False),
                                      integers.exact_span(region.full, ranges, limit, inner=True), region.exact)
                   for loop, region in regions.items()}
    return Analysis(
        spec=spec,
        source=source,
        reductions=reductions,
        params=MappingProxyType(params),
        regions=MappingProxyType(regions),
        loop_bounds=MappingProxyType(loop_bounds),
        tile_table=spans.needs_tile_table(spec.mask, params, regions),
        table_reads=spans.mask_inputs(spec),
        table_per_batch="b" in mask_vars,
        table_per_head=bool(mask_vars & {"h", "hkv"}),
        table_sizes=_table_sizes(spec.mask),
        mask_reads_head="h" in mask_vars,
        block_steps=MappingProxyType(steps),
        narrow=spans.is_narrow(spec.mask, params, regions, steps),
        gather_bytes=derivatives.gather_bytes(spec),
        score_gathers=gathers.score_gathers(spec, ranges),
        score_derivative=score_derivative,
        learnable_derivatives=tuple((load, derivatives.derivative(spec.score, load)) for load in derivatives.learnable_loads(spec)),
        length_limit=limit,
        length_culprit=culprit,
        ranges=ranges,
    )
