"""The spec with global positions (attngen.frontend.positions), which every rank of a context-parallel call runs:
on a block of queries and keys it means what the original spec means on the whole sequence at those positions
(catalog and drawn specs), its inputs take free names, its ints stay exact, and affine masks keep closed-form
tile bounds whose tiles are those of the whole sequence."""

from pathlib import Path

import pytest
import torch
from hypothesis import assume, given, note, settings
from hypothesis import strategies as st

import attngen
from attngen import intervals, reference
from attngen.analysis import analyze
from attngen.errors import IndexOutOfRange
from attngen.frontend import checks
from attngen.frontend.positions import shifted
from attngen.frontend.printer import to_source
from attngen.report.tilemap import EMPTY, FULL, tile_map
from attngen.testing import random_inputs, random_qkv, strategies

SPECS = Path(__file__).resolve().parent.parent / "specs"
SMALL = {"window": 7, "cap": 2.0, "chunk": 8, "block": 16}


def _spec(name):
    spec = attngen.load_spec(SPECS / f"{name}.attn")[0]
    return attngen.with_params(spec, {p.name: SMALL[p.name] for p in spec.params if p.name in SMALL})


def _positions(s, q_start, k_start, q_len, kv_len):
    return {name: torch.tensor(value, dtype=torch.int32)
            for name, value in zip(s.names, (q_start, k_start, q_len, kv_len))}


def _same_at_global_positions(spec, B, H, HKV, Q_LEN, KV_LEN, D, q_block, k_block, seed):
    """The derived spec's scores (mask included) and sinks on a block of queries and keys equal the original's on
    the whole sequence, cut to that block: the positions are the whole sequence's."""
    s = shifted(spec)
    q, k, v = (x.double() for x in random_qkv(B, H, HKV, Q_LEN, KV_LEN, D, D, torch.float32, seed=seed))
    inputs = random_inputs(spec, B, H, HKV, Q_LEN, KV_LEN, seed=seed)
    inputs = {n: x.double() if x.is_floating_point() else x for n, x in inputs.items()}
    try:
        whole = reference.modified_scores(spec, q, k, v, inputs)
        whole_sink = reference.sink_logits(spec, q, k, v, inputs)
    except IndexOutOfRange:
        return False
    (q0, q1), (k0, k1) = q_block, k_block
    part_inputs = {**inputs, **_positions(s, q0, k0, Q_LEN, KV_LEN)}
    qs, ks, vs = q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1]
    part = reference.modified_scores(s.spec, qs, ks, vs, part_inputs)
    # The mask exactly (-inf where it forbids a key); the scores up to the float64 rounding of q @ k^T, whose
    # blocking differs between the whole and the sliced matrices.
    torch.testing.assert_close(part, whole[:, :, q0:q1, k0:k1], rtol=1e-12, atol=1e-12, equal_nan=True)
    if whole_sink is not None:
        torch.testing.assert_close(reference.sink_logits(s.spec, qs, ks, vs, part_inputs), whole_sink[:, :, q0:q1],
                                   rtol=0, atol=0, equal_nan=True)
    return True


@pytest.mark.parametrize("name", sorted(p.stem for p in SPECS.glob("*.attn")))
def test_every_catalog_spec_means_the_same_at_global_positions(name):
    spec = _spec(name)
    # A block of rows 13..29 of 40 against keys 5..21: neither starts at a tile, both cross the diagonal.
    assert _same_at_global_positions(spec, 2, 4, 2, 40, 40, 8, (13, 29), (5, 21), seed=1)
    assert not checks.problems(shifted(spec).spec)


@settings(max_examples=100)
@given(spec=strategies.specs(max_depth=2), data=st.data())
def test_drawn_specs_mean_the_same_at_global_positions(spec, data):
    note(to_source(spec))
    Q_LEN, KV_LEN = data.draw(st.integers(2, 24)), data.draw(st.integers(2, 24))
    q0 = data.draw(st.integers(0, Q_LEN - 1))
    q1 = data.draw(st.integers(q0 + 1, Q_LEN))
    k0 = data.draw(st.integers(0, KV_LEN - 1))
    k1 = data.draw(st.integers(k0 + 1, KV_LEN))
    seed = data.draw(st.integers(0, 9))
    assume(_same_at_global_positions(spec, 2, 2, 1, Q_LEN, KV_LEN, 4, (q0, q1), (k0, k1), seed=seed))
    # Whatever the frontend accepts runs context-parallel: the derived spec passes the same checks.
    assert not checks.problems(shifted(spec).spec)


