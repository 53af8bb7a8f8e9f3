"""Differentiates score expressions symbolically on the IR, for the backward kernels."""

from __future__ import annotations

import math

from attngen import ir

ZERO = ir.Const(type="float", value=0.0)
ONE = ir.Const(type="float", value=1.0)


def _const(value: float) -> ir.Const:
    return ir.Const(type="float", value=float(value))


def _is(e: ir.Expr, value: float) -> bool:
    return isinstance(e, ir.Const) and e.type != "bool" and e.value == value


def _float(e: ir.Expr) -> str:
    return "float" if e.type == "float" else e.type


# Smart constructors: fold the zeros and ones that differentiation produces, so the
# rendered derivative of `score + bias` is `1.0`, not `1.0 + 0.0 * ...`.
def add(a: ir.Expr, b: ir.Expr) -> ir.Expr:
    if _is(a, 0):
        return b
    if _is(b, 0):
        return a
    return ir.Binary(type="float", op="add", left=a, right=b)


def sub(a: ir.Expr, b: ir.Expr) -> ir.Expr:
    if _is(b, 0):
        return a
    if _is(a, 0):
        return neg(b)
    return ir.Binary(type="float", op="sub", left=a, right=b)


def mul(a: ir.Expr, b: ir.Expr) -> ir.Expr:
    if _is(a, 0) or _is(b, 0):
        return ZERO
    if _is(a, 1):
        return b
    if _is(b, 1):
        return a
    return ir.Binary(type="float", op="mul", left=a, right=b)


def div(a: ir.Expr, b: ir.Expr) -> ir.Expr:
    if _is(a, 0):
        return ZERO
    if _is(b, 1):
        return a
    return ir.Binary(type="float", op="div", left=a, right=b)


def neg(a: ir.Expr) -> ir.Expr:
    if _is(a, 0):
        return ZERO
    if isinstance(a, ir.Const):
        return _const(-a.value)
    return ir.Unary(type="float", op="neg", operand=a)


def call(fn: str, *args: ir.Expr, type: str = "float") -> ir.Expr:
    return ir.Call(type=type, fn=fn, args=tuple(args))


def where(cond: ir.Expr, a: ir.Expr, b: ir.Expr) -> ir.Expr:
    if a == b:
        return a
    return call("where", cond, a, b)


def compare(op: str, a: ir.Expr, b: ir.Expr) -> ir.Expr:
    return ir.Binary(type="bool", op=op, left=a, right=b)


