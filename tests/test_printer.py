"""Printer: IR back to .attn text that parses to the same IR, with the fewest parentheses."""

from __future__ import annotations

import math
from functools import cache
from pathlib import Path

import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

from attngen import ir
from attngen.errors import SpecError
from attngen.frontend.lower import lower
from attngen.frontend.parser import parse
from attngen.frontend.printer import expr_to_source, to_source

SPECS = sorted((Path(__file__).parent.parent / "specs").glob("*.attn"))

# Names every expression below may use.
DECLS = """\
attention t
param w = 16
param shift = -3
param c = 0.5
param tiny = -1e-30
input temp: f32[]
input flag: bool[]
input on: bool[H]
input table: f32[H, 257]
input doc: i32[KV_LEN]
input cube: i64[B, *, 7]
"""


def same(a, b) -> None:
    """Equal IR, and equal JSON too, which also tells an int value from a float one."""
    assert a == b
    assert a.model_dump_json() == b.model_dump_json()


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_every_catalog_spec_round_trips(path):
    spec = parse_spec(path.read_text(), str(path))
    same(parse_spec(to_source(spec)), spec)


def test_a_spec_prints_its_declarations_and_items():
    spec = parse_spec(DECLS + "input bias: bf16[H, *] learnable\nscale: c * rsqrt(D)\n"
                      "score: score + bias[h, k]\nmask: causal_bottom_right\n")
    assert to_source(spec) == DECLS + (
        "input bias: bf16[H, *] learnable\n"
        "mask: causal_bottom_right\n"
        "score: score + bias[h, k]\n"
        "scale: c * rsqrt(D)\n")
    same(parse_spec(to_source(spec)), spec)


# Items whose expression prints exactly as written: no parenthesis here can be dropped.
AS_WRITTEN = [
    "score: q - (k - h)",
    "score: q - k - h",
    "score: q - k + h",
    "score: q + (k + h)",
    "score: q * (k + h)",
    "score: q * k + h",
    "score: q / (k * h)",
    "score: q // k % h",
    "score: q % (k // h)",
    "score: 2 ** 3 ** 2",
    "score: (2 ** 3) ** 2",
    "score: -q ** 2",
    "score: (-q) ** 2",
    "score: q ** -k",
    "score: q ** -k ** 2",
    "score: --q",
    "score: -(q + k)",
    "score: -(q * k)",
    "score: -q * k",
    "score: q - -1",
    "score: (q - k) ** 2",
    "score: score * -1.0",
    "score: (score + 1.0) / 2.0 ** c",
    "score: w * shift + c",
    "score: where(score > 0.0, score, -inf)",
    "score: where(not flag, score, temp * score)",
    "score: table[h, clamp(q - k, -128, 128) + 128]",
    "score: cube[b, hkv // 2, q % 7] + doc[doc[k]]",
    "mask: q + (KV_LEN - Q_LEN) >= k",
    "mask: not not q < k",
    "mask: not (q < k and k < h)",
    "mask: not (flag or on[h])",
    "mask: not flag == on[h]",
    "mask: (not flag) == on[h]",
    "mask: (q < k) == (k < h)",
    "mask: (q < k) != true",
    "mask: flag or on[h] and not flag",
    "mask: (flag or on[h]) and flag",
    "mask: flag or (on[h] or flag)",
    "mask: flag and (on[h] and flag)",
    "mask: flag or on[h] or flag",
    "mask: -q < -k",
    "mask: q - k < w and false",
    "mask: where(flag, on[h], q >= k)",
    "mask: causal_bottom_right",
    "mask: not causal_bottom_right or q == k",
    "scale: 1.0 / sqrt(D) * c",
    "scale: 1e-30 * tiny",
    "scale: 1e+300",
    "scale: 0.1 + inf",
    "scale: 1234567890123456789",  # int literals must fit in int64
    "scale: 1.5e-07",
]

# Items the parser normalises: printed as the second text, which parses to the same IR.
REWRITTEN = {
    "score: (q - k) - h": "q - k - h",
    "score: ((q)) * (k)": "q * k",
    "score: -(q ** 2)": "-q ** 2",
    "score: +q": "q",
    "score: 2 ** (3 ** 2)": "2 ** 3 ** 2",
    "score: q ** (-k)": "q ** -k",
    "mask: q < k < h": "q < k and k < h",
    "mask: q == k != h <= b": "q == k and k != h and h <= b",
    "mask: (flag or on[h]) or flag": "flag or on[h] or flag",
    "mask: not (q < k)": "not q < k",
    "mask: causal": "q >= k",
    "scale: 1e300": "1e+300",
    "scale: 1.": "1.0",
    "scale: .5": "0.5",
    "scale: 2.5E3": "2500.0",
    "scale: 1E-30": "1e-30",
    "scale: 007": "7",
}

