"""Prints IR back to `.attn` source text that parses to the same IR: `parse_spec(to_source(s)) == s`.

Fuzzing draws specs as IR, and its failure reports must show a spec a person can read, save
and rerun; `attngen explain` shows the normalised spec the later stages see (builtin masks
expanded but `causal_bottom_right`, whose expansion reads the first query row's position, which no
spec text can name; `+x` dropped, a chained comparison split into `and`). Both need IR as text.

Every IR the parser can produce prints back to itself. Shapes it cannot produce print as
near as the language allows:

- a negative `Const` (the parser reads `-1` as `neg(1)`) prints as that negation: the same
  value, but a `Unary` node on the way back; likewise `-inf`. `-0.0` prints as `0.0`.
- NaN, and an infinite param value, have no literal: ValueError.
- Types are not printed: the parser recomputes them from the text, so IR typed otherwise
  than lowering types it (`Const(type="int", value=1.5)`, a `Param` whose type is not its
  declaration's) does not come back as it was.
"""

from __future__ import annotations

import math
from typing import Callable

from attngen import ir

# The grammar's precedence levels (attn.lark), loosest first; an atom binds tightest.
OR, AND, NOT, COMPARISON, BITOR, BITXOR, BITAND, SHIFT, ARITH, TERM, FACTOR, POWER, ATOM = range(13)

# op -> (text, level of the node, least level of its left operand, least level of its right).
# Left-associative levels take their own level on the left and the next one on the right;
# `**` is `atom ** factor`, so it is right-associative and `-x ** y` is `-(x ** y)`.
# A comparison takes `|` expressions on both sides: `a < b < c` would be a chain, `a < b and b < c`.
_BINARY = {
    "or": ("or", OR, OR, AND),
    "and": ("and", AND, AND, NOT),
    **{op: (text, COMPARISON, BITOR, BITOR) for op, text in
       (("eq", "=="), ("ne", "!="), ("lt", "<"), ("le", "<="), ("gt", ">"), ("ge", ">="))},
    "bitor": ("|", BITOR, BITOR, BITXOR),
    "bitxor": ("^", BITXOR, BITXOR, BITAND),
    "bitand": ("&", BITAND, BITAND, SHIFT),
    "lshift": ("<<", SHIFT, SHIFT, ARITH),
    "rshift": (">>", SHIFT, SHIFT, ARITH),
    "add": ("+", ARITH, ARITH, TERM),
    "sub": ("-", ARITH, ARITH, TERM),
    **{op: (text, TERM, TERM, FACTOR) for op, text in
       (("mul", "*"), ("div", "/"), ("floordiv", "//"), ("mod", "%"))},
    "pow": ("**", POWER, ATOM, FACTOR),
}


def to_source(spec: ir.Spec) -> str:
    """A whole spec file: header, params, inputs, then `mask:`, `score:`, `scale:` and `sink:` as present, and
    `normalize:` where it is not the default softmax."""
    lines = [f"attention {spec.name}"]
    lines += [f"param {p.name} = {_number(p.value, p.type)}" for p in spec.params]
    lines += [_input(i) for i in spec.inputs]
    for item in ("mask", "score", "scale", "sink"):
        expr = getattr(spec, item)
        if expr is not None:
            lines.append(f"{item}: {expr_to_source(expr)}")
    if spec.normalize != "softmax":
        lines.append(f"normalize: {spec.normalize}")
    return "\n".join(lines) + "\n"


def expr_to_source(expr: ir.Expr) -> str:
    """One expression, with only the parentheses the grammar needs to read it back the same."""
    return _expr(expr)[0]


def _input(decl: ir.InputDecl) -> str:
    learnable = " learnable" if decl.learnable else ""
    return f"input {decl.name}: {decl.dtype}[{', '.join(map(str, decl.dims))}]{learnable}"


def _number(value: int | float, type: ir.ValueType) -> str:
    if type == "int":
        return str(int(value))
    if not math.isfinite(value):
        raise ValueError(f"a float literal must be finite, got {value!r}")
    # repr is the shortest text that reads back as the same float, and always has '.' or 'e'.
    return repr(float(value))


def _const(const: ir.Const) -> tuple[str, int]:
    if const.type == "bool":
        return ("true" if const.value else "false"), ATOM
    magnitude = abs(const.value)
    text = "inf" if const.type == "float" and math.isinf(magnitude) else _number(magnitude, const.type)
    return (f"-{text}", FACTOR) if const.value < 0 else (text, ATOM)


def _operand(expr: ir.Expr, least: int) -> str:
    text, level = _expr(expr)
    return text if level >= least else f"({text})"


