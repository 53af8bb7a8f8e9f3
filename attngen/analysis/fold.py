"""Folds constants in IR expressions exactly as the reference computes them, so kernels spell fewer, plainer statements.

`fold` computes what is known at compile time and applies identities that hold exactly:

- ints: an operation on constants is computed with Python's exact ints, as the reference's int64
  computes it (floor `//` and `%`), unless it would raise or its value leaves int64; `x * 1`,
  `x + 0`, `x - 0` give x, `x * -1` gives -x, `--x` gives x, constants of a sum are combined
  (`(x + 2) - 3` is `x - 1`) and a negative one is subtracted, `-x + y` is `y - x`.
  Each is exact in int64's wrapping arithmetic too, and every node it builds has the value of a
  node of the input or a constant that fits int64, so the ranges that decide int32 or int64
  widths (`intervals.Ranges`, computed for new nodes as they come) stay sound.
- floats: a float literal or param is the float32 number nearest it, an int operand the float32
  nearest it, and `+ - * /` and comparisons on constants are computed in float32, as the kernels
  compute them and the reference computes every expression of literals and params alone
  (`reference.Env.constant_dtype`), never in Python's float64 (where `1e-46 * 1e46` is 1.0, not
  NaN). A NaN result stays unfolded (it has no literal). `x * 1.0` gives x.
- bools: `not`, comparisons, `and`, `or` and `where` on constants; `x and True` gives x, and so on.

Params are constants (their values are given). No node changes its type, nor whether the reference
computes it as an int (`intervals.computes_int`: an int ** int the IR types float stays as it is).
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np

from attngen import ir
from attngen.intervals import computes_int
from attngen.ir import I64_RANGE, postorder

_INT_OPS = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
    # Python's // and % round to -inf, as the reference's floor division and torch.remainder do.
    "floordiv": lambda a, b: a // b if b else None, "mod": lambda a, b: a % b if b else None,
    "bitand": lambda a, b: a & b, "bitor": lambda a, b: a | b, "bitxor": lambda a, b: a ^ b,
    # A count outside 0 .. MAX_SHIFT stays unfolded: the number checks reject it with its position.
    "lshift": lambda a, b: a << b if 0 <= b <= ir.MAX_SHIFT else None,
    "rshift": lambda a, b: a >> b if 0 <= b <= ir.MAX_SHIFT else None,
}
# On np.float32 operands: float32 arithmetic, rounded once (a zero divisor is a compile-time error).
_FLOAT_OPS = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
              "div": lambda a, b: a / b if b else None}
_COMPARE = {"eq": lambda a, b: a == b, "ne": lambda a, b: a != b, "lt": lambda a, b: a < b,
            "le": lambda a, b: a <= b, "gt": lambda a, b: a > b, "ge": lambda a, b: a >= b}
_INT_CALLS = {"abs": abs, "sign": lambda x: (x > 0) - (x < 0), "min": min, "max": max,
              "clamp": lambda x, lo, hi: min(max(x, lo), hi)}


def fold(expr: ir.Expr, params: Mapping[str, int | float]) -> ir.Expr:
    """`expr` with what is known at compile time computed; wherever `expr` has a value under the
    reference, the result has the same one (bit for bit for ints and bools). Unchanged subtrees
    are the very same objects."""
    done: dict[int, tuple[ir.Expr, bool]] = {}  # id of a node of expr -> (its fold, computed as int?)
    for node in postorder(expr):
        if id(node) in done:  # a subtree shared within expr
            continue
        kids = [done[id(c)] for c in ir.children(node)]
        kids_int = [is_int for _, is_int in kids]
        is_int = computes_int(node, kids_int)
        folded = _with_children(node, [kid for kid, _ in kids])
        if isinstance(folded, ir.Param):
            value = params[folded.name]
            folded = _const(folded.type, value)
        # A float the reference computes as an int (an int ** int) keeps its form: folding it as
        # either would change what the kernels or the reference compute.
        elif not (folded.type == "float" and is_int):
            folded = _simplify(folded, kids_int)
        done[id(node)] = (folded, is_int)
    return done[id(expr)][0]


def _with_children(node: ir.Expr, kids: list[ir.Expr]) -> ir.Expr:
    if all(new is old for new, old in zip(kids, ir.children(node))):
        return node
    if isinstance(node, ir.Unary):
        return node.model_copy(update={"operand": kids[0]})
    if isinstance(node, ir.Binary):
        return node.model_copy(update={"left": kids[0], "right": kids[1]})
    if isinstance(node, ir.Call):
        return node.model_copy(update={"args": tuple(kids)})
    assert isinstance(node, ir.Load), node
    return node.model_copy(update={"index": tuple(kids)})


def _const(type_: str, value) -> ir.Const:
    cast = {"int": int, "float": float, "bool": bool}[type_]
    return ir.Const(type=type_, value=cast(value))


def _int(e: ir.Expr) -> int | None:
    return e.value if isinstance(e, ir.Const) and e.type == "int" else None


def _fits(value: int) -> bool:
    return I64_RANGE[0] <= value <= I64_RANGE[1]


def _float32(value: int | float) -> np.float32:
    """A constant as the kernels hold it in a float operation: the nearest float32 (an int is rounded
    once, from int64, as torch and the GPU convert it; a float past float32's range is inf)."""
    if isinstance(value, int):
        return np.int64(value).astype(np.float32)
    with np.errstate(over="ignore"):
        return np.float32(value)


def _simplify(e: ir.Expr, kids_int: list[bool]) -> ir.Expr:
    """One node whose children are folded, folded."""
    kids = ir.children(e)
    if isinstance(e, (ir.Unary, ir.Binary, ir.Call)) and all(isinstance(k, ir.Const) for k in kids):
        value = _constant_value(e)
        if value is not None:
            return _const(e.type, value)
    if isinstance(e, ir.Unary):
        return _unary(e)
    if isinstance(e, ir.Binary):
        if e.type == "int":
            return _int_binary(e)
        if e.type == "bool":
            return _logic(e)
        # x * 1.0 is x, also for inf, NaN and -0.0; x must be a float as the reference computes it.
        for x, other, x_int in ((e.left, e.right, kids_int[0]), (e.right, e.left, kids_int[1])):
            if e.op == "mul" and x.type == "float" and not x_int and isinstance(other, ir.Const) \
                    and other.value == 1:
                return x
        return e
    if isinstance(e, ir.Call) and e.fn == "where" and isinstance(e.args[0], ir.Const):
        branch, branch_int = (e.args[1], kids_int[1]) if e.args[0].value else (e.args[2], kids_int[2])
        if branch.type == e.type and branch_int == (e.type == "int"):
            return branch
    return e


def _constant_value(e: ir.Expr):
    """The value of a node whose children are all constants, or None when it must stay: it would
    raise, leave int64, or round differently in float32 and float64 (or is a function that rounds)."""
    kids = ir.children(e)
    values = [k.value for k in kids]
    if isinstance(e, ir.Unary):
        if e.op == "not":
            return not values[0]
        if e.op == "invert":
            return ~values[0]  # fits int64 whenever its operand does
        # Negation is exact in every precision (rounding is symmetric), so any float may be negated.
        return -values[0] if e.type == "float" or _fits(-values[0]) else None
    if isinstance(e, ir.Binary) and e.op in ir.LOGICAL_OPS:
        return (values[0] and values[1]) if e.op == "and" else (values[0] or values[1])
    if e.type == "float" or any(k.type == "float" for k in kids):
        # A float result (a true division of ints too), and a comparison of ints with floats, are
        # computed in float32: its operands are float32 numbers, as here.
        values = [_float32(v) for v in values]
    if isinstance(e, ir.Binary) and e.op in _COMPARE:
        return bool(_COMPARE[e.op](*values))
    if e.type == "float":
        if not (isinstance(e, ir.Binary) and e.op in _FLOAT_OPS):
            return None
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):
            value = _FLOAT_OPS[e.op](*values)
        return None if value is None or np.isnan(value) else float(value)
    if isinstance(e, ir.Binary):
        value = _int_power(*values) if e.op == "pow" else _INT_OPS[e.op](*values)
    elif e.fn in ("floor", "ceil", "round") and kids[0].type != "float":
        value = values[0]  # the reference's floor and ceil of an int are that int (through a float, 2**62 + 1 is not)
    elif e.fn in ("floor", "ceil", "round"):
        x = float(values[0])
        rounding = {"floor": math.floor, "ceil": math.ceil, "round": round}[e.fn]  # round: ties to even
        value = rounding(x) if math.isfinite(x) else None
    elif e.fn in _INT_CALLS:
        value = _INT_CALLS[e.fn](*values)
    else:
        return None  # where: a constant condition picks a branch in `_simplify`
    return value if value is not None and _fits(value) else None


