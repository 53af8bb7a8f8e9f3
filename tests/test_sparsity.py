"""Tile-level sparsity in the generated kernels: forward, dQ and dK/dV visit exactly the tiles
the mask allows, and run mask code exactly on the partial ones, for every mask.

The kernels count their visits (`visit_counts`); the truth comes from the reference mask,
tile by tile. Where the analysis proves its closed-form spans exact the kernels follow them;
every other mask gets a tile table, exact by construction: kept per sizes when the mask reads
no input (a static table), built at call time otherwise. A second check does not rely on the
counters at all: K and V poisoned with NaN in the tiles no query may see cannot reach the output.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
import torch

from hypothesis import example, given, settings

import attngen
from attngen import testing
from attngen.testing import strategies, visits
from attngen.analysis import analyze
from attngen.api import parse_spec
from attngen.report.tilemap import FULL, tile_map
from attngen.reference import evaluate_expr, make_env
from conftest import SLOW_IN_INTERPRETER, tiered

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = Path(__file__).parent.parent
SPECS = sorted(ROOT.joinpath("specs").glob("*.attn"))
SMALL_PARAMS = {"window": 21, "cap": 2.0, "chunk": 24, "block": 16}
# The published masks the benchmarks time (benchmarks/published), at sizes a 75-token grid of 16-wide tiles
# crosses: a 10 x 8 image, two halves of 37 tokens in blocks of 4, 2 x 2 tiles in a 4 x 4 grid and 11 text
# tokens, a band of 5 with 7 global tokens.
PUBLISHED = {
    "natten_2d": {"width": 8, "height": 10, "radius": 1},
    "block_diffusion": {"seq": 37, "block": 4},
    "sliding_tiles_text": {"tile_tokens": 4, "tiles_w": 4, "tiles_h": 4, "window": 1, "image": 64},
    "global_band": {"w": 5, "g": 7},
}
EXTRA_MASKS = {
    "q_mod": "mask: q % 3 == k % 3 or q - k > 40",           # not affine: a table without inputs
    "padding": "input lengths: i32[B]\nmask: k < lengths[b]",   # uniform load: closed form, gated
    "band_or": "mask: (q - k >= 0 and q - k < 9) or (k - q >= 30 and k - q < 40)",
    "chunk_off": "param c = 12\nmask: (q + 5) // c == (k + 5) // c",
    "not_chunk": "mask: not (q // 16 == k // 16) and causal",
    "chunk_lt": "param c = 3\nmask: (q + 1) // c < k // c",  # a bound c * (a + b) (found by fuzzing)
    # Diagonal masks with gates on rows and bounds on columns: closed form (the gates' implied bounds added).
    "gated_chunk": "param c = 12\nmask: q >= 3 and q // c == k // c",
    "bounded_chunk": "mask: k > 5 and (q + 1) // 8 >= k // 8 and q <= 60",
    # Block layouts not aligned with the tiles: the table kernel evaluates one point per block.
    "layout_odd": "input layout: bool[H, *, *]\nmask: layout[h, q // 6, k // 10]",
    "layout_k_only": "input keep: bool[*]\nmask: keep[k // 24] and not keep[k // 8]",
}


def _check_counts(name: str, counts: torch.Tensor, some: torch.Tensor, every: torch.Tensor) -> None:
    """Sound: every allowed tile visited once, no mask code skipped on a tile that is not full.
    Exact, too: no empty tile visited and no full tile masked."""
    counts = counts.cpu()
    assert set(counts.unique().tolist()) <= {0, 1, 16}, f"{name}: a tile was visited twice"
    visited, unmasked = counts != 0, counts == 16
    missed = some & ~visited
    assert not missed.any(), f"{name}: allowed tiles not visited at {missed.nonzero()[:5].tolist()}"
    assert not (unmasked & ~every).any(), f"{name}: a tile that is not full ran without mask code"
    wasted = visited & ~some
    assert not wasted.any(), f"{name}: empty tiles visited at {wasted.nonzero()[:5].tolist()}"
    assert not (every & some & ~unmasked).any(), f"{name}: a full tile ran mask code"


def _check_visits(attn, q, k, v, inputs) -> None:
    """Each kernel's visit counts against the reference mask, tile by tile, at the kernel's own tiles
    (dK/dV's are transposed: key tiles along rows)."""
    counts = attn.visit_counts(q, k, v, **inputs)
    for kernel, (some, every) in visits.truths(attn, q, k, v, inputs).items():
        _check_counts(kernel, counts[kernel], some.cpu(), every.cpu())


# Catalog masks whose visits the interpreter checks in the slow tier only: closed-form bands and prefixes
# (sliding_window, chunked_causal and the sink and sigmoid specs keep that form in the default run) and a
# block layout (the published and extra masks keep tables of their own there).
VISITS_SLOW = {"full", "causal", "causal_bottom_right", "prefix_lm", "alibi_causal", "gemma2_local", "block_sparse"}


def _cases():
    for path in SPECS:
        yield pytest.param(path, None, id=path.stem, marks=SLOW_IN_INTERPRETER if path.stem in VISITS_SLOW else ())
    for name, body in EXTRA_MASKS.items():
        yield pytest.param(None, f"attention {name}\n{body}\n", id=name)
    for name in PUBLISHED:
        yield pytest.param(ROOT / "benchmarks" / "published" / f"{name}.attn", None, id=name)


def _build(path, text):
    if path is None:
        return attngen.build(text)
    if path.stem in PUBLISHED:
        return attngen.build(path, params=PUBLISHED[path.stem])
    declared = {p.name for p in attngen.load_spec(path)[0].params}
    return attngen.build(path, params={k: v for k, v in SMALL_PARAMS.items() if k in declared})


@pytest.mark.parametrize("path, text", list(_cases()))
def test_kernels_visit_exactly_the_allowed_tiles(path, text):
    attn = _build(path, text)
    B, H, HKV, N, M, D = 2, 2, 1, 75, 75, 16
    q, k, v = testing.random_qkv(B, H, HKV, N, M, D, D, torch.float32, device=DEVICE)
    inputs = testing.random_inputs(attn.spec, B, H, HKV, N, M, device=DEVICE)
    _check_visits(attn, q, k, v, inputs)


def test_poisoned_keys_in_skipped_tiles_cannot_reach_the_output():
    """Causal with KV_LEN > Q_LEN: key tiles past the last query are never visited, so NaN there is harmless."""
    attn = attngen.build(Path(__file__).parent.parent / "specs" / "causal.attn")
    q, k, v = testing.random_qkv(1, 2, 2, 40, 96, 16, 16, torch.float32, device=DEVICE)
    block_n = attn.module._tiles(q, v, 0)[1]
    first_skipped = -(-40 // block_n) * block_n
    clean = attn(q, k, v)
    k[:, :, first_skipped:] = float("nan")
    v[:, :, first_skipped:] = float("nan")
    poisoned = attn(q, k, v)
    assert torch.equal(clean, poisoned)
    v[:, :, first_skipped - 1] = float("nan")  # the control: a visited tile does spread NaN
    assert attn(q, k, v).isnan().any()


def test_tile_table_is_built_on_every_call_and_reused_only_when_passed():
    attn = attngen.build(Path(__file__).parent.parent / "specs" / "document_causal.attn")
    stats = attn.module.TABLE_STATS
    # 80 query rows: more than a decode tile holds, so the portable forward (which follows tables) runs.
    q, k, v = testing.random_qkv(1, 2, 2, 80, 80, 16, 16, torch.float32, device=DEVICE)
    doc = torch.tensor([0] * 20 + [1] * 60, dtype=torch.int32, device=DEVICE)
    built = stats["built"]
    first = attn(q, k, v, doc=doc)
    assert stats["built"] == built + 1
    doc[10:] = 1
    changed = attn(q, k, v, doc=doc)
    assert stats["built"] == built + 2 and not torch.equal(changed, first)
    tables = attn.tile_tables(q, k, v, doc=doc)
    built = stats["built"]
    with_tables = functools.partial(attn, tile_tables=tables)
    assert torch.equal(with_tables(q, k, v, doc=doc), changed)
    testing.check_against_reference(attn.spec, with_tables, q, k, v, {"doc": doc})  # forward and backward
    assert stats["built"] == built  # every kernel followed the passed tables


def test_static_tables_are_built_once_per_sizes_and_kept():
    """A mask that reads no input (a band with global tokens) gets tables that depend only on the tiles and the
    lengths: the first call builds them, later ones reuse them, whatever B and H (the mask reads neither); a
    new length builds its own, and the old length's are still kept."""
    attn = _build(ROOT / "benchmarks" / "published" / "global_band.attn", None)
    assert attn.module.FACTS.static_tables == ("Q_LEN", "KV_LEN") and attn.module.FACTS.table_reads == ()
    stats = attn.module.TABLE_STATS
    q, k, v = testing.random_qkv(1, 2, 2, 80, 80, 16, 16, torch.float32, device=DEVICE)
    keys = [attn.module._table_key(q, v, kernel) for kernel in (0, 1, 2)]  # forward, dK/dV, dQ
    assert keys[1] not in (keys[0], keys[2])  # dK/dV walks key tiles: a table of its own
    built = stats["built"]
    attn(q, k, v)
    assert stats["built"] == built + 1  # the forward's
    testing.check_against_reference(attn.spec, attn, q, k, v, {})  # forward and backward
    assert stats["built"] == built + len(set(keys))  # dQ follows the forward's where their tiles agree
    testing.check_against_reference(attn.spec, attn, q, k, v, {})
    wider = testing.random_qkv(2, 4, 2, 80, 80, 16, 16, torch.float32, device=DEVICE)
    testing.check_against_reference(attn.spec, attn, *wider, {})
    assert stats["built"] == built + len(set(keys))
    longer = testing.random_qkv(1, 2, 2, 96, 80, 16, 16, torch.float32, device=DEVICE)
    testing.check_against_reference(attn.spec, attn, *longer, {})
    assert stats["built"] == built + 2 * len(set(keys))
    _check_visits(attn, q, k, v, {})  # the kept tables of the first length serve its visits exactly
    # `attngen explain` maps a static table's tiles from the mask itself: the tiles the kernels visit.
    counts = attn.visit_counts(q, k, v)["fwd"][0, 0].cpu()
    block_m, block_n = attn.module._tiles(q, v, 0)[:2]
    mapped = tile_map(analyze(attn.spec), {"B": 1, "H": 2, "HKV": 2, "Q_LEN": 80, "KV_LEN": 80, "D": 16},
                      block_m, block_n)
    assert mapped.exact and torch.equal(mapped.grid, torch.where(counts == 16, FULL, (counts == 1).to(torch.uint8)))
    tables = attn.tile_tables(q, k, v)  # and tile_tables() hands out the kept ones
    assert stats["built"] == built + 2 * len(set(keys))
    assert torch.equal(attn(q, k, v, tile_tables=tables), attn(q, k, v))


def test_static_tables_per_batch_where_the_mask_reads_it():
    """A mask reading b and B (no input) keeps one table per batch row, keyed by B too."""
    attn = attngen.build("attention per_batch\nmask: (q + b) % 3 == 0 or k < B\n")
    assert attn.module.FACTS.static_tables == ("B", "Q_LEN", "KV_LEN")
    stats = attn.module.TABLE_STATS
    for batch in (1, 2, 1):
        q, k, v = testing.random_qkv(batch, 1, 1, 40, 40, 16, 16, torch.float32, device=DEVICE)
        testing.check_against_reference(attn.spec, attn, q, k, v, {})
        _check_visits(attn, q, k, v, {})
    tilings = len({attn.module._table_key(q, v, kernel) for kernel in (0, 1, 2)})
    assert stats["built"] == 2 * tilings  # each tiling's table for B = 1 and for B = 2


def _listed(table, n_rows: int, n_cols: int):
    """A built table's (partial, full) tiles per row, as (rows, cols) booleans: each row lists its partial
    tiles from the left of its indices and its full ones from the right."""
    counts, indices = table[0].cpu().view(n_rows, 2), table[1].cpu().view(n_rows, n_cols)
    partial, full = torch.zeros(n_rows, n_cols, dtype=torch.bool), torch.zeros(n_rows, n_cols, dtype=torch.bool)
    for r in range(n_rows):
        n_partial, n_full = counts[r].tolist()
        partial[r, indices[r, :n_partial].long()] = True
        full[r, indices[r, n_cols - n_full:].long()] = True
    return partial, full


@pytest.mark.slow  # 16 s on 2 cores; test_static_tables_are_built_once_per_sizes_and_kept stays in the default tier
def test_static_tables_are_kept_per_tiling_for_the_hopper_family_too():
    """On a Hopper target the Hopper family's forward and backward follow tables of their own tiles
    (128x128, and 64 query x 128 key tiles walked by key tile): kept beside the portable kernels' under their
    own keys, each listing exactly the partial and full tiles of its tiling."""
    attn = attngen.build(ROOT / "benchmarks" / "published" / "global_band.attn", params={"w": 40, "g": 30},
                         target="h200")
    module = attn.module
    q = torch.zeros(1, 2, 300, 128, dtype=torch.bfloat16, device=DEVICE)
    kernels = module._table_kernels(True)
    assert {"hopper", "hopper_bwd"} <= set(kernels)
    keys = {kernel: module._table_key(q, q, kernel) for kernel in kernels}
    assert keys["hopper"] == (True, 128, 128) and keys["hopper_bwd"] == (False, 64, 128) != keys[1]
    sizes = (1, 2, 2, 300, 300)
    built = module.TABLE_STATS["built"]
    tables = dict(zip(kernels, module._resolve(kernels, q, q, {}, module._builder(sizes, q.device, []))))
    assert module.TABLE_STATS["built"] == built + len(set(keys.values()))
    again = module._resolve(kernels, q, q, {}, module._builder(sizes, q.device, []))
    assert module.TABLE_STATS["built"] == built + len(set(keys.values()))
    assert all(a is b for a, b in zip(again, tables.values()))
    env = make_env(attn.spec, B=1, H=1, HKV=1, Q_LEN=300, KV_LEN=300, D=128)
    allowed = evaluate_expr(attn.spec.mask, env).expand(1, 1, 300, 300)
    for name in ("hopper", "hopper_bwd"):
        by_query, block_m, block_n = keys[name]
        grid, rows, cols = (allowed, block_m, block_n) if by_query else (allowed.transpose(-1, -2), block_n, block_m)
        some, every = visits.tile_truth(grid, rows, cols, 300, 300)
        partial, full = _listed(tables[name], some.shape[2], some.shape[3])
        assert torch.equal(full, every[0, 0] & some[0, 0]) and torch.equal(partial, some[0, 0] & ~every[0, 0]), name


# Besides the pinned cases, 8 drawn in the default tier (ci profile) and 12 others in the slow one.
@settings(max_examples=max(8, settings.default.max_examples // 25))
@given(text=strategies.spec_texts(with_mask=True), case=strategies.cases(dtypes=("f32",)))
# Found on the GPU: a bound read from an i64 input made the loop counters int64 (a compile error).
@example(text="attention fuzzed\ninput lens: i64[B]\nmask: k < lens[b]\n",
         case=strategies.Case(B=1, H=1, HKV=1, Q_LEN=1, KV_LEN=1, D=1, DV=1, dtype="f32", seed=0))
@example(text="attention fuzzed\nparam c = 3\nmask: not ((q + 1) // c >= k // c)\n",
         case=strategies.Case(B=1, H=1, HKV=1, Q_LEN=32, KV_LEN=31, D=1, DV=1, dtype="f32", seed=0))
def test_drawn_specs_visit_exactly_the_allowed_tiles(text, case):
    """The same exactness for random masks: closed-form spans where the analysis proves them exact (this
    checks the generated loop-bound code itself, which the analysis' tests, evaluated in Python, cannot
    see), tile tables everywhere else."""
    _check_drawn_visits(text, case)


@pytest.mark.slow
@settings(max_examples=max(12, settings.default.max_examples * 3 // 50))
@given(text=strategies.spec_texts(with_mask=True), case=strategies.cases(dtypes=("f32",)))
def test_drawn_specs_visit_exactly_the_allowed_tiles_in_more_drawn_cases(text, case):
    _check_drawn_visits(text, case)


def _check_drawn_visits(text, case):
    spec = parse_spec(text)
    attn = attngen.build(spec)
    q, k, v, inputs = strategies.case_data(spec, case, device=DEVICE)
    _check_visits(attn, q, k, v, inputs)


# The default run checks each launch shape once, on one mask each; the slow tier the other two pairs.
@pytest.mark.parametrize("name, one_launch", tiered(
    [("sliding_window", True), ("sliding_window", False), ("document_causal", True), ("document_causal", False)],
    fast=[("sliding_window", True), ("document_causal", False)],
    ids=lambda case: f"{case[0]}-{'one_launch' if case[1] else 'two_launches'}"))
def test_backward_launches_with_unequal_tiles_match_the_reference(name, one_launch, monkeypatch):
    """The backward kernel runs dK/dV and dQ programs in one launch (a program's place in the grid
    says which) or as two launches; with dK/dV and dQ tiles of different shapes and GQA, both give
    the reference's gradients and visit the allowed tiles exactly."""
    path = Path(__file__).parent.parent / "specs" / f"{name}.attn"
    attn = _build(path, None)
    module = attn.module
    fwd, _, _ = next(iter(module.FACTS.plan.values()))
    monkeypatch.setattr(module.ATTENTION, "facts", dataclasses.replace(
        module.FACTS, one_launch_backward=one_launch,
        plan={key: (fwd, (16, 32, 4, 1), (32, 16, 4, 1)) for key in module.FACTS.plan}))
    B, H, HKV, N, M, D = 2, 4, 2, 70, 70, 16
    q, k, v = testing.random_qkv(B, H, HKV, N, M, D, D, torch.float32, device=DEVICE)
    inputs = testing.random_inputs(attn.spec, B, H, HKV, N, M, device=DEVICE)
    testing.check_against_reference(attn.spec, attn, q, k, v, inputs)
    assert module._tiles(q, v, 1)[:2] == (16, 32) and module._tiles(q, v, 2)[:2] == (32, 16)
    _check_visits(attn, q, k, v, inputs)
