"""Constant folding (attngen.analysis.fold): a folded expression has the reference's value of the original, its type
and int-ness, and no wider int range; the loop bounds the kernels compute read plainly and stay exact."""

from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import attngen
from attngen import ir
from attngen import intervals
from attngen.analysis import spans
from attngen.analysis.bounds import bound_value, uniform_env
from attngen.emit.expressions import TritonEmitter
from attngen.analysis.fold import fold
from attngen.emit.hooks import BOUNDS, ROW_MAJOR
from attngen.frontend import parse_spec
from attngen.frontend.printer import expr_to_source
from attngen.reference import evaluate_expr, make_env
from attngen.testing import strategies

SPECS = Path(__file__).parent.parent / "specs"
SIZES = {"B": 2, "H": 2, "HKV": 1, "Q_LEN": 5, "KV_LEN": 7, "D": 4}

# --- random IR: every operator and function over constants that fold, and ones that must not ------

PARAMS = (ir.ParamDecl(name="n", type="int", value=3), ir.ParamDecl(name="m", type="int", value=-2),
          ir.ParamDecl(name="t", type="float", value=0.5), ir.ParamDecl(name="u", type="float", value=0.1))
SPEC = ir.Spec(name="folded", params=PARAMS)
PARAM_VALUES = {p.name: p.value for p in PARAMS}
# Near and past the ends of int32 and int64 (and of the ints float32 holds), and floats that are float32
# numbers or not (0.1, 1e30): float32 and float64 arithmetic on them round apart (0.1 + 0.2 - 0.3).
INTS = [0, 1, -1, 2, 3, -7, 2 ** 24 + 1, 2 ** 31, -2 ** 31 - 1, 2 ** 62, 2 ** 63 - 1, -2 ** 63]
FLOATS = [0.0, -0.0, 1.0, 0.5, -1.5, 0.1, 0.2, 0.3, 3.0, 2.0 ** 24, 1e30, 2.0 ** 100, 2.0 ** -149, math.inf,
          -math.inf]


def const(value) -> ir.Const:
    type_ = "bool" if isinstance(value, bool) else "int" if isinstance(value, int) else "float"
    return ir.Const(type=type_, value=value)


def binary(op: str, type_: str, left: ir.Expr, right: ir.Expr) -> ir.Binary:
    return ir.Binary(type=type_, op=op, left=left, right=right)


def neg(x: ir.Expr) -> ir.Unary:
    return ir.Unary(type=x.type, op="neg", operand=x)


def call(fn: str, type_: str, *args: ir.Expr) -> ir.Call:
    return ir.Call(type=type_, fn=fn, args=args)


def _promote(*types: str) -> str:
    return "float" if "float" in types else "int"


LEAVES = {
    "int": st.sampled_from(INTS).map(const) | st.sampled_from(
        [ir.Param(type="int", name="n"), ir.Param(type="int", name="m"), ir.Var(name="q"), ir.Var(name="k"),
         ir.Var(name="h"), ir.Size(name="KV_LEN")]),
    "float": st.sampled_from(FLOATS).map(const) | st.sampled_from(
        [ir.Param(type="float", name="t"), ir.Param(type="float", name="u"), ir.Score()]),
    "bool": st.sampled_from([const(True), const(False)]),
}