def _int_power(base: int, exponent: int) -> int | None:
    """base ** exponent, or None where the reference has no int value or it cannot fit int64 (and
    computing it could take forever: think 3 ** 10 ** 18)."""
    if exponent < 0:
        return None
    if abs(base) <= 1:
        return base ** min(exponent, 2 + exponent % 2)  # only the parity of a large exponent matters
    return base ** exponent if exponent < 64 else None


def _unary(e: ir.Unary) -> ir.Expr:
    if e.op == "neg" and e.type == "int":
        return _negated(e.operand, e)
    return e


def _negated(x: ir.Expr, e: ir.Expr | None = None) -> ir.Expr:
    """-x for an int x, folded (`e`: the node that already says so, if there is one)."""
    if isinstance(x, ir.Unary) and x.op == "neg":
        return x.operand
    if isinstance(x, ir.Const) and _fits(-x.value):
        return _const("int", -x.value)
    return e if e is not None else ir.Unary(type="int", op="neg", operand=x)


def _offset(x: ir.Expr) -> tuple[ir.Expr, int]:
    """x as base + c with c a literal (c = 0 when it has no literal term)."""
    if isinstance(x, ir.Binary) and x.type == "int" and x.op in ("add", "sub") and _int(x.right) is not None:
        return x.left, _int(x.right) if x.op == "add" else -_int(x.right)
    return x, 0


