"""Exact loop bounds: the analysis' loop bounds, computed in int64 that provably cannot wrap.

The loop bounds of `analysis.spans` combine the spec's ints (`prefix[b] - 1`), whose ranges over
every call `attngen.intervals` gives (`Ranges`); `exact_span` proves the bounds' int64 arithmetic
cannot wrap, or makes it so, and `linear_steps` is the order of operations the kernels follow.
"""

from __future__ import annotations

import math

from attngen import ir
from attngen.analysis.spans import Bound, Extremum, Gate, Linear, Span
from attngen.intervals import MAX_LENGTH, Num, Ranges, Truth, fits
from attngen.ir import I64_RANGE

# Loop bounds clamp to [0, LEN] with LEN <= MAX_LENGTH: values beyond these ends all clamp alike.
_SPAN_ENDS = (-1, MAX_LENGTH)
_GATE_ENDS = (-1, 0)  # a gate only asks `cond >= 0`
# A loop bound's too-wide leaf (an i64 input) is saturated at this magnitude: far beyond any
# position, yet far enough below 2**63 that the bound's own arithmetic cannot wrap.
SATURATE = 2 ** 40


def _linear_terms(expr: ir.Expr | None) -> tuple[dict[ir.Expr, int], int]:
    """expr as c0 + sum(coef * leaf), reading through +, -, unary - and products with an int literal
    (how the analysis builds a bound's constant); whatever else it meets is a leaf."""
    terms: dict[ir.Expr, int] = {}
    c0 = 0
    stack = [(expr, 1)] if expr is not None else []
    while stack:
        e, c = stack.pop()
        if isinstance(e, ir.Const):
            c0 += c * int(e.value)
        elif isinstance(e, ir.Unary) and e.op == "neg":
            stack.append((e.operand, -c))
        elif isinstance(e, ir.Binary) and e.op in ("add", "sub"):
            stack += [(e.right, c if e.op == "add" else -c), (e.left, c)]
        elif isinstance(e, ir.Binary) and e.op == "mul" and isinstance(e.left, ir.Const):
            stack.append((e.right, c * int(e.left.value)))
        elif isinstance(e, ir.Binary) and e.op == "mul" and isinstance(e.right, ir.Const):
            stack.append((e.left, c * int(e.right.value)))
        else:
            terms[e] = terms.get(e, 0) + c
    return {leaf: c for leaf, c in terms.items() if c != 0}, c0


def _sum(terms: dict[ir.Expr, int], c0: int, saturated: set) -> ir.Expr | None:
    """c0 + sum(coef * leaf) as IR, with the leaves in `saturated` clamped to +-SATURATE."""
    total = None
    for leaf, c in terms.items():
        if leaf in saturated:
            leaf = ir.Call(type="int", fn="clamp", args=(leaf, ir.Const(type="int", value=-SATURATE),
                                                         ir.Const(type="int", value=SATURATE)))
        if c != 1:
            leaf = ir.Binary(type="int", op="mul", left=ir.Const(type="int", value=c), right=leaf)
        total = leaf if total is None else ir.Binary(type="int", op="add", left=total, right=leaf)
    if c0:
        c = ir.Const(type="int", value=c0)
        total = c if total is None else ir.Binary(type="int", op="add", left=total, right=c)
    return total


def _add(a: tuple, b: tuple) -> tuple:
    return a[0] + b[0], a[1] + b[1]


def _scale(a: tuple, c: int) -> tuple:
    return (a[0] * c, a[1] * c) if c >= 0 else (a[1] * c, a[0] * c)


