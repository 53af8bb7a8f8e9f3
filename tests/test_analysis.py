"""Soundness of the mask analysis (attngen.analysis.region) against the reference mask on small grids, and
exactness where it claims it: the tiles the kernels would visit are those with an allowed element."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attngen import ir
from attngen.analysis.spans import Region, Span, region
from attngen.api import parse_spec, with_params
from attngen.reference import evaluate_expr, make_env
from attngen.analysis.bounds import bound_value, uniform_env
from attngen.report.tilemap import tile_ranges

B, H = 2, 2
MAX_LEN = 20

HEADER = """\
attention analysis_check
param w = 4
input prefix: i32[B]
"""

MASKS = [
    "causal",
    "causal_bottom_right",
    "causal and q - k < w",
    "causal_bottom_right and q + KV_LEN - Q_LEN - k < w",
    "q - k >= 3 and q - k < 9",
    "k < prefix[b] or causal",
    "q >= k or k < prefix[b] and q < 3",
    "k >= prefix[b] - 2 * h",
    "not (k > q)",
    "not not causal",
    "not causal",
    "not (q - k >= 3 and q - k < 9)",
    "not (q < k or k < 2)",
    "q // 4 == k // 4 and causal",
    "k // 2 <= q",
    "q - k < w and q * k < 20",
    "q == k",
    "q != k",
    "2*q >= k",
    "3 * k <= 2 * q + 1",
    "3 * q - 2 * k >= -1 and 2 * k - q <= 7",
    "-q <= -k",
    "k - q > -w",
    "q - k >= 0 - w * 2",
    "k <= 5",
    "q >= 2",
    "q >= hkv",
    "(q - k >= 0 and q - k < 3) or (k - q >= 5 and k - q < 7)",
    "(q - k >= 0 and q - k < 3) or k < 2 or q - k >= 10",
    "0 <= q - k < w or 0 <= k - q < w",
    "k < 3 or k > 8",
    "q // 4 == k // 4",
    "q >> 2 == k >> 2 and causal",
    "(q + 1) >> 1 >= k >> 3",
    "(q + 1) // 3 == (k + prefix[b]) // 3 and causal",
    "k // 3 >= q // 5 - 1",
    "q // 3 <= k // 3 or k < 2",
    "q // 4 == k // 4 and q - k >= 2",
    "k >= q // 2 and k <= q",
    "q + k < 20",
    "q >= 3 and k >= q - 2 * w",
    "k - q <= w and q < prefix[b] + 2",
    "q >= 3 and q <= 10 and k < 5",
    "q >= 10 and q <= 5 and k < 3",
    "not (q >= 3 and q < prefix[b] + w)",
    "(k < prefix[b] or causal) and q >= 3",
    "(k < prefix[b] or causal) and q - k < w",
    "q < 3 or causal",
    "q >= 3 or causal",
    "causal and q - k < 0",
    "abs(q - k) <= w or q < 3 or k < 3",
    # The diagonal family with gates on a row (their implied bounds added) and bounds on a column.
    "q >= 3 and q // 4 == k // 4",
    "k > 5 and q // 4 == k // 4",
    "q >= 3 and q <= 12 and (q + 1) // 3 >= k // 3",
    "q >= 3 and k >= q // 2 and k <= q",
    "q >= prefix[b] and q // 4 == k // 4",
    "q >= w and (q + 2) // 3 == (k + 2) // 3 and k < 17",
    "q >= 10 and q <= 5 and q // 4 == k // 4",
    # Translations (a block at global positions): exact where the mask they translate is.
    "(q + 3) // 4 == (k + 5) // 4 and q + 3 >= k + 5",
    "q + 2 - (k + w) < w and q + 2 >= k + w",
    "q + 6 >= k + 1 and k + 1 >= (q + 6) // 2",
    "h < 1 or causal",
    "k < prefix[b]",
    "q < prefix[b] and k < 7",
    "not (q // 4 == k // 4) and q >= k",
    "true",
    "false",
]
# A non-affine part the analysis cannot bound must stay partial: no tile is ever called full through it.
NON_AFFINE = {"q - k < w and q * k < 20", "q != k"}


# --- the analysis' bounds, evaluated as the kernels evaluate them (attngen.tilemap) ---------------

def span_range(span: Span, tile, env, n: int) -> range:
    """The part of 0..n-1 that a span covers."""
    lo, hi = bound_value(span.lo, tile, env), bound_value(span.hi, tile, env)
    return range(max(0, lo if lo is not None else 0), min(n, (hi if hi is not None else n - 1) + 1))


# --- the check -----------------------------------------------------------------------------------

def allowed_grid(spec: ir.Spec, q_len: int, kv_len: int, prefix: list[int]):
    """The mask on the whole grid, and what a bound may read at (b, h): env_at(b, h)."""
    sizes = dict(B=B, H=H, HKV=H, Q_LEN=q_len, KV_LEN=kv_len, D=16)
    inputs = {"prefix": torch.tensor(prefix, dtype=torch.int32)}
    allowed = evaluate_expr(spec.mask, make_env(spec, **sizes, inputs=inputs))
    assert allowed.dtype == torch.bool

    def env_at(b: int, h: int):
        return uniform_env(spec, sizes, b, h, inputs)
    return env_at, allowed.expand(B, H, q_len, kv_len)


def check_tile(reg: Region, loop: str, allowed, env, t0: int, t1: int) -> None:
    """(a) every allowed element of the tile's rows lies in `visit`; (b) every element of `full`
    (inside the grid) is allowed for every in-grid row of the tile."""
    other = "q" if loop == "k" else "k"
    tile = {f"{other}0": t0, f"{other}1": t1}
    grid = allowed if loop == "k" else allowed.transpose(-1, -2)  # (B, H, tile index, looped index)
    n = grid.shape[-1]
    rows = grid[:, :, t0:t1 + 1, :]
    if rows.shape[2] == 0:
        return
    for b in range(B):
        for h in range(H):
            some = rows[b, h].any(0).nonzero().flatten().tolist()
            where = f"b={b} h={h} tile {other}=[{t0}, {t1}] looping {loop}"
            if reg.visit is None:
                assert not some, f"{where}: visit is None but {loop} in {some} are allowed"
            else:
                visit = span_range(reg.visit, tile, env(b, h), n)
                outside = [j for j in some if j not in visit]
                assert not outside, f"{where}: allowed {loop}={outside} outside visit {visit}"
            if reg.full is not None:
                every = rows[b, h].all(0)
                full = span_range(reg.full, tile, env(b, h), n)
                wrong = [j for j in full if not every[j]]
                assert not wrong, f"{where}: {loop}={wrong} in full {full} but not always allowed"


@st.composite
def problems(draw):
    q_len = draw(st.integers(1, MAX_LEN))
    kv_len = draw(st.integers(1, MAX_LEN))
    w = draw(st.integers(0, 10))
    prefix = draw(st.lists(st.integers(0, kv_len + 2), min_size=B, max_size=B))
    loop = draw(st.sampled_from("kq"))
    n_other = q_len if loop == "k" else kv_len
    t0 = draw(st.integers(0, n_other - 1))
    t1 = draw(st.integers(t0, t0 + 8))  # a last tile may run past the end of the grid
    block = draw(st.integers(1, 8))
    return q_len, kv_len, w, prefix, loop, (t0, t1), block


@pytest.mark.parametrize("mask", MASKS)
@settings(derandomize=True, max_examples=60, deadline=None)
@given(problem=problems())
def test_region_is_sound(mask, problem):
    q_len, kv_len, w, prefix, loop, (t0, t1), block = problem
    spec = with_params(parse_spec(f"{HEADER}mask: {mask}\n"), {"w": w})
    params = {p.name: p.value for p in spec.params}
    reg = region(spec.mask, loop, params)
    env, allowed = allowed_grid(spec, q_len, kv_len, prefix)
    check_tile(reg, loop, allowed, env, t0, t1)
    # Every tile of a block-aligned tiling, as the kernels cut the grid.
    n_other = q_len if loop == "k" else kv_len
    for start in range(0, n_other, block):
        check_tile(reg, loop, allowed, env, start, start + block - 1)
    if mask in NON_AFFINE:
        assert reg.full is None, "a mask part the analysis cannot bound must stay partial"


def check_exact(reg: Region, loop: str, allowed, env, block_rows: int, block_cols: int) -> None:
    """On a tiling of the grid (rows along the other index), the tiles the kernels visit are those with an
    allowed element, and those they run without mask code are those allowed everywhere."""
    other = "q" if loop == "k" else "k"
    grid = allowed if loop == "k" else allowed.transpose(-1, -2)
    n_rows, n = grid.shape[-2:]
    for b in range(B):
        for h in range(H):
            for r0 in range(0, n_rows, block_rows):
                tile = {f"{other}0": r0, f"{other}1": min(r0 + block_rows, n_rows) - 1}
                span = span_range(reg.visit, tile, env(b, h), n) if reg.visit is not None else range(0)
                full = span_range(reg.full, tile, env(b, h), n) if reg.full is not None else range(0)
                t0, t1, t2, t3 = tile_ranges(span.start, span.stop, full.start, full.stop, block_cols)
                rows = grid[b, h, r0:r0 + block_rows]
                for t in range(-(-n // block_cols)):
                    cols = rows[:, t * block_cols:(t + 1) * block_cols]
                    where = f"b={b} h={h} rows {tile} looping {loop}, tile {t} of {block_cols}"
                    assert (t0 <= t < t3) == bool(cols.any()), f"{where}: visited {t0 <= t < t3}"
                    every = bool(cols.all()) and (t + 1) * block_cols <= n
                    assert (t1 <= t < t2) == every, f"{where}: unmasked {t1 <= t < t2}, full {every}"


@pytest.mark.parametrize("mask", MASKS)
@settings(derandomize=True, max_examples=25, deadline=None)
@given(problem=problems(), blocks=st.tuples(st.integers(1, 9), st.integers(1, 9)))
def test_region_is_exact_where_it_says_so(mask, problem, blocks):
    q_len, kv_len, w, prefix, loop, _, _ = problem
    spec = with_params(parse_spec(f"{HEADER}mask: {mask}\n"), {"w": w})
    reg = region(spec.mask, loop, spec.param_values)
    if reg.exact:
        env, allowed = allowed_grid(spec, q_len, kv_len, prefix)
        check_exact(reg, loop, allowed, env, *blocks)


@pytest.mark.parametrize("mask, exact", [
    ("causal", True), ("causal_bottom_right", True), ("causal and q - k < w", True),  # unit bounds
    ("q // 4 == k // 4 and causal", True), ("k >= q // 2 and k <= q", True),  # on the diagonal
    ("k < prefix[b] or causal", True), ("2*q >= k", True), ("q + k < 20", True),  # one-sided
    ("q >= 3 and k >= q - 2 * w", True),  # a plain gate: the bound it implies is added
    ("(k < prefix[b] or causal) and q >= 3", True), ("q >= 3 or causal", True),
    ("q >= 10 and q <= 5 and k < 3", False),  # two gates a tile straddles
    ("q >= 3 and q // 4 == k // 4", True), ("k > 5 and q // 4 == k // 4", True),  # gated and bounded diagonals
    ("q >= 3 and q <= 12 and (q + 1) // 3 >= k // 3", True), ("q >= 3 and k >= q // 2 and k <= q", True),
    ("q >= prefix[b] and q // 4 == k // 4", False),  # a gate's implied bound through a quotient needs a known int
    ("q >= 10 and q <= 5 and q // 4 == k // 4", False),  # two gates a tile straddles
    ("q // 4 == k // 4 and q - k >= 2", False), ("q < 3 or causal", False),
    ("causal and q - k < 0", False),  # a band of no diagonal, which a tall tile would still visit
    ("(q - k >= 0 and q - k < 3) or (k - q >= 5 and k - q < 7)", False),  # disjoint bands
    ("abs(q - k) <= w or q < 3 or k < 3", False), ("q - k < w and q * k < 20", False),
    # translated: q read only as q + A, k only as k + B (A, B >= 0 and uniform), as context parallelism's blocks
    ("(q + 3) // 4 == (k + 5) // 4 and q + 3 >= k + 5", True), ("q + 2 - (k + w) < w and q + 2 >= k + w", True),
    ("(q + 3) // 4 == k // 4 and q >= k", False),  # q read bare and shifted: no translation
    ("(q + 3) // 4 == (k + prefix[b]) // 4 and q + 3 >= k + prefix[b]", False),  # a shift that may be negative
])
def test_exactness_is_claimed_for_the_proven_families_only(mask, exact):
    spec = parse_spec(f"{HEADER}mask: {mask}\n")
    assert all(region(spec.mask, loop, spec.param_values).exact for loop in "kq") is exact


# --- precision on the catalog's masks: the bounds are the tight ones -----------------------------

def bounds(mask: str, loop: str, tile: tuple[int, int], q_len: int = 64, kv_len: int = 64, w: int = 4):
    spec = with_params(parse_spec(f"{HEADER}mask: {mask}\n"), {"w": w})
    reg = region(spec.mask, loop, {"w": w})
    env, _ = allowed_grid(spec, q_len, kv_len, [0] * B)
    other = "q" if loop == "k" else "k"
    t = {f"{other}0": tile[0], f"{other}1": tile[1]}

    def side(span):
        return None if span is None else (bound_value(span.lo, t, env(0, 0)), bound_value(span.hi, t, env(0, 0)))
    return side(reg.visit), side(reg.full)


def test_causal_is_tight():
    assert bounds("causal", "k", (16, 31)) == ((None, 31), (None, 16))
    assert bounds("causal", "q", (16, 31)) == ((16, None), (31, None))
    assert bounds("causal_bottom_right", "k", (0, 15), q_len=16, kv_len=64) == ((None, 63), (None, 48))


@pytest.mark.parametrize("mask", ["causal_bottom_right", "causal_bottom_right and q + KV_LEN - Q_LEN - k < w"])
def test_key_bounds_are_sound_in_cache_calls(mask):
    # The forward kernels' key bounds in a cache call: the query tile's ends are positions
    # q_offset + row, KV_LEN is the row's kv_len and Q_OFFSET its q_offset.
    spec = parse_spec(f"{HEADER}mask: {mask}\n")
    reg = region(spec.mask, "k", spec.param_values)
    q_len, max_kv = 7, 20
    sizes = dict(B=1, H=1, HKV=1, Q_LEN=q_len, KV_LEN=max_kv, D=16)
    inputs = {"prefix": torch.zeros(1, dtype=torch.int32)}
    for kv_len, q_offset in [(20, 13), (9, 2), (9, 0), (12, 30), (3, 5)]:
        cache = {"kv_len": torch.tensor([kv_len]), "q_offset": torch.tensor([q_offset])}
        allowed = evaluate_expr(spec.mask, make_env(spec, **sizes, inputs=inputs, **cache))
        allowed = (allowed & (torch.arange(max_kv) < kv_len)).expand(1, 1, q_len, max_kv)[0, 0]
        env = uniform_env(spec, {**sizes, "KV_LEN": kv_len, "Q_OFFSET": q_offset}, 0, 0, inputs)
        for t0 in range(q_len):
            for t1 in range(t0, q_len):
                tile = {"q0": q_offset + t0, "q1": q_offset + t1}
                where = f"kv_len={kv_len} q_offset={q_offset} rows {t0}..{t1}"
                visit = span_range(reg.visit, tile, env, kv_len)
                some = allowed[t0:t1 + 1].any(0).nonzero().flatten().tolist()
                assert all(j in visit for j in some), f"{where}: allowed keys {some} outside {visit}"
                full = span_range(reg.full, tile, env, kv_len)
                assert all(bool(allowed[t0:t1 + 1, j].all()) for j in full), f"{where}: {full} not all allowed"
                if mask == "causal_bottom_right":  # as tight as the rows' own call (keys up to the last row's)
                    assert max(visit.stop, 0) == max(0, min(kv_len, t1 + kv_len - q_len + 1))


def test_sliding_window_is_tight():
    # causal and q - k < w: k in [q - w + 1, q]
    assert bounds("causal and q - k < w", "k", (16, 31), w=4) == ((13, 31), (28, 16))
    assert bounds("causal and q - k < w", "q", (16, 31), w=4) == ((16, 34), (31, 19))


def test_mask_free_and_constant_masks():
    assert region(None, "k", {}) == Region(Span(None, None), Span(None, None))
    assert region(parse_spec("attention a\nmask: false\n").mask, "k", {}) == Region(None, None)
    assert region(parse_spec("attention a\nmask: true\n").mask, "q", {}) == Region(Span(None, None), Span(None, None))


def test_block_steps_find_block_constant_masks():
    from attngen.analysis.spans import block_steps

    def steps(mask, header="input l: bool[H, *, *]\ninput m: bool[*]\n"):
        return block_steps(parse_spec(f"attention a\n{header}mask: {mask}\n").mask, {})
    assert steps("l[h, q // 128, k // 64]") == {"q": 128, "k": 64}
    assert steps("m[k // 4] and m[k // 6]") == {"q": None, "k": 2}  # constant on blocks of gcd(4, 6)
    assert steps("l[h, q // 8, k // 8] and q >= k") == {"q": 0, "k": 0}  # q and k read whole
    assert steps("m[(k + 1) // 4]") == {"q": None, "k": 0}  # shifted blocks: not aligned
    assert steps("causal") == {"q": 0, "k": 0}


@pytest.mark.parametrize("mask, narrow", [
    ("q - k < 9 and q >= k", True),                   # sliding window: a band of constant width
    ("q // 16 == k // 16 and q >= k", True),          # chunks: the band moves one key per query
    ("(q + 5) // 12 == (k + 5) // 12", True),
    ("doc[q] == doc[k]", True),                       # documents: decided element by element
    ("l[h, q // 16, k // 16]", True),                 # a fine block layout
    ("l[h, q // 128, k // 128]", False),              # a coarse block layout: tiles rarely split a block
    ("q >= k", False),                                # causal: the band grows with q
    ("q - k < 9", False),                             # one side only
    ("k >= q // 2 and k <= q", False),                # both sides, but the band widens with q
    ("k < lens[b] or q >= k", False),                 # prefix-LM
    ("true", False),
])
def test_is_narrow_tells_banded_and_element_wise_masks_from_dense_ones(mask, narrow):
    from attngen.analysis.spans import is_narrow

    header = "input l: bool[H, *, *]\ninput doc: i32[KV_LEN]\ninput lens: i32[B]\n"
    assert is_narrow(parse_spec(f"attention a\n{header}mask: {mask}\n").mask, {}) is narrow
    assert is_narrow(None, {}) is False


@pytest.mark.parametrize("mask, nothing", [
    ("causal and q - k < window", True),                 # window = 0: a band of no diagonal
    ("causal and q - k < window + 1", False),
    ("q > k and k > q", True),
    ("q == k + 1 and k == q", True),                      # empty over the integers only
    ("not (q >= k or q < k)", True),
    ("(q < k and k < q) or causal", False),
    ("(q < k and k < q) or q < window", True),            # q >= 0
    ("causal and q - k < window and (q - k) % 2 == 0", True),  # the non-affine term is dropped
    ("k > q + 1000", False),                              # KV_LEN may exceed Q_LEN
    ("k < KV_LEN - Q_LEN + q and q < k", False),          # not proven: a size in the offset
    ("false", True),
    ("causal", False),
])
def test_allows_nothing_is_proven_only_for_empty_masks(mask, nothing):
    from attngen.analysis.spans import allows_nothing

    spec = parse_spec(f"attention a\nparam window = 0\nmask: {mask}\n")
    assert allows_nothing(spec.mask, spec.param_values) == nothing
    # Sound: the mask then allows no element of a grid, nor of a cache call's shifted rows.
    if nothing:
        assert not allowed_grid(spec, 24, 40, [0])[1].any()


def test_a_param_that_empties_the_mask_is_a_warning_naming_it():
    import warnings

    from attngen.analysis import analyze
    from attngen.errors import SpecWarning

    spec = parse_spec("attention sw\nparam window = 8\nmask: causal and q - k < window\n")
    with pytest.warns(SpecWarning, match=r"'sw': the mask allows no key to any query, at every length with window=-5"):
        analyze(with_params(spec, {"window": -5}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        analyze(with_params(spec, {"window": 1}))