def _shifted(base: ir.Expr, c: int, e: ir.Binary) -> ir.Expr:
    """base + c as `base + c`, `base - |c|` or base; `e` (the node being folded) when that is what it is."""
    if isinstance(base, ir.Const):
        return _const("int", base.value + c) if _fits(base.value + c) else e
    if c == 0:
        return base
    op, literal = ("sub", -c) if c < 0 and _fits(-c) else ("add", c)
    if e.op == op and e.left is base and _int(e.right) == literal:
        return e
    return ir.Binary(type="int", op=op, left=base, right=_const("int", literal))


def _int_binary(e: ir.Binary) -> ir.Expr:
    """Exact identities of an int + - or * whose operands are not both constants."""
    a, b = e.left, e.right
    if e.op == "mul":
        for x, c in ((a, _int(b)), (b, _int(a))):
            if c == 1:
                return x
            if c == -1:
                return _negated(x)
        return e
    if e.op not in ("add", "sub"):
        return e
    if _int(b) is not None or (e.op == "add" and _int(a) is not None):
        # Literals gather at the end of a sum: (x + 2) - 3 is x - 1, 5 + x is x + 5.
        x, c = (a, _int(b)) if _int(b) is not None else (b, _int(a))
        base, c0 = _offset(x)
        total = c0 + (c if e.op == "add" else -c)
        return _shifted(base, total, e) if _fits(total) else e
    if e.op == "sub" and _int(a) == 0:
        return _negated(b)
    if isinstance(b, ir.Unary) and b.op == "neg":  # x + -y is x - y, x - -y is x + y
        return ir.Binary(type="int", op="sub" if e.op == "add" else "add", left=a, right=b.operand)
    if e.op == "add" and isinstance(a, ir.Unary) and a.op == "neg":  # -x + y is y - x
        return ir.Binary(type="int", op="sub", left=b, right=a.operand)
    return e


def _logic(e: ir.Binary) -> ir.Expr:
    """`and` and `or` with one constant operand."""
    if e.op not in ir.LOGICAL_OPS:
        return e
    for x, c in ((e.left, e.right), (e.right, e.left)):
        if isinstance(c, ir.Const):
            if e.op == "and":
                return x if c.value else c
            return c if c.value else x
    return e


def pinned(e: ir.Expr, sizes: Mapping[str, int]) -> ir.Expr:
    """`e` with the sizes in `sizes` as int constants (the very same object where it reads none)."""
    if isinstance(e, ir.Size) and e.name in sizes:
        return ir.Const(type="int", value=sizes[e.name])
    if not sizes or not any(isinstance(n, ir.Size) and n.name in sizes for n in postorder(e)):
        return e
    kids = [pinned(c, sizes) for c in ir.children(e)]
    if isinstance(e, ir.Load):
        return e.model_copy(update={"index": tuple(kids)})
    if isinstance(e, ir.Unary):
        return e.model_copy(update={"operand": kids[0]})
    if isinstance(e, ir.Binary):
        return e.model_copy(update={"left": kids[0], "right": kids[1]})
    return e.model_copy(update={"args": tuple(kids)})
