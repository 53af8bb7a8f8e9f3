"""Exact integer arithmetic: every int a spec computes gets a range, and from it its kernel width, the lengths it fits at, and exact loop bounds.

The reference computes every int in int64 (torch), and "exact" means the kernels agree
with it and neither wraps. So each int node gets its range over everything a call may
bring (`box`: lengths up to a limit, batch and heads up to the launch grid's limit, head
dims 1..256, params as set, tensor inputs anywhere in their dtype) by the interval rules
of `attngen.intervals`. The kernels compute a node in int32 where that range fits, and in
int64 otherwise (`Ranges.wide`). Where a range does not fit int64 either at the longest
sequences, `length_limit` finds the longest lengths at which every int fits; the module
refuses longer ones at call time, and `attngen.checks` rejects a spec whose limit is too
short to be of use. The analysis' loop bounds combine such ints too (`prefix[b] - 1`),
so `exact_span` proves their int64 arithmetic cannot wrap, or makes it so.
"""

from __future__ import annotations

import math

from attngen import ir
from attngen.analysis.spans import Bound, Extremum, Gate, Linear, Span
from attngen.analysis.intervals import I32_RANGE, I64_RANGE, Num, TileBox, Truth, node_value

# Positions are int32 in the kernels (their offsets are int32 tiles, and Triton passes an int
# argument below 2**31 as i32), so no length reaches 2**31.
MAX_LENGTH = 2 ** 31 - 1
# The launch grid's second axis is B * H, at most 65535 on CUDA: so B, H and HKV are at most 65535.
MAX_BATCH_HEADS = 65535
HEAD_DIMS = (1, 256)  # the head dims the generated module accepts
# Loop bounds clamp to [0, LEN] with LEN <= MAX_LENGTH: values beyond these ends all clamp alike.
_SPAN_ENDS = (-1, MAX_LENGTH)
_GATE_ENDS = (-1, 0)  # a gate only asks `cond >= 0`
# A loop bound's too-wide leaf (an i64 input) is saturated at this magnitude: far beyond any
# position, yet far enough below 2**63 that the bound's own arithmetic cannot wrap.
SATURATE = 2 ** 40


def box(spec: ir.Spec, length: int) -> TileBox:
    """Everything a call may bring, with Q_LEN and KV_LEN at most `length`; a cache call's query
    positions q_offset + i too, which the module checks lie below `length`, so Q_OFFSET does."""
    length = max(1, min(length, MAX_LENGTH))
    heads = (1, MAX_BATCH_HEADS)
    return TileBox(q=(0, length - 1), k=(0, length - 1), params=spec.param_values,
                   sizes={"B": heads, "H": heads, "HKV": heads, "Q_LEN": (1, length), "KV_LEN": (1, length),
                          "D": HEAD_DIMS, "Q_OFFSET": (0, length - 1)},
                   uniform={}, dtypes={i.name: i.dtype for i in spec.inputs})


def postorder(expr: ir.Expr):
    """Every node of an expression, children before parents, without recursion."""
    stack = [(expr, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            yield node
            continue
        stack.append((node, True))
        stack.extend((child, False) for child in reversed(ir.children(node)))


def computes_int(e: ir.Expr, args_int: list[bool]) -> bool:
    """Whether the reference computes node `e` as an int (int64), from whether it computes its children so.

    That is its IR type, except that torch keeps an int ** int an int even where the IR types it
    float (`q ** c`, a param exponent), and so do +, -, *, //, %, min, max, clamp, abs and where
    on what it computes as ints."""
    if isinstance(e, ir.Binary):
        return e.op in ir.ARITHMETIC_OPS and e.op != "div" and all(args_int)
    if isinstance(e, ir.Unary):
        return e.op == "neg" and args_int[0]
    if isinstance(e, ir.Call):
        if e.fn in ("floor", "ceil"):
            return True
        if e.fn == "where":
            return args_int[1] and args_int[2]
        return ir.FUNCTIONS[e.fn][1] == "same" and all(args_int)
    return e.type == "int"


def is_constant(e: ir.Expr) -> bool:
    """Whether an expression is made of literals and params only (known at compile time)."""
    return not any(isinstance(n, (ir.Var, ir.Size, ir.Load, ir.Score)) for n in postorder(e))


def fits(value: Num | Truth, bounds: tuple[int, int] = I64_RANGE) -> bool:
    return isinstance(value, Truth) or (bounds[0] <= value.lo and value.hi <= bounds[1] and not value.nan)


class Ranges:
    """The value of every node over a box, and whether the reference computes it as an int;
    computed once per node object (children first, so nesting costs no recursion)."""

    def __init__(self, box_: TileBox):
        self.box = box_
        self._known: dict[int, tuple[ir.Expr, Num | Truth, bool]] = {}  # id -> (node kept alive, value, int?)

    def _fill(self, expr: ir.Expr) -> None:
        stack = [(expr, False)]
        while stack:
            node, expanded = stack.pop()
            if id(node) in self._known:
                continue
            if not expanded:
                stack.append((node, True))
                stack.extend((child, False) for child in ir.children(node))
                continue
            kids = [self._known[id(c)] for c in ir.children(node)]
            is_int = computes_int(node, [k[2] for k in kids])
            if is_int and isinstance(node, ir.Binary) and node.op == "pow" and kids[1][1].lo < 0:
                # An int to a negative power has no value in the reference (torch raises); the
                # kernels compute the float power the IR types it as.
                is_int = False
            typed = node if not is_int or node.type == "int" else node.model_copy(update={"type": "int"})
            self._known[id(node)] = (node, node_value(typed, [k[1] for k in kids], self.box), is_int)

    def value(self, expr: ir.Expr) -> Num | Truth:
        self._fill(expr)
        return self._known[id(expr)][1]

    def is_int(self, expr: ir.Expr) -> bool:
        self._fill(expr)
        return self._known[id(expr)][2]

    def wide(self, expr: ir.Expr) -> bool:
        """Whether the kernels must compute this int in int64: its range does not fit int32."""
        return self.is_int(expr) and not fits(self.value(expr), I32_RANGE)

    def overflow(self, expr: ir.Expr) -> ir.Expr | None:
        """The innermost int of `expr` whose range does not fit int64, or None."""
        self._fill(expr)
        return next((n for n in postorder(expr) if self._known[id(n)][2] and not fits(self._known[id(n)][1])),
                    None)


def _expressions(spec: ir.Spec) -> list[ir.Expr]:
    return [e for e in (spec.mask, spec.score) if e is not None]


def length_limit(spec: ir.Spec) -> tuple[int, ir.Expr | None]:
    """The longest Q_LEN and KV_LEN at which every int of the mask and score fits int64 (MAX_LENGTH
    when nothing else limits them; 0 when none does), and the innermost expression that limits it.

    Ranges only grow with the lengths, so a bisection finds the limit."""
    def overflow(length: int) -> ir.Expr | None:
        ranges = Ranges(box(spec, length))
        return next((o for o in map(ranges.overflow, _expressions(spec)) if o is not None), None)

    if overflow(MAX_LENGTH) is None:
        return MAX_LENGTH, None
    lo, hi = 0, MAX_LENGTH  # every int fits at lo (0: trivially), some int overflows at hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if overflow(mid) is None:
            lo = mid
        else:
            hi = mid
    return lo, overflow(hi)


# --- loop bounds -----------------------------------------------------------------------------------

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