def test_the_inputs_of_positions_take_names_the_spec_leaves_free():
    spec = attngen.parse_spec("attention t\ninput q_start_: f32[H]\nparam k_start_ = 3\n"
                              "score: score + q_start_[h] * k_start_\n")
    s = shifted(spec)
    assert s.q_start == "q_start_1" and s.k_start == "k_start_1" and (s.q_len, s.kv_len) == ("q_len_", "kv_len_")
    assert [i.name for i in s.spec.inputs] == ["q_start_", "q_start_1", "k_start_1", "q_len_", "kv_len_"]


def test_inputs_of_the_whole_sequence_are_declared_any_length():
    s = shifted(_spec("document_causal"))
    assert s.spec.input("doc").dims == ("*",)
    assert s.max_length == intervals.MAX_LENGTH and s.max_start == intervals.MAX_LENGTH - 1


def test_a_spec_exact_only_to_some_length_keeps_its_positions_within_it():
    # (q - k) ** 4 fits int64 up to length 55109; positions up to half of that keep the derived spec as exact.
    spec = attngen.parse_spec("attention t\nscore: score + 1e-30 * ((q - k) ** 4)\n")
    s = shifted(spec)
    limit = intervals.length_limit(spec)[0]
    assert s.max_length == limit and s.max_start == limit // 2
    assert intervals.length_limit(s.spec)[0] >= limit - limit // 2
    assert not checks.problems(s.spec)


CLOSED_FORM = ["causal", "sliding_window", "chunked_causal", "gemma2_local", "gpt_oss_sinks", "alibi_causal",
               "causal_bottom_right", "prefix_lm"]


@pytest.mark.parametrize("name", CLOSED_FORM)
def test_affine_masks_keep_closed_form_tile_bounds_at_global_positions(name):
    spec = _spec(name)
    facts = analyze(shifted(spec).spec)
    assert not facts.tile_table, "the derived mask must need no tile table where the original needs none"
    assert all(facts.loop_bounds[loop] is not None for loop in "kq")


@pytest.mark.parametrize("name, q_start, k_start", [("causal", 21, 5), ("sliding_window", 37, 30),
                                                    ("chunked_causal", 13, 3), ("prefix_lm", 40, 12)])
def test_the_closed_form_tiles_of_a_block_are_those_of_the_whole_sequence(name, q_start, k_start):
    """The derived bounds, evaluated with the block's starts, visit exactly the tiles of the block that hold an
    allowed element of the original mask at global positions, and run no mask code only on tiles that are
    allowed everywhere."""
    spec = _spec(name)
    s = shifted(spec)
    facts = analyze(s.spec)
    B, H, n, N = 2, 2, 32, 80
    inputs = {**random_inputs(spec, B, H, H, N, N, seed=3), **_positions(s, q_start, k_start, N, N)}
    sizes = {"B": B, "H": H, "HKV": H, "Q_LEN": n, "KV_LEN": n}
    env = reference.make_env(spec, B=B, H=H, HKV=H, Q_LEN=N, KV_LEN=N, D=8, inputs=inputs)
    allowed = reference.evaluate_expr(spec.mask, env).expand(B, H, N, N)
    block = 8
    for b in range(B):
        m = tile_map(facts, sizes, block, block, by_query=True, b=b, inputs=inputs)
        assert m.exact
        for r in range(n // block):
            for c in range(n // block):
                tile = allowed[b, 0, q_start + r * block:q_start + (r + 1) * block,
                               k_start + c * block:k_start + (c + 1) * block]
                assert (m.grid[r, c] != EMPTY) == bool(tile.any()), (b, r, c)
                if m.grid[r, c] == FULL:
                    assert bool(tile.all()), (b, r, c)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["causal", "sliding_window", "document_causal", "alibi_causal", "learned_rel_bias",
                                  "chunked_causal"])
def test_a_blocks_kernels_match_the_reference_in_bf16_on_the_gpu(name):
    """The kernels of the spec with global positions (the Hopper family's on sm_90) on a block deep in a sequence,
    bf16, against the float64 reference of that spec, which is the original's at those positions."""
    from attngen import testing
    from attngen.frontend.positions import without_sink

    spec = _spec(name)
    s = shifted(spec)
    part = attngen.build(without_sink(s.spec))
    B, H, N, D = 1, 4, 4096, 64
    q, k, v = testing.random_qkv(B, H, H, N, N, D, D, torch.bfloat16, device="cuda", seed=2)
    inputs = {**random_inputs(spec, B, H, H, N, N, device="cuda", seed=2),
              **{n: t.cuda() for n, t in _positions(s, 2048, 1024, N, N).items()}}
    qb, kb, vb = q[:, :, 2048:3072], k[:, :, 1024:3072], v[:, :, 1024:3072]
    if torch.cuda.get_device_capability() == (9, 0):
        assert part.forward_family(qb, kb, vb, **inputs) == "hopper"
        assert part.backward_family(qb, kb, vb, **inputs) == "hopper"
    testing.check_against_reference(part.spec, part, qb, kb, vb, inputs)
