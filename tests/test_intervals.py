"""Soundness of the interval classifier (attngen.intervals): a tile called full or empty really is.

Masks are drawn at random from the language (affine and non-affine terms, data-dependent loads,
every function and operator), tiles at random over small grids, inputs at random; each claim is
checked element by element against the reference mask.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from attngen.api import parse_spec, with_params
from attngen.intervals import TileBox, TileClass, classify
from attngen.reference import evaluate_expr, make_env

B, H = 2, 2
HEADER = """\
attention interval_check
param w = 3
param c = 4
param t = 0.5
input doc: i32[*]
input prefix: i32[B]
input flag: bool[B]
input bias: f32[H]
input layout: bool[H, *, *]
"""
INT_LEAVES = ["q", "k", "b", "h", "hkv", "w", "c", "3", "0", "-2", "Q_LEN", "KV_LEN",
              "doc[q]", "doc[k]", "prefix[b]"]
FLOAT_LEAVES = ["t", "0.25", "-1.5", "bias[h]", "inf"]
BOOL_LEAVES = ["causal", "causal_bottom_right", "flag[b]", "layout[h, q // c, k // c]", "true", "false"]


def exprs(kind: str, depth: int) -> st.SearchStrategy[str]:
    """Source text of a random well-typed expression of `kind` ('int', 'float' or 'bool')."""
    leaves = {"int": INT_LEAVES, "float": FLOAT_LEAVES, "bool": BOOL_LEAVES}[kind]
    if depth == 0:
        return st.sampled_from(leaves)
    sub = lambda k: exprs(k, depth - 1)  # noqa: E731
    num = st.sampled_from(["int", "float"])
    if kind == "bool":
        compare = st.tuples(num, st.sampled_from(["==", "!=", "<", "<=", ">", ">="])).flatmap(
            lambda p: st.tuples(sub(p[0]), sub(p[0]))
            .map(lambda ab, op=p[1]: f"({ab[0]}) {op} ({ab[1]})"))
        return st.one_of(
            st.sampled_from(leaves), compare,
            st.tuples(sub("bool"), sub("bool"), st.sampled_from(["and", "or"]))
            .map(lambda x: f"({x[0]}) {x[2]} ({x[1]})"),
            sub("bool").map(lambda x: f"not ({x})"),
            st.tuples(sub("bool"), sub("bool"), st.sampled_from(["&", "|", "^"])).map(lambda x: f"({x[0]}) {x[2]} ({x[1]})"),
            sub("bool").map(lambda x: f"~({x})"),
            st.tuples(sub("bool"), sub("bool"), sub("bool")).map(lambda x: f"where({x[0]}, {x[1]}, {x[2]})"))
    if kind == "int":
        return st.one_of(
            st.sampled_from(leaves),
            st.tuples(sub("int"), sub("int"), st.sampled_from(["+", "-", "*"]))
            .map(lambda x: f"({x[0]}) {x[2]} ({x[1]})"),
            st.tuples(sub("int"), st.sampled_from(["//", "%"]), st.sampled_from(["c", "3", "-2", "w"]))
            .map(lambda x: f"({x[0]}) {x[1]} {x[2]}"),
            sub("int").map(lambda x: f"-({x})"),
            st.tuples(st.sampled_from(["min", "max"]), sub("int"), sub("int")).map(lambda x: f"{x[0]}({x[1]}, {x[2]})"),
            st.tuples(sub("int"), sub("int"), sub("int")).map(lambda x: f"clamp({x[0]}, {x[1]}, {x[2]})"),
            sub("int").map(lambda x: f"abs({x})"),
            sub("float").map(lambda x: f"floor({x})"),
            sub("float").map(lambda x: f"ceil({x})"),
            sub("float").map(lambda x: f"round({x})"),
            st.tuples(sub("int"), sub("int"), st.sampled_from(["&", "|", "^"])).map(lambda x: f"({x[0]}) {x[2]} ({x[1]})"),
            # Counts that keep every int of the drawn masks within int64 (the number checks reject the rest).
            st.tuples(sub("int"), st.sampled_from(["<<", ">>"]), st.sampled_from(["0", "1", "c", "7"]))
            .map(lambda x: f"({x[0]}) {x[1]} {x[2]}"),
            st.tuples(sub("int"), sub("int")).map(lambda x: f"({x[0]}) >> clamp({x[1]}, 0, 63)"),
            st.tuples(sub("int"), sub("int")).map(lambda x: f"({x[0]}) << clamp({x[1]}, 0, 5)"),
            sub("int").map(lambda x: f"~({x})"),
            sub("int").map(lambda x: f"sign({x})"),
            st.tuples(sub("bool"), sub("int"), sub("int")).map(lambda x: f"where({x[0]}, {x[1]}, {x[2]})"),
            sub("int").map(lambda x: f"({x}) ** 2"))
    return st.one_of(
        st.sampled_from(leaves),
        sub("int").map(lambda x: f"({x}) * 1.0"),
        st.tuples(sub("float"), sub("float"), st.sampled_from(["+", "-", "*", "/"]))
        .map(lambda x: f"({x[0]}) {x[2]} ({x[1]})"),
        st.tuples(st.sampled_from(["tanh", "exp", "exp2", "log", "log2", "sqrt", "rsqrt", "abs", "sigmoid",
                                   "sin", "cos", "tan", "atan", "erf", "sign"]),
                  sub("float")).map(lambda x: f"{x[0]}({x[1]})"),
        sub("float").map(lambda x: f"softcap({x}, 2.0)"),
        st.tuples(sub("float"), sub("float")).map(lambda x: f"({x[0]}) ** ({x[1]})"),
        st.tuples(sub("float"), sub("float"), sub("float")).map(lambda x: f"clamp({x[0]}, {x[1]}, {x[2]})"))


@st.composite
def problems(draw):
    mask = draw(exprs("bool", 3))
    q_len, kv_len = draw(st.integers(1, 24)), draw(st.integers(1, 24))
    q0 = draw(st.integers(0, q_len - 1))
    q1 = draw(st.integers(q0, q_len - 1))
    k0 = draw(st.integers(0, kv_len - 1))
    k1 = draw(st.integers(k0, kv_len - 1))
    params = {"w": draw(st.integers(1, 6)), "c": draw(st.integers(1, 6)),
              "t": draw(st.sampled_from([0.5, -2.0, 3.25]))}
    seed = draw(st.integers(0, 2 ** 16))
    return mask, q_len, kv_len, (q0, q1), (k0, k1), params, seed


def random_inputs(q_len: int, kv_len: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"doc": torch.randint(-3, 3, (24,), generator=g, dtype=torch.int32),
            "prefix": torch.randint(-2, kv_len + 2, (B,), generator=g, dtype=torch.int32),
            "flag": torch.randint(0, 2, (B,), generator=g).bool(),
            "bias": torch.randn(H, generator=g),
            "layout": torch.randint(0, 2, (H, 24, 24), generator=g).bool()}


# 60 drawn problems in the default tier and 240 others in the slow one (another test, other draws).
@settings(derandomize=True, max_examples=60, deadline=None)
@given(problem=problems())
def test_classifier_is_sound(problem):
    _check_classification(problem)


@pytest.mark.slow
@settings(derandomize=True, max_examples=240, deadline=None)
@given(problem=problems())
def test_classifier_is_sound_in_more_drawn_problems(problem):
    _check_classification(problem)


def _check_classification(problem):
    """A tile the classifier calls full is allowed everywhere, one it calls empty nowhere (by the reference)."""
    mask, q_len, kv_len, (q0, q1), (k0, k1), params, seed = problem
    spec = with_params(parse_spec(f"{HEADER}mask: {mask}\n"), params)
    box = TileBox(q=(q0, q1), k=(k0, k1), params=params,
                  sizes={"B": B, "H": H, "HKV": H, "Q_LEN": q_len, "KV_LEN": kv_len, "D": 16}, uniform={})
    verdict = classify(spec.mask, box)
    event(verdict.value)
    if verdict is TileClass.PARTIAL:
        return
    env = make_env(spec, B=B, H=H, HKV=H, Q_LEN=q_len, KV_LEN=kv_len, D=16,
                   inputs=random_inputs(q_len, kv_len, seed))
    with torch.no_grad():
        allowed = evaluate_expr(spec.mask, env).expand(B, H, q_len, kv_len)[:, :, q0:q1 + 1, k0:k1 + 1]
    if verdict is TileClass.FULL:
        assert bool(allowed.all()), f"called full, but {mask!r} is false at {(~allowed).nonzero()[0].tolist()}"
    else:
        assert not bool(allowed.any()), f"called empty, but {mask!r} is true at {allowed.nonzero()[0].tolist()}"


def _classify(mask: str, q, k, q_len=64, kv_len=64, **params):
    spec = with_params(parse_spec(f"{HEADER}mask: {mask}\n"), params)
    sizes = {"B": 1, "H": 1, "HKV": 1, "Q_LEN": q_len, "KV_LEN": kv_len, "D": 16}
    return classify(spec.mask, TileBox(q, k, {p.name: p.value for p in spec.params}, sizes, {})).value


def test_classifier_is_tight_on_the_catalog_masks():
    assert _classify("causal", (16, 31), (0, 15)) == "full"
    assert _classify("causal", (16, 31), (16, 31)) == "partial"
    assert _classify("causal", (16, 31), (32, 47)) == "empty"
    assert _classify("causal and q - k < w", (32, 47), (0, 15), w=8) == "empty"
    assert _classify("causal and q - k < w", (32, 47), (32, 47), w=8) == "partial"
    assert _classify("q // c == k // c and causal", (8, 15), (0, 7), c=16) == "full"
    assert _classify("q // c == k // c and causal", (16, 23), (0, 7), c=16) == "empty"
    assert _classify("causal_bottom_right", (0, 15), (32, 47), q_len=16) == "full"
    assert _classify("doc[q] == doc[k]", (0, 15), (0, 15)) == "partial"  # decided at call time
    assert _classify("k < prefix[b] or causal", (16, 31), (0, 15)) == "full"
    assert _classify("layout[h, q // c, k // c] and q >= k", (0, 7), (8, 15), c=8) == "empty"


@settings(derandomize=True, max_examples=400, deadline=None)
@given(a=st.tuples(st.integers(-70, 70), st.integers(0, 40)), b=st.tuples(st.integers(-70, 70), st.integers(0, 40)),
       op=st.sampled_from(["bitand", "bitor", "bitxor", "lshift", "rshift"]))
def test_bitwise_bounds_hold_every_value(a, b, op):
    """Each bit operation's bounds hold every value Python computes over its operands' ranges, by brute force."""
    from attngen import ir
    from attngen.intervals import Num, node_value

    (alo, awidth), (blo, bwidth) = a, b
    if op in ("lshift", "rshift"):  # counts in 0 .. 63
        blo, bwidth = abs(blo) % 56, bwidth % 8
    a_range, b_range = range(alo, alo + awidth + 1), range(blo, blo + bwidth + 1)
    node = ir.Binary(type="int", op=op, left=ir.Var(name="q"), right=ir.Var(name="k"))
    bound = node_value(node, [Num(a_range[0], a_range[-1]), Num(b_range[0], b_range[-1])], None)
    python = {"bitand": int.__and__, "bitor": int.__or__, "bitxor": int.__xor__, "lshift": int.__lshift__,
              "rshift": int.__rshift__}[op]
    values = [python(x, y) for x in a_range for y in b_range]
    assert bound.lo <= min(values) and max(values) <= bound.hi, (bound, min(values), max(values))
    if op == "bitand" and a_range[0] >= 0:  # `& mask` with a non-negative mask is bounded by the mask
        assert 0 <= bound.lo and bound.hi <= a_range[-1]