def _expr(expr: ir.Expr) -> tuple[str, int]:
    """The text of an expression and the grammar level it parses at."""
    if isinstance(expr, ir.Binary) and expr.op == "ge" and expr == ir.BUILTIN_MASKS["causal_bottom_right"]:
        return "causal_bottom_right", ATOM  # it reads Q_OFFSET, which spec text cannot name
    match expr:
        case ir.Const():
            return _const(expr)
        case ir.Var() | ir.Size() | ir.Param():
            return expr.name, ATOM
        case ir.Score():
            return "score", ATOM
        case ir.Load(index=()):
            return expr.input, ATOM
        case ir.Load():
            return f"{expr.input}[{', '.join(expr_to_source(i) for i in expr.index)}]", ATOM
        case ir.Reduce():
            index = ", ".join(":" if i is None else expr_to_source(i) for i in expr.index)
            return f"{expr.op}({expr.input}[{index}])", ATOM
        case ir.Call():
            return f"{expr.fn}({', '.join(expr_to_source(a) for a in expr.args)})", ATOM
        case ir.Unary(op="neg"):
            return f"-{_operand(expr.operand, FACTOR)}", FACTOR
        case ir.Unary(op="invert"):
            return f"~{_operand(expr.operand, FACTOR)}", FACTOR
        case ir.Unary(op="not"):
            return f"not {_operand(expr.operand, NOT)}", NOT
        case ir.Binary():
            text, level, left, right = _BINARY[expr.op]
            return f"{_operand(expr.left, left)} {text} {_operand(expr.right, right)}", level
    raise AssertionError(f"unknown IR node {expr!r}")


# --- host Python: the `scale:` expression as the generated module's softmax_scale(D) computes it ---

_PYTHON_BINARY = {"add": "+", "sub": "-", "mul": "*", "eq": "==", "ne": "!=", "lt": "<", "le": "<=",
                  "gt": ">", "ge": ">="}


def literal(value, type_: str) -> str:
    """A constant of the IR as a literal that Python and Triton's kernels read alike."""
    if type_ == "bool":
        return "True" if value else "False"
    if type_ == "int":
        return str(int(value))
    if math.isinf(value):
        return 'float("inf")' if value > 0 else 'float("-inf")'
    return repr(float(value))


def host_scale(e: ir.Expr, params: dict[str, int | float]) -> Callable[[int], float]:
    """The generated module's softmax_scale(D) for a `scale:` expression, as a function of D: the same
    text (names are validated identifiers, numbers are literals), so compile-time checks run what
    a call will run."""
    return eval(f"lambda D: float({python_expr(e, params)})",
                {"math": math, "__builtins__": {"float": float, "abs": abs, "min": min, "max": max, "round": round}})


def python_expr(e: ir.Expr, params: dict[str, int | float]) -> str:
    """A host-side Python expression (for `scale:`, which may use only D, params and numbers)."""
    if isinstance(e, ir.Const):
        return literal(e.value, e.type)
    if isinstance(e, ir.Size):
        return e.name
    if isinstance(e, ir.Param):
        return literal(params[e.name], e.type)
    if isinstance(e, ir.Unary):
        x = python_expr(e.operand, params)
        return {"not": f"(not {x})", "neg": f"(-{x})", "invert": f"(~{x})"}[e.op]
    if isinstance(e, ir.Binary):
        ops = {**_PYTHON_BINARY, "and": "and", "or": "or", "div": "/", "floordiv": "//", "mod": "%", "pow": "**",
               "bitand": "&", "bitor": "|", "bitxor": "^", "lshift": "<<", "rshift": ">>"}
        return f"({python_expr(e.left, params)} {ops[e.op]} {python_expr(e.right, params)})"
    assert isinstance(e, ir.Call)
    args = [python_expr(a, params) for a in e.args]
    simple = {"tanh": "math.tanh", "exp": "math.exp", "log": "math.log", "log2": "math.log2",
              "sqrt": "math.sqrt", "abs": "abs", "floor": "math.floor", "ceil": "math.ceil",
              "min": "min", "max": "max", "sin": "math.sin", "cos": "math.cos", "tan": "math.tan",
              "atan": "math.atan", "erf": "math.erf", "round": "round"}
    if e.fn in simple:
        return f"{simple[e.fn]}({', '.join(args)})"
    if e.fn == "exp2":
        return f"(2.0 ** {args[0]})"
    if e.fn == "rsqrt":
        return f"(1.0 / math.sqrt({args[0]}))"
    if e.fn == "sigmoid":
        return f"(1.0 / (1.0 + math.exp(-{args[0]})))"
    if e.fn == "clamp":
        return f"min(max({args[0]}, {args[1]}), {args[2]})"
    if e.fn == "sign":  # NaN stays NaN, as torch.sign
        return f"(math.nan if {args[0]} != {args[0]} else ({args[0]} > 0) - ({args[0]} < 0))"
    if e.fn == "where":
        return f"({args[1]} if {args[0]} else {args[2]})"
    assert e.fn == "softcap", e.fn
    return f"({args[1]} * math.tanh({args[0]} / {args[1]}))"