def _floordiv(a: tuple, d: int) -> tuple:  # d > 0: monotone
    return tuple(x // d if math.isfinite(x) else x for x in a)


def linear_steps(b: Linear, var: tuple, const: tuple | None, var_offset: tuple | None,
                 out_offset: tuple | None) -> list[tuple]:
    """The ranges of every intermediate value of a Linear bound, as `TritonEmitter.bound` computes it,
    the bound itself last. Arguments are (lo, hi) ranges; None: absent."""
    steps = []
    y = var
    if b.coef and (b.var_div != 1 or var_offset is not None):
        if var_offset is not None:
            y = _add(y, var_offset)
            steps.append(y)
        y = _floordiv(y, b.var_div)
        steps.append(y)
    num = _scale(y, b.coef)
    steps.append(num)
    if const is not None:
        num = _add(num, const)
        steps.append(num)
    m = num
    if b.den != 1:
        if b.round == "ceil":  # -floor(-num / den)
            steps.append(_scale(num, -1))
            m = _scale(_floordiv(_scale(num, -1), b.den), -1)
        else:
            m = _floordiv(num, b.den)
        steps.append(m)
    v = _scale(m, b.out_scale)
    steps.append(v)
    if out_offset is not None:
        v = _add(v, out_offset)
        steps.append(v)
    return steps


def _range(value: Num | Truth) -> tuple:
    return value.lo, value.hi


def exact_linear(b: Linear, ranges: Ranges, var: tuple, ends: tuple[int, int]) -> Linear | None:
    """`b` with its constant rebuilt so that its int64 arithmetic cannot wrap, or None if that cannot be done.

    A bound is used only clamped: values at or below ends[0] all act alike, and so do values at or
    above ends[1]. So a leaf of the constant whose range is too wide (an i64 input) may be clamped
    to +-SATURATE when, with it anywhere beyond that magnitude (and every other leaf anywhere in
    its range or its clamped range), the bound lies beyond one end: then the true leaf and the
    clamped one give the same clamped bound. Interval arithmetic proves that, and then proves the
    rebuilt bound's every step fits int64 (with room for the +1 of an exclusive upper bound)."""
    terms, c0 = _linear_terms(b.const)
    offsets = [b.var_offset, b.out_offset]
    for e in [*terms, *(o for o in offsets if o is not None)]:
        if ranges.overflow(e) is not None:
            return None
    leaf_ranges = {leaf: _range(ranges.value(leaf)) for leaf in terms}
    var_offset, out_offset = (_range(ranges.value(o)) if o is not None else None for o in offsets)

    def steps(leaves: dict) -> list[tuple]:
        const = (c0, c0)
        for leaf, c in terms.items():
            const = _add(const, _scale(leaves[leaf], c))
        return linear_steps(b, var, const if terms or c0 else None, var_offset, out_offset)

    def clamped(r: tuple) -> tuple:
        return min(max(r[0], -SATURATE), SATURATE), max(min(r[1], SATURATE), -SATURATE)

    def beyond_ends(v: tuple) -> bool:
        return v[1] <= ends[0] or v[0] >= ends[1]

    # Another leaf may be clamped too: it lies in its range or in its clamped range.
    either = {leaf: (min(r[0], clamped(r)[0]), max(r[1], clamped(r)[1])) for leaf, r in leaf_ranges.items()}
    saturated = set()
    for leaf, r in leaf_ranges.items():
        if clamped(r) == r:
            continue
        outside = [part for part in ((SATURATE, r[1]), (r[0], -SATURATE)) if part[0] <= part[1]]
        if all(beyond_ends(steps({**either, leaf: part})[-1]) for part in outside):
            saturated.add(leaf)
    used = {leaf: clamped(r) if leaf in saturated else r for leaf, r in leaf_ranges.items()}
    room = (I64_RANGE[0] + 1, I64_RANGE[1] - 1)
    if not all(fits(Num(*s), room) for s in steps(used)):
        return None
    const = _sum(terms, c0, saturated)
    if const is not None and ranges.overflow(const) is not None:
        return None
    return Linear(b.coef, b.var, const, b.den, b.round, b.var_div, b.var_offset, b.out_scale, b.out_offset)


_UNSAFE = object()


def _exact_bound(bound: Bound, ranges: Ranges, var: tuple):
    """A bound with every Linear made exact (`exact_linear`), or _UNSAFE inside where one cannot be."""
    if bound is None:
        return None
    if isinstance(bound, Extremum):
        return Extremum(bound.op, tuple(_exact_bound(t, ranges, var) for t in bound.terms))
    if isinstance(bound, Gate):
        cond = exact_linear(bound.cond, ranges, var, _GATE_ENDS)
        return _UNSAFE if cond is None else Gate(cond, bound.side)
    b = exact_linear(bound, ranges, var, _SPAN_ENDS)
    return _UNSAFE if b is None else b


def _widened(bound, side: str) -> Bound:
    """A bound with its unsafe parts taken as unbounded on its side: the span only grows."""
    if bound is _UNSAFE:
        return None
    if not isinstance(bound, Extremum):
        return bound
    terms = [_widened(t, side) for t in bound.terms]
    if any(t is None for t in terms):
        # Unbounded wins a min of lower bounds (a hull) and a max of upper ones; it drops out of
        # the others (an intersection).
        if (bound.op == "min") == (side == "lo"):
            return None
        terms = [t for t in terms if t is not None]
    return terms[0] if len(terms) == 1 else Extremum(bound.op, tuple(terms))


def _has_unsafe(bound) -> bool:
    if isinstance(bound, Extremum):
        return any(_has_unsafe(t) for t in bound.terms)
    return bound is _UNSAFE


def exact_span(span: Span | None, ranges: Ranges, length: int, inner: bool) -> Span | None:
    """`span` with bounds whose int64 arithmetic cannot wrap at lengths up to `length`.

    A visited span may only grow, so a bound that cannot be made exact becomes unbounded; an inner
    (fully allowed) span may only shrink, so it is dropped whole (None: nothing known full)."""
    if span is None:
        return None
    var = (0, max(1, length) - 1)  # a tile's first and last index
    lo, hi = (_exact_bound(b, ranges, var) for b in (span.lo, span.hi))
    if inner and (_has_unsafe(lo) or _has_unsafe(hi)):
        return None
    return Span(_widened(lo, "lo"), _widened(hi, "hi"))