ARGUMENTS = {1: "score", 2: "score, c", 3: "score, -c, c"}
EVERY_FUNCTION = ["score: where(flag, score, 1)" if fn == "where" else f"score: {fn}({ARGUMENTS[arity]})"
                  for fn, (arity, _) in ir.FUNCTIONS.items()]


def item_expr(spec: ir.Spec) -> tuple[str, ir.Expr]:
    return next((name, e) for name in ("mask", "score", "scale") if (e := getattr(spec, name)) is not None)


PRINTED = [(line, line.split(": ", 1)[1]) for line in AS_WRITTEN + EVERY_FUNCTION] + list(REWRITTEN.items())


@pytest.mark.parametrize("line, printed", PRINTED)
def test_an_expression_prints_with_the_fewest_parentheses(line, printed):
    item, expr = item_expr(parse_spec(DECLS + line))
    assert expr_to_source(expr) == printed
    same(item_expr(parse_spec(f"{DECLS}{item}: {printed}"))[1], expr)


def test_every_function_is_in_the_table():
    assert {line.split(": ")[1].split("(")[0] for line in EVERY_FUNCTION} == set(ir.FUNCTIONS)


# --- IR the parser cannot make prints as near as the language allows -----------------------------

def test_a_negative_constant_prints_as_a_negation():
    assert expr_to_source(ir.Const(type="int", value=-1)) == "-1"
    assert expr_to_source(ir.Const(type="float", value=-math.inf)) == "-inf"
    power = ir.Binary(type="float", op="pow", left=ir.Const(type="float", value=-2.0), right=ir.Var(name="q"))
    assert expr_to_source(power) == "(-2.0) ** q"
    assert expr_to_source(ir.Const(type="float", value=-0.0)) == "0.0"


@pytest.mark.parametrize("spec", [
    ir.Spec(name="t", scale=ir.Const(type="float", value=math.nan)),
    ir.Spec(name="t", params=(ir.ParamDecl(name="p", type="float", value=math.inf),)),
])
def test_a_value_without_a_literal_is_an_error(spec):
    with pytest.raises(ValueError, match="finite"):
        to_source(spec)


# --- random well-typed IR ----------------------------------------------------------------------

def parse_spec(text: str, filename: str = "<spec>") -> ir.Spec:
    """Text to IR without the number checks (attngen.frontend.checks, tested in test_integers.py): printing is
    about syntax and types, and random IR overflows and divides by zero freely."""
    try:
        return lower(parse(text), check_numbers=False)
    except SpecError as e:
        raise e.located(text, filename) from None


SPEC = parse_spec(DECLS)


def promote(*types: str) -> str:
    return "float" if "float" in types else "int"


def arithmetic(op: str, left: ir.Expr, right: ir.Expr) -> ir.Binary:
    """Typed as lowering types it."""
    if op == "div":
        type = "float"
    elif op == "pow":
        exact = left.type == right.type == "int" and isinstance(right, ir.Const) and right.value >= 0
        type = "int" if exact else "float"
    else:
        type = promote(left.type, right.type)
    return ir.Binary(type=type, op=op, left=left, right=right)


def call(fn: str, *args: ir.Expr) -> ir.Call:
    if fn == "where":
        _, a, b = args
        type = "bool" if a.type == "bool" else promote(a.type, b.type)
    else:
        rule = ir.FUNCTIONS[fn][1]
        type = promote(*(a.type for a in args)) if rule == "same" else rule
    return ir.Call(type=type, fn=fn, args=args)


def unary(op: str, operand: ir.Expr) -> ir.Unary:
    return ir.Unary(type=operand.type, op=op, operand=operand)


def binary(op: str, left: ir.Expr, right: ir.Expr) -> ir.Binary:
    return ir.Binary(type="bool", op=op, left=left, right=right)


def loads(value_type: str, index: st.SearchStrategy) -> st.SearchStrategy[ir.Load]:
    return st.one_of([st.tuples(*[index] * len(i.dims)).map(lambda ix, i=i: ir.Load(
        type=i.value_type, input=i.name, index=ix)) for i in SPEC.inputs if i.value_type == value_type])


def params(type: str) -> st.SearchStrategy[ir.Param]:
    return st.sampled_from([ir.Param(type=type, name=p.name) for p in SPEC.params if p.type == type])


INT_CONSTS = st.integers(min_value=0, max_value=2**63 - 1).map(lambda v: ir.Const(type="int", value=v))
INT_LEAVES = st.one_of(
    INT_CONSTS,
    st.sampled_from([ir.Var(name=n) for n in ir.INDEX_VARS] + [ir.Size(name=n) for n in ir.SIZES]),
    params("int"))
