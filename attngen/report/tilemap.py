"""The tile map of a spec at given lengths: which tiles each kernel skips, runs unmasked or masks, and what that costs.

For masks the analysis bounds in closed form, the map is computed exactly as the kernels
compute their loops (the spans of `spans.region`, cut into tiles the way `_tile_ranges`
in the generated module cuts them). A mask that reads no input but has no exact closed form
gets a static tile table, which is the mask itself tile by tile: its map is the reference mask
evaluated at the given lengths. Masks that read inputs get their tile table at call time; for
them the map holds what is known statically (the interval classifier of `intervals.py`: tiles
it proves empty or full whatever the inputs), and the rest is marked as decided at run time.
`closed_form_map` gives what the closed-form hull would visit, which `attngen explain` sets
against a table's tiles. `attngen explain` prints and draws this.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from attngen.analysis import spans
from attngen.analysis import Analysis
from attngen.intervals import TileBox, TileClass, classify
from attngen.analysis.bounds import RuntimeDecided, bound_value, uniform_env
from attngen.reference import evaluate_expr, make_env

EMPTY, PARTIAL, FULL = 0, 1, 2
MAX_CLASSIFIED_TILES = 1 << 18  # the interval classifier runs in Python, one call per tile
MAX_EVALUATED_PAIRS = 1 << 28  # a static table's map evaluates the mask on every pair, a row of tiles at a time


@dataclass(frozen=True)
class TileMap:
    """One kernel's tiles: grid[row tile, loop tile] is EMPTY, PARTIAL or FULL; `exact`: the kernels
    visit exactly the non-empty tiles (else the partial ones are decided at run time)."""
    block_rows: int
    block_cols: int
    grid: torch.Tensor  # uint8 (rows, cols)
    exact: bool
    how: str

    def counts(self) -> dict[str, int]:
        return {name: int((self.grid == value).sum()) for name, value in
                (("full", FULL), ("partial", PARTIAL), ("empty", EMPTY))}


def _span(span: spans.Span | None, tile, env, length: int) -> tuple[int, int]:
    """Element bounds [lo, hi) clamped to the sequence, as the generated bounds code does."""
    if span is None:
        return 0, 0
    lo, hi = bound_value(span.lo, tile, env), bound_value(span.hi, tile, env)
    return max(lo, 0) if lo is not None else 0, min(hi + 1, length) if hi is not None else length


def tile_ranges(lo: int, hi: int, full_lo: int, full_hi: int, block: int) -> tuple[int, int, int, int]:
    """The generated module's `_tile_ranges`: masked [t0, t1), unmasked [t1, t2), masked [t2, t3)."""
    hi = max(hi, lo)
    start = lo // block
    end = -(-hi // block) if hi > lo else start
    first_full = -(-max(full_lo, lo) // block)
    last_full = min(full_hi, hi) // block
    if first_full >= last_full:
        first_full = last_full = end
    return start, first_full, last_full, end


def _grid(sizes: dict[str, int], block_m: int, block_n: int, by_query: bool):
    """(rows' length, columns' length, block of rows, block of columns, row tiles, column tiles)."""
    q_len, kv_len = sizes["Q_LEN"], sizes["KV_LEN"]
    rows_len, cols_len = (q_len, kv_len) if by_query else (kv_len, q_len)
    block_rows, block_cols = (block_m, block_n) if by_query else (block_n, block_m)
    return rows_len, cols_len, block_rows, block_cols, -(-rows_len // block_rows), -(-cols_len // block_cols)


def closed_form_map(facts: Analysis, sizes: dict[str, int], block_m: int, block_n: int, by_query: bool = True,
                    b: int = 0, h: int = 0, inputs: dict[str, torch.Tensor] | None = None) -> TileMap | None:
    """What the closed-form spans visit (as tile_map's arguments), whether or not the kernels follow them;
    None when they read an input not given."""
    rows_len, cols_len, block_rows, block_cols, n_rows, n_cols = _grid(sizes, block_m, block_n, by_query)
    grid = torch.zeros((n_rows, n_cols), dtype=torch.uint8)
    loop, other = ("k", "q") if by_query else ("q", "k")
    reg = facts.loop_bounds[loop]
    env = uniform_env(facts.spec, sizes, b, h, inputs)
    try:
        for r in range(n_rows):
            first = r * block_rows
            tile = {f"{other}0": first, f"{other}1": min(first + block_rows, rows_len) - 1}
            lo, hi = _span(reg.visit, tile, env, cols_len)
            full_lo, full_hi = _span(reg.full, tile, env, cols_len)
            t0, t1, t2, t3 = tile_ranges(lo, hi, full_lo, full_hi, block_cols)
            grid[r, t0:t3] = PARTIAL
            grid[r, t1:t2] = FULL
    except RuntimeDecided:
        return None  # bounds read an input (prefix[b])
    exact = reg.exact
    return TileMap(block_rows, block_cols, grid, exact,
                   "closed-form loop bounds (exact)" if exact else "closed-form loop bounds (a hull)")


def mask_map(facts: Analysis, sizes: dict[str, int], block_m: int, block_n: int, by_query: bool = True,
             b: int = 0, h: int = 0) -> TileMap | None:
    """The tiles a mask that reads no input allows, from the reference mask evaluated at these sizes (a
    static tile table lists exactly these); None past MAX_EVALUATED_PAIRS pairs."""
    rows_len, cols_len, block_rows, block_cols, n_rows, n_cols = _grid(sizes, block_m, block_n, by_query)
    if rows_len * cols_len > MAX_EVALUATED_PAIRS:
        return None
    env = make_env(facts.spec, **sizes)
    hkv = h // (sizes["H"] // sizes["HKV"])
    at = {name: torch.tensor(value).view(1, 1, 1, 1) for name, value in (("b", b), ("h", h), ("hkv", hkv))}
    grid = torch.zeros((n_rows, n_cols), dtype=torch.uint8)
    pad = n_cols * block_cols - cols_len
    for r in range(n_rows):
        index = torch.arange(r * block_rows, min((r + 1) * block_rows, rows_len)).view(1, 1, -1, 1)
        row_var, col_var = ("q", "k") if by_query else ("k", "q")
        columns = torch.arange(cols_len).view(1, 1, 1, -1)
        values = {**env.values, **at, row_var: index, col_var: columns}
        allowed = evaluate_expr(facts.spec.mask, replace(env, values=values)).expand(1, 1, len(index[0, 0]), cols_len)
        allowed = allowed[0, 0]
        tiles = torch.nn.functional.pad(allowed, (0, pad)).view(allowed.shape[0], n_cols, block_cols)
        some = tiles.any(2).any(0)
        every = torch.nn.functional.pad(allowed, (0, pad), value=False).view(allowed.shape[0], n_cols, block_cols)
        every = every.all(2).all(0)
        grid[r] = torch.where(every, FULL, torch.where(some, PARTIAL, EMPTY)).to(torch.uint8)
    return TileMap(block_rows, block_cols, grid, True, "the mask evaluated at these lengths (its static tile table: exact)")


def tile_map(facts: Analysis, sizes: dict[str, int], block_m: int, block_n: int, by_query: bool = True,
             b: int = 0, h: int = 0, inputs: dict[str, torch.Tensor] | None = None) -> TileMap:
    """The tile map of batch b, head h for tiles (block_m, block_n); rows are query tiles (forward,
    dQ) when by_query, else key tiles (dK/dV, block_n rows). Given `inputs`, loop bounds that read
    them (prefix[b]) are evaluated too."""
    spec, params = facts.spec, dict(facts.params)
    rows_len, cols_len, block_rows, block_cols, n_rows, n_cols = _grid(sizes, block_m, block_n, by_query)
    grid = torch.zeros((n_rows, n_cols), dtype=torch.uint8)
    if not facts.tile_table:
        closed = closed_form_map(facts, sizes, block_m, block_n, by_query, b, h, inputs)
        if closed is not None:
            return closed
    elif not facts.table_reads:
        evaluated = mask_map(facts, sizes, block_m, block_n, by_query, b, h)
        if evaluated is not None:
            return evaluated
    if n_rows * n_cols > MAX_CLASSIFIED_TILES:
        grid.fill_(PARTIAL)
        return TileMap(block_rows, block_cols, grid, False,
                       f"decided at run time ({n_rows * n_cols} tiles: too many to classify here)")
    uniform = {"b": (b, b), "h": (h, h), "hkv": (h // (sizes["H"] // sizes["HKV"]),) * 2}
    for r in range(n_rows):
        for c in range(n_cols):
            rows = (r * block_rows, min((r + 1) * block_rows, rows_len) - 1)
            cols = (c * block_cols, min((c + 1) * block_cols, cols_len) - 1)
            q_range, k_range = (rows, cols) if by_query else (cols, rows)
            verdict = classify(spec.mask, TileBox(q_range, k_range, params, sizes, uniform))
            overhang = (c + 1) * block_cols > cols_len  # the kernels mask a tile that runs past the end
            grid[r, c] = {TileClass.EMPTY: EMPTY, TileClass.PARTIAL: PARTIAL,
                          TileClass.FULL: PARTIAL if overhang else FULL}[verdict]
    return TileMap(block_rows, block_cols, grid, False,
                   "interval bounds; tiles not proven full or empty are decided at run time by the tile-table kernel")


@dataclass(frozen=True)
class Costs:
    """Per (batch, head): FLOPs of the tiles visited against dense attention, and HBM bytes moved
    (the FlashAttention paper's IO analysis, with the visited tiles) against standard attention."""
    flops: float
    dense_flops: float
    hbm_bytes: float
    standard_hbm_bytes: float


def forward_costs(m: TileMap, q_len: int, kv_len: int, d: int, dv: int, element_bytes: int) -> Costs:
    """Forward pass: each query tile reads Q once, K and V once per visited key tile, writes O and LSE.
    Standard attention writes S and P (N x N each) to HBM and reads them back (Algorithm 0)."""
    visited = int((m.grid != EMPTY).sum())
    tile_elems = m.block_rows * m.block_cols
    flops = 2.0 * visited * tile_elems * (d + dv)
    dense = 2.0 * q_len * kv_len * (d + dv)
    hbm = element_bytes * (q_len * d + q_len * dv + visited * m.block_cols * (d + dv)) + 4 * q_len
    standard = element_bytes * (q_len * d + kv_len * d + kv_len * dv + q_len * dv + 4 * q_len * kv_len)
    return Costs(flops, dense, hbm, standard)


def describe_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


def describe_flops(n: float) -> str:
    exp = int(math.log10(n)) // 3 if n >= 1 else 0
    unit = ["", "K", "M", "G", "T", "P"][min(exp, 5)]
    return f"{n / 1000 ** min(exp, 5):.2f} {unit}FLOP"