@st.composite
def exprs(draw, type_: str, depth: int = 4) -> ir.Expr:
    """A well-typed expression of `type_`, as lowering types it."""
    if depth == 0 or draw(st.integers(0, 4)) == 0:
        if type_ == "bool":  # a comparison, so that bools are not only literals
            return draw(LEAVES["bool"] | exprs("bool", 1)) if depth else draw(LEAVES["bool"])
        return draw(LEAVES[type_])

    def sub(t: str) -> ir.Expr:
        return draw(exprs(t, depth - 1))

    number = st.sampled_from(["int", "float"])
    if type_ == "int":
        form = draw(st.sampled_from(["neg", "arith", "arith", "arith", "pow", "minmax", "clamp", "abs",
                                     "round", "where", "bits", "shift", "invert", "sign"]))
        if form == "neg":
            return neg(sub("int"))
        if form == "bits":
            return binary(draw(st.sampled_from(["bitand", "bitor", "bitxor"])), "int", sub("int"), sub("int"))
        if form == "shift":  # counts in 0 .. 63, as the number checks require
            count = const(draw(st.integers(0, 63))) if draw(st.booleans()) else \
                call("clamp", "int", sub("int"), const(0), const(63))
            return binary(draw(st.sampled_from(["lshift", "rshift"])), "int", sub("int"), count)
        if form == "invert":
            return ir.Unary(type="int", op="invert", operand=sub("int"))
        if form == "sign":
            return call("sign", "int", sub("int"))
        if form == "arith":
            op = draw(st.sampled_from(["add", "sub", "mul", "floordiv", "mod"]))
            return binary(op, "int", sub("int"), sub("int"))
        if form == "pow":
            return binary("pow", "int", sub("int"), const(draw(st.integers(0, 3))))
        if form == "minmax":
            return call(draw(st.sampled_from(["min", "max"])), "int", sub("int"), sub("int"))
        if form == "clamp":
            return call("clamp", "int", sub("int"), sub("int"), sub("int"))
        if form == "abs":
            return call("abs", "int", sub("int"))
        if form == "round":
            return call(draw(st.sampled_from(["floor", "ceil", "round"])), "int", sub(draw(number)))
        return call("where", "int", sub("bool"), sub("int"), sub("int"))
    if type_ == "float":
        form = draw(st.sampled_from(["neg", "arith", "arith", "arith", "div", "pow", "int_pow", "fn", "where"]))
        if form == "neg":
            return neg(sub("float"))
        if form == "arith":
            op = draw(st.sampled_from(["add", "sub", "mul", "floordiv", "mod"]))
            left, right = (sub("float"), sub(draw(number))) if draw(st.booleans()) else \
                (sub(draw(number)), sub("float"))
            return binary(op, "float", left, right)
        if form == "div":
            return binary("div", "float", sub(draw(number)), sub(draw(number)))
        if form == "pow":
            return binary("pow", "float", sub("float"), sub(draw(number)))
        if form == "int_pow":  # the IR types it float, the reference and the kernels compute it as an int
            return binary("pow", "float", sub("int"), draw(st.sampled_from(
                [ir.Param(type="int", name="n"), binary("add", "int", const(1), const(1))])))
        if form == "fn":
            fn = draw(st.sampled_from(["exp", "tanh", "sqrt", "abs", "min", "max"]))
            if fn in ("min", "max"):
                left, right = sub("float"), sub(draw(number))
                return call(fn, "float", left, right)
            return call(fn, "float", sub("float"))
        left, right = sub(draw(number)), sub("float")
        return call("where", "float", sub("bool"), *((left, right) if draw(st.booleans()) else (right, left)))
    form = draw(st.sampled_from(["not", "logic", "compare", "compare", "where"]))
    if form == "not":
        return ir.Unary(type="bool", op="not", operand=sub("bool"))
    if form == "logic":
        return binary(draw(st.sampled_from(["and", "or"])), "bool", sub("bool"), sub("bool"))
    if form == "where":
        return call("where", "bool", sub("bool"), sub("bool"), sub("bool"))
    op = draw(st.sampled_from(["eq", "ne", "lt", "le", "gt", "ge"]))
    return binary(op, "bool", sub(draw(number)), sub(draw(number)))


def _env(float_dtype: torch.dtype):
    env = make_env(SPEC, **SIZES, float_dtype=float_dtype)
    g = torch.Generator().manual_seed(0)
    score = torch.randn(SIZES["B"], SIZES["H"], SIZES["Q_LEN"], SIZES["KV_LEN"], generator=g, dtype=float_dtype)
    score.view(-1)[:4] = torch.tensor([math.inf, -math.inf, math.nan, -0.0], dtype=float_dtype)
    return replace(env, values={**env.values, "score": score})