FLOAT_LEAVES = st.one_of(
    st.floats(min_value=0.0, allow_nan=False).map(lambda v: ir.Const(type="float", value=v)),
    st.just(ir.Score()), params("float"), loads("float", st.nothing()))  # nothing to index: scalars
BOOL_LEAVES = st.one_of(
    st.booleans().map(lambda v: ir.Const(type="bool", value=v)), loads("bool", st.nothing()))
LEAVES = {"int": INT_LEAVES, "number": st.one_of(INT_LEAVES, FLOAT_LEAVES), "bool": BOOL_LEAVES}


def calls(fns, arg: st.SearchStrategy) -> st.SearchStrategy[ir.Call]:
    return st.sampled_from(fns).flatmap(
        lambda fn: st.tuples(*[arg] * ir.FUNCTIONS[fn][0]).map(lambda args: call(fn, *args)))


@st.composite
def exprs(draw, type: str, depth: int = 4) -> ir.Expr:
    """A random expression, typed as lowering types it; type "number" is an int or a float one.

    A composite at each depth, so that a failure report names it, not the whole tree of strategies."""
    return draw(LEAVES[type] if depth == 0 else nodes(type, depth))


@cache
def nodes(type: str, depth: int) -> st.SearchStrategy[ir.Expr]:
    ints, numbers, bools = (exprs(t, depth - 1) for t in ("int", "number", "bool"))
    # One choice per operator: the operators are what the printer gets wrong.
    if type == "int":  # only what stays int: the indices of loads
        choices = [*(st.builds(arithmetic, st.just(op), ints, ints)
                     for op in ("add", "sub", "mul", "floordiv", "mod")),
                   st.builds(arithmetic, st.just("pow"), ints, INT_CONSTS),
                   st.builds(unary, st.just("neg"), ints),
                   *(st.builds(arithmetic, st.just(op), ints, ints) for op in ir.BITWISE_OPS),
                   st.builds(unary, st.just("invert"), ints),
                   calls(("floor", "ceil", "round"), numbers),
                   loads("int", ints)]
    elif type == "number":
        choices = [*(st.builds(arithmetic, st.just(op), numbers, numbers) for op in ir.ARITHMETIC_OPS),
                   st.builds(unary, st.just("neg"), numbers),
                   st.builds(call, st.just("where"), bools, numbers, numbers),
                   calls([fn for fn in ir.FUNCTIONS if fn != "where"], numbers),
                   loads("int", ints), loads("float", ints)]
    else:
        choices = [*(st.builds(binary, st.just(op), numbers, numbers) for op in ir.COMPARISON_OPS),
                   st.builds(binary, st.sampled_from(("eq", "ne")), bools, bools),
                   *(st.builds(binary, st.just(op), bools, bools) for op in ir.LOGICAL_OPS),
                   st.builds(unary, st.just("not"), bools),
                   st.builds(call, st.just("where"), bools, bools, bools),
                   loads("bool", ints)]
    return st.one_of(LEAVES[type], *choices)


def reparse(expr: ir.Expr) -> ir.Expr:
    text = expr_to_source(expr)
    if expr.type == "bool":  # inside where(), so that it may read score as a mask may not
        return parse_spec(f"{DECLS}score: where({text}, 1, 0)").score.args[0]
    return parse_spec(f"{DECLS}score: {text}").score


@settings(max_examples=500, deadline=None)
@given(st.one_of(exprs("number"), exprs("bool")))
def test_random_expressions_round_trip(expr):
    note(f"printed: {expr_to_source(expr)}")
    same(reparse(expr), expr)


@st.composite
def declarations(draw) -> ir.Spec:
    values = st.one_of(st.tuples(st.just("int"), st.integers(-2**63, 2**63 - 1)),
                       st.tuples(st.just("float"), st.floats(allow_nan=False, allow_infinity=False)))
    params = tuple(ir.ParamDecl(name=f"p{n}", type=t, value=v)
                   for n, (t, v) in enumerate(draw(st.lists(values))))
    dims = st.one_of(st.integers(min_value=1), st.sampled_from(("B", "H", "HKV", "Q_LEN", "KV_LEN", "*")))
    inputs = []
    for n, dtype in enumerate(draw(st.lists(st.sampled_from(ir.DTYPES)))):
        learnable = dtype in ir.FLOAT_DTYPES and draw(st.booleans())
        inputs.append(ir.InputDecl(name=f"x{n}", dtype=dtype, dims=tuple(draw(st.lists(dims, max_size=4))),
                                   learnable=learnable))
    return ir.Spec(name="t", params=params, inputs=tuple(inputs))


@given(declarations())
def test_random_declarations_round_trip(spec):
    same(parse_spec(to_source(spec)), spec)