def derivative(expr: ir.Expr, wrt: ir.Expr) -> ir.Expr:
    """d expr / d wrt, where `wrt` is `Score()` or a float `Load` (equal loads read the same element).

    Ties follow torch's autograd, which the reference uses: min/max split the gradient evenly
    on a tie, clamp passes it to x on the closed interval [lo, hi], abs has derivative 0 at 0.
    """
    if expr == wrt:
        return ONE
    if expr.type != "float":
        return ZERO  # ints and booleans are piecewise constant
    d = lambda e: derivative(e, wrt)  # noqa: E731
    # A reduction does not depend on score; the kernels read it as an input of its own (ir.without_reductions),
    # and torch carries its gradient to the input it reduces, so the analysis never differentiates one by a load.
    if isinstance(expr, (ir.Const, ir.Var, ir.Size, ir.Param, ir.Score, ir.Load, ir.Reduce)):
        return ZERO
    if isinstance(expr, ir.Unary):
        return neg(d(expr.operand))
    if isinstance(expr, ir.Binary):
        a, b = expr.left, expr.right
        da, db = d(a), d(b)
        if expr.op == "add":
            return add(da, db)
        if expr.op == "sub":
            return sub(da, db)
        if expr.op == "mul":
            return add(mul(da, b), mul(a, db))
        if expr.op == "div":
            return div(sub(mul(da, b), mul(a, db)), mul(b, b))
        if expr.op == "floordiv":
            return ZERO
        if expr.op == "mod":  # a - b * floor(a / b)
            return sub(da, mul(db, call("floor", div(a, b), type="int")))
        if expr.op == "pow":
            term_a = mul(da, mul(b, ir.Binary(type="float", op="pow", left=a, right=_minus_one(b))))
            term_b = mul(db, mul(expr, call("log", a))) if not _is(db, 0) else ZERO
            return add(term_a, term_b)
        raise AssertionError(f"float binary op {expr.op}")
    assert isinstance(expr, ir.Call)
    fn, args = expr.fn, expr.args
    x = args[0]
    if fn == "where":
        cond, a, b = args
        return where(cond, d(a), d(b))
    if fn in ("min", "max"):
        a, b = args
        first = "lt" if fn == "min" else "gt"
        second = "gt" if fn == "min" else "lt"
        da, db = d(a), d(b)
        half = mul(_const(0.5), add(da, db))
        return where(compare(first, a, b), da, where(compare(second, a, b), db, half))
    if fn == "clamp":
        _, lo, hi = args
        inside = ir.Binary(type="bool", op="and", left=compare("ge", x, lo), right=compare("le", x, hi))
        # clamp is min(max(x, lo), hi): when lo > hi the value is hi, so lo gets the gradient
        # only below a non-empty interval.
        below = ir.Binary(type="bool", op="and", left=compare("lt", x, lo), right=compare("le", lo, hi))
        return where(inside, d(x), where(below, d(lo), d(hi)))
    if fn == "softcap":
        x, cap = args
        t = call("tanh", div(x, cap))
        sech2 = sub(ONE, mul(t, t))
        dcap = d(cap)
        return add(mul(sech2, d(x)), mul(dcap, sub(t, mul(div(x, cap), sech2))))
    dx = d(x)
    if _is(dx, 0):
        return ZERO
    if fn == "tanh":
        return mul(sub(ONE, mul(expr, expr)), dx)
    if fn == "exp":
        return mul(expr, dx)
    if fn == "exp2":
        return mul(mul(expr, _const(math.log(2.0))), dx)
    if fn == "log":
        return div(dx, x)
    if fn == "log2":
        return div(dx, mul(x, _const(math.log(2.0))))
    if fn == "sqrt":
        return div(dx, mul(_const(2.0), expr))
    if fn == "rsqrt":
        return mul(mul(_const(-0.5), div(expr, x)), dx)
    if fn == "sigmoid":
        return mul(mul(expr, sub(ONE, expr)), dx)
    if fn == "abs":
        sign = where(compare("gt", x, ZERO), ONE, where(compare("lt", x, ZERO), _const(-1.0), ZERO))
        return mul(sign, dx)
    if fn == "sin":
        return mul(call("cos", x), dx)
    if fn == "cos":
        return mul(neg(call("sin", x)), dx)
    if fn == "tan":
        return mul(add(ONE, mul(expr, expr)), dx)
    if fn == "atan":
        return div(dx, add(ONE, mul(x, x)))
    if fn == "erf":
        return mul(mul(_const(2.0 / math.sqrt(math.pi)), call("exp", neg(mul(x, x)))), dx)
    if fn in ("floor", "ceil", "round", "sign"):  # piecewise constant, as torch's autograd says
        return ZERO
    raise AssertionError(f"no derivative rule for {fn}")


def _minus_one(b: ir.Expr) -> ir.Expr:
    if isinstance(b, ir.Const):
        return _const(b.value - 1)
    return ir.Binary(type="float", op="sub", left=b, right=ONE)


def learnable_loads(spec: ir.Spec) -> tuple[ir.Load, ...]:
    """The distinct loads of learnable inputs in the score expression, in first-use order."""
    if spec.score is None:
        return ()
    learnable = {i.name for i in spec.learnable_inputs}
    seen: list[ir.Load] = []
    for node in ir.walk(spec.score):
        if isinstance(node, ir.Load) and node.input in learnable and node not in seen:
            seen.append(node)
    return tuple(seen)


def tile_gathers(spec: ir.Spec) -> tuple[ir.Load, ...]:
    """The distinct loads whose index varies with both q and k: each reads a whole score tile."""
    seen: list[ir.Load] = []
    for expr in (spec.mask, spec.score):
        for node in ir.walk(expr) if expr is not None else ():
            names = {n.name for i in getattr(node, "index", ()) for n in ir.walk(i) if isinstance(n, ir.Var)}
            if isinstance(node, ir.Load) and {"q", "k"} <= names and node not in seen:
                seen.append(node)
    return tuple(seen)


def gather_bytes(spec: ir.Spec) -> int:
    """Bytes per score element read by the spec's tile gathers (the planner reserves room for them)."""
    return sum(ir.DTYPE_BYTES[spec.input(load.input).dtype] for load in tile_gathers(spec))