def _same_value(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype:
        return False
    a, b = torch.broadcast_tensors(a, b)
    if a.is_floating_point():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


@given(e=st.sampled_from(["int", "float", "bool"]).flatmap(exprs),
       float_dtype=st.sampled_from([torch.float32, torch.float64]))
def test_folding_keeps_the_reference_value_type_and_width(e, float_dtype):
    env = _env(float_dtype)
    try:
        expected = evaluate_expr(e, env)
    except RuntimeError:  # an int divided by zero: the original has no value
        assume(False)
    folded = fold(e, PARAM_VALUES)
    assert _same_value(evaluate_expr(folded, env), expected), \
        f"{expr_to_source(e)}  folded to  {expr_to_source(folded)}"
    assert folded.type == e.type
    ranges = intervals.Ranges(intervals.box(SPEC, intervals.MAX_LENGTH))
    assert ranges.is_int(folded) == ranges.is_int(e)
    if ranges.is_int(e):  # never a wider int than the analysis proved for the original
        before, after = ranges.value(e), ranges.value(folded)
        assert before.lo <= after.lo and after.hi <= before.hi and (before.nan or not after.nan)


@pytest.mark.parametrize("fn", ["floor", "ceil"])
def test_floor_and_ceil_of_an_int_fold_to_that_int(fn):
    # 2**62 + 1 has no float64 value: folding through a float gave 2**62 (a mask of k <= 0, not k <= 1).
    spec = parse_spec(f"attention t\nmask: k <= {fn}(4611686018427387904 + 1) - 4611686018427387904\n")
    assert expr_to_source(fold(spec.mask, {})) == "k <= 1"


@given(text=strategies.spec_texts(), case=strategies.cases(max_len=24))
def test_folding_drawn_specs_keeps_the_reference_value(text, case):
    spec = parse_spec(text)
    _, _, _, inputs = strategies.case_data(spec, case)
    sizes = {name: getattr(case, name) for name in ("B", "H", "HKV", "Q_LEN", "KV_LEN", "D")}
    score = torch.randn(case.B, case.H, case.Q_LEN, case.KV_LEN, generator=torch.Generator().manual_seed(1))
    env = make_env(spec, **sizes, inputs=inputs)
    env = replace(env, values={**env.values, "score": score})
    params = {p.name: p.value for p in spec.params}
    for e in (spec.mask, spec.score, spec.scale):
        if e is not None:
            assert _same_value(evaluate_expr(fold(e, params), env), evaluate_expr(e, env))


# --- specific foldings ----------------------------------------------------------------------------

def _folded(text: str) -> str:
    """The folded mask or score of a spec body, printed."""
    spec = parse_spec(f"attention t\nparam w = 1024\nparam c = 3\nparam t = 0.5\n{text}\n")
    expr = spec.mask if spec.mask is not None else spec.score
    return expr_to_source(fold(expr, {p.name: p.value for p in spec.params}))


@pytest.mark.parametrize("text, folded", [
    # ints: constants computed exactly, identities, constants of a sum gathered and subtracted
    ("mask: k >= q - w + 1", "k >= q - 1023"),
    ("mask: k > -1 * q + k", "k > k - q"),
    ("mask: k > q * 1 + 0 - 0", "k > q"),
    ("mask: k > q * -1", "k > -q"),
    ("mask: k > -(-q)", "k > q"),
    ("mask: k > 5 + q", "k > q + 5"),
    ("mask: k > (q + 2) - 3", "k > q - 1"),
    ("mask: k > q + -c", "k > q - 3"),
    ("mask: k > q - -c", "k > q + 3"),
    ("mask: k > 0 - q", "k > -q"),
    ("mask: k > q + (-k)", "k > q - k"),
    ("mask: k > 7 // -2 + 7 % -2 + 2 ** 10 + min(c, 2) + abs(-c)", "k > 1024"),
    ("mask: k >= q // c * c", "k >= q // 3 * 3"),
    # floats: constants are float32 numbers, computed in float32 (as the kernels and the reference do)
    ("score: score * t * 1.0", "score * 0.5"),
    ("score: score + 0.25 * 3", "score + 0.75"),
    ("score: score + 0.1 * 3", "score + 0.30000001192092896"),
    ("score: score + 0.0", "score + 0.0"),
    ("score: score + 1 / 4", "score + 0.25"),
    ("score: score + 1 / 3", "score + 0.3333333432674408"),
    ("score: score + 1e-30 * 1e-30 * 1e30 * k", "score + 0.0 * k"),  # 1e-30 in float64
    ("score: score + (1.0 + 1e-8 - 1.0) * 1e8", "score + 0.0"),  # 1.0000000000000002 in float64
    ("score: score + floor(0.99999999)", "score + 1"),  # 0.99999999 is 1.0 in float32
    ("mask: q < 16777217 * 1.0 - 16777216.0", "q < 0.0"),  # 2**24 + 1 rounds to 2**24
    ("score: score + q * 1.0", "score + q * 1.0"),  # an int times 1.0 is a float: it stays
    ("score: score + floor(2.5) + ceil(-0.5)", "score + 2 + 0"),
    ("score: score + exp(0.0)", "score + exp(0.0)"),
    # int ** int with a param exponent: the IR types it float, the reference computes an int
    ("score: score + q ** c + 2 ** c", "score + q ** 3 + 2 ** 3"),
    # bools
    ("mask: not (w > 3) or causal", "q >= k"),
    ("mask: causal and true", "q >= k"),
    ("mask: causal and 1 > 2", "false"),
    ("mask: q > 1 or 2.5 < 3", "true"),
    ("mask: where(w > 0, causal, k > 0)", "q >= k"),
])
def test_specific_foldings(text, folded):
    assert _folded(text) == folded


@pytest.mark.parametrize("e", [
    binary("add", "int", const(2 ** 63 - 1), const(1)),  # leaves int64
    binary("mul", "int", const(2 ** 62), const(2)),
    binary("sub", "int", const(-2 ** 63), const(1)),
    neg(const(-2 ** 63)),
    binary("floordiv", "int", const(7), const(0)),  # would raise
    binary("mod", "int", const(7), const(0)),
    binary("pow", "int", const(3), const(40)),
    call("abs", "int", const(-2 ** 63)),
    binary("sub", "float", const(math.inf), const(math.inf)),  # NaN has no literal
    binary("mul", "float", binary("mul", "float", const(1e-46), const(1e46)), ir.Var(name="k")),  # 0 * inf
    binary("div", "float", const(1.0), const(0.0)),
    call("floor", "int", const(2.0 ** 70)),
])
def test_what_would_raise_overflow_or_round_stays(e):
    assert fold(e, {}) == e


@pytest.mark.parametrize("e, value", [
    (binary("add", "float", const(2.0 ** 127), const(2.0 ** 127)), math.inf),  # finite in float64
    (binary("mul", "float", const(1e-30), const(1e-30)), 0.0),  # 1e-60 in float64
    (binary("add", "float", const(2 ** 24 + 1), const(0.5)), 16777216.0),  # 2**24 + 1 rounds to 2**24
    (binary("lt", "bool", const(2 ** 24 + 1), const(16777216.0)), False),  # equal in float32
    (binary("eq", "bool", const(2 ** 60 + 2 ** 36 + 1), const(float(2 ** 60 + 2 ** 37))), True),  # rounded once
])
def test_float_constants_fold_in_float32(e, value):
    folded = fold(e, {})
    assert isinstance(folded, ir.Const) and folded.value == value
    expected = evaluate_expr(e, _env(torch.float64))  # the reference computes constants in float32 too
    assert _same_value(evaluate_expr(folded, _env(torch.float64)), expected)


def test_unfolded_subtrees_are_the_same_objects():
    spec = parse_spec("attention t\nparam w = 4\nmask: q - k < w and k // 3 >= q % 5\n")
    folded = fold(spec.mask, {"w": 4})
    assert folded.right is spec.mask.right and folded.left.left is spec.mask.left.left
    assert fold(spec.mask.right, {}) is spec.mask.right


def test_a_folded_constant_gets_the_width_of_its_value():
    spec = parse_spec("attention t\nparam big = 3000000000\nmask: k < q + big - 2000000000 or k < q + big // 1\n")
    ranges = intervals.Ranges(intervals.box(spec, 1 << 20))
    em = TritonEmitter(ROW_MAJOR, {"big": 3000000000}, {}, "mk", ranges)
    em.emit(spec.mask)
    # q + 3000000000 passed int32 on the way to q + 1000000000, which does not: int32 now, exactly.
    # The literal past int32 is int64, and so is the sum it enters.
    assert em.lines == ["mk0 = offs_m[:, None] + 1000000000",
                        "mk1 = offs_n[None, :] < mk0",
                        "mk2 = offs_m[:, None] + tl.cast(3000000000, tl.int64)",
                        "mk3 = offs_n[None, :] < mk2",
                        "mk4 = mk1 | mk3"]
    assert ranges.wide(spec.mask.left.right.left) and "mk2" in em.wide and "mk0" not in em.wide


# --- loop bounds ----------------------------------------------------------------------------------

def _bound_lines(source: str) -> list[str]:
    return [line.strip() for line in source.splitlines() if re.match(r"\s*bd\d+ = ", line)]


@pytest.mark.parametrize("path", sorted(SPECS.glob("*.attn")), ids=lambda p: p.stem)
def test_bound_statements_are_folded(path):
    lines = _bound_lines(attngen.compile_source(path, target="h200"))
    for line in lines:
        assert "-1 * " not in line and "+ -" not in line and "* (bd" not in line, line
        assert not re.fullmatch(r"bd\d+ = (bd\d+|-?\d+)", line), f"a statement that only copies: {line}"


def test_sliding_window_bounds():
    lines = _bound_lines(attngen.compile_source(SPECS / "sliding_window.attn", target="h200"))
    # keys of a query tile: q - 1023 .. q; queries of a key tile: k .. k + 1023
    assert lines[:4] == ["bd0 = tl.cast(q_first, tl.int64)", "bd1 = bd0 - 1023",
                         "bd2 = tl.cast(q_last, tl.int64)", "bd3 = bd2 - 1023"]
    assert "bd2 = bd1 + 1023" in lines and "bd3 = bd0 + 1023" in lines


def test_prefix_lm_bounds():
    lines = _bound_lines(attngen.compile_source(SPECS / "prefix_lm.attn", target="h200"))
    assert lines[1] == "bd1 = tl.cast(bd0, tl.int64) - 1"  # prefix[b] - 1, in int64: it may pass int32
    assert "bd3 = bd2 - bd0" in lines and "bd7 = bd2 - bd6" in lines


class _ScalarTl:
    """tl for the bound statements, on Python ints (exact, so only the spelling is tested)."""
    int64 = "int64"

    @staticmethod
    def cast(x, dtype):
        return x

    minimum, maximum = staticmethod(min), staticmethod(max)

    @staticmethod
    def where(cond, a, b):
        return a if cond else b


UNIFORM = [None, const(0), const(5), const(-5), const(2 ** 40), const(-2 ** 40), ir.Param(type="int", name="n"),
           ir.Size(name="KV_LEN"), neg(ir.Size(name="Q_LEN")), binary("sub", "int", ir.Var(name="b"), const(1)),
           binary("add", "int", neg(ir.Size(name="KV_LEN")), const(-1)),
           binary("add", "int", binary("mul", "int", const(-1), ir.Size(name="Q_LEN")), ir.Size(name="KV_LEN"))]


@st.composite
def linear_bounds(draw) -> spans.Linear:
    uniform = st.sampled_from(UNIFORM)
    return spans.Linear(coef=draw(st.integers(-3, 3)), var=draw(st.sampled_from(["q0", "q1", "k0", "k1"])),
                        const=draw(uniform), den=draw(st.sampled_from([1, 2, 3])),
                        round=draw(st.sampled_from(["floor", "ceil"])), var_div=draw(st.sampled_from([1, 2, 4])),
                        var_offset=draw(uniform), out_scale=draw(st.sampled_from([1, 2, 4])),
                        out_offset=draw(uniform))


@given(bounds=st.lists(linear_bounds(), min_size=1, max_size=3), tile=st.tuples(*[st.integers(0, 40)] * 4),
       b=st.integers(0, 1))
def test_emitted_bounds_compute_what_the_analysis_means(bounds, tile, b):
    """Every Linear form, folded and spelled as the kernels compute it, against `bounds.bound_value`;
    several bounds share one emitter, as a kernel's bounds do."""
    spec = ir.Spec(name="bounds", params=(ir.ParamDecl(name="n", type="int", value=-7),))
    sizes = {"B": 2, "H": 2, "HKV": 1, "Q_LEN": 33, "KV_LEN": 41, "D": 16}
    em = TritonEmitter(BOUNDS, {"n": -7}, {}, "bd", intervals.Ranges(intervals.box(spec, intervals.MAX_LENGTH)))
    tile_vars = {"q0": "q_first", "q1": "q_last", "k0": "k_first", "k1": "k_last"}
    names = [em.bound(bound, tile_vars) for bound in bounds]
    scope = {"tl": _ScalarTl, "_floordiv": lambda a, d: a // d, "_ceildiv": lambda a, d: -(-a // d),
             **dict(zip(tile_vars.values(), tile)), "KV_LEN": sizes["KV_LEN"], "Q_LEN": sizes["Q_LEN"], "off_b": b}
    exec("\n".join(em.lines), scope)
    env = uniform_env(spec, sizes, b, 0)
    for bound, name in zip(bounds, names):
        assert scope[name] == bound_value(bound, dict(zip(tile_vars, tile)), env), (bound, em.lines)
        assert name in em.wide  # bounds are int64
    for line in em.lines:
        assert "-1 * " not in line and "+ -" not in line, line
