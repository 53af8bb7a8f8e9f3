"""Static facts about a spec's mask: which stretch of keys (or queries) a tile may touch, and where it is fully allowed.

A mask atom that is affine in `q` and `k`, or in their floor quotients by constants
(`causal`, windows, prefixes, chunks like `q // c == k // c`, and their `and`/`or`/`not`),
bounds the looped index arithmetically from the other index's tile bounds. The kernels
loop only over the `visit` span and run mask code only outside the `full` span, so
masked-out tiles cost nothing and no mask object exists at run time. An atom that does
not vary along the loop (`k < prefix[b]` while looping over queries) gates the whole
loop on or off for the tile. Anything not understood here stays exact: it is visited and
masked element by element; `needs_tile_table` then hands the mask to a tile table built
at call time, which is exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Mapping

from attngen import intervals, ir

# A gate's sentinels: far outside any sequence, so a closed gate empties a span and an open one
# leaves the other side of a min/max in charge. Kernels clamp bounds to [0, LEN] afterwards.
OPEN_LO, CLOSED_LO = -(1 << 30), 1 << 30
OPEN_HI, CLOSED_HI = 1 << 30, -(1 << 30)


@dataclass(frozen=True)
class Term:
    """floor((var + offset) / div): an index, or its quotient by a positive constant (chunks)."""
    var: str  # "q" or "k"
    div: int = 1
    offset: ir.Expr | None = None  # uniform over a tile


@dataclass(frozen=True)
class Affine:
    """cq * Tq + ck * Tk + const; Tq and Tk are Terms of q and k (or absent when their
    coefficient is 0), const an int expression uniform over a tile (None for 0)."""
    cq: int
    ck: int
    const: ir.Expr | None = None
    tq: Term = Term("q")
    tk: Term = Term("k")


@dataclass(frozen=True)
class Linear:
    """out_scale * round((coef * floor((var + var_offset) / var_div) + const) / den) + out_offset,
    var one of q0 q1 k0 k1 (a tile's first and last index)."""
    coef: int
    var: str
    const: ir.Expr | None
    den: int
    round: str  # "floor" or "ceil"
    var_div: int = 1
    var_offset: ir.Expr | None = None
    out_scale: int = 1
    out_offset: ir.Expr | None = None


@dataclass(frozen=True)
class Gate:
    """Unbounded on its side while `cond >= 0` holds for the tile, else a bound that empties the
    span (OPEN_* and CLOSED_* above)."""
    cond: Linear
    side: str  # "lo" or "hi"


@dataclass(frozen=True)
class Extremum:
    op: str  # "min" or "max"
    terms: tuple


Bound = Linear | Gate | Extremum | None  # None: unbounded on that side


@dataclass(frozen=True)
class Span:
    """An inclusive interval lo..hi of the looped index; a None side is unbounded."""
    lo: Bound
    hi: Bound


EVERYTHING = Span(None, None)


@dataclass(frozen=True)
class Region:
    """For one tile of the other index: `visit` covers every allowed element (None: none at all),
    `full` lies where every element is allowed (None: nowhere)."""
    visit: Span | None
    full: Span | None
    exact: bool = True  # visit holds only tiles with an allowed element, full every full tile's span


def _const_add(a: ir.Expr | None, b: ir.Expr | None, sign: int = 1) -> ir.Expr | None:
    if b is None:
        return a
    if sign < 0:
        b = ir.Unary(type="int", op="neg", operand=b)
    if a is None:
        return b
    return ir.Binary(type="int", op="add", left=a, right=b)


def _const_scale(a: ir.Expr | None, factor: int) -> ir.Expr | None:
    if a is None or factor == 1:
        return a
    if factor == 0:
        return None
    return ir.Binary(type="int", op="mul", left=ir.Const(type="int", value=factor), right=a)


def _int(value: int) -> ir.Expr | None:
    return None if value == 0 else ir.Const(type="int", value=value)


def _mentions_qk(expr: ir.Expr) -> bool:
    return any(isinstance(n, ir.Var) and n.name in ("q", "k") for n in ir.walk(expr))


def _combine(a: Affine, b: Affine, s: int) -> Affine | None:
    """a + s * b, when both use the same Term of each index they share."""
    if (a.cq and b.cq and a.tq != b.tq) or (a.ck and b.ck and a.tk != b.tk):
        return None
    return Affine(a.cq + s * b.cq, a.ck + s * b.ck, _const_add(a.const, b.const, s),
                  a.tq if a.cq else b.tq, a.tk if a.ck else b.tk)


def affine(expr: ir.Expr, params: dict[str, int | float]) -> Affine | None:
    """The affine form of an int expression in q and k (or their floor quotients), or None."""
    if expr.type != "int":
        return None
    if isinstance(expr, ir.Var) and expr.name == "q":
        return Affine(1, 0)
    if isinstance(expr, ir.Var) and expr.name == "k":
        return Affine(0, 1)
    if not _mentions_qk(expr):
        return Affine(0, 0, expr)
    if isinstance(expr, ir.Unary) and expr.op == "neg":
        a = affine(expr.operand, params)
        return None if a is None else Affine(-a.cq, -a.ck, _const_scale(a.const, -1), a.tq, a.tk)
    if isinstance(expr, ir.Binary) and expr.op in ("add", "sub"):
        a, b = affine(expr.left, params), affine(expr.right, params)
        if a is None or b is None:
            return None
        return _combine(a, b, 1 if expr.op == "add" else -1)
    if isinstance(expr, ir.Binary) and expr.op == "mul":
        for left, right in ((expr.left, expr.right), (expr.right, expr.left)):
            factor = _known_int(left, params)
            inner = affine(right, params)
            if factor is not None and inner is not None:
                return Affine(factor * inner.cq, factor * inner.ck, _const_scale(inner.const, factor),
                              inner.tq, inner.tk)
    if isinstance(expr, ir.Binary) and expr.op in ("floordiv", "rshift"):
        # (x + offset) // d, with x a bare index and d a positive constant: a chunk number; x >> n is
        # x // 2**n exactly (both floor), for the counts whose divisor the bounds' int64 holds easily.
        d = _known_int(expr.right, params)
        if expr.op == "rshift":
            d = 2 ** d if d is not None and 0 <= d <= 30 else None
        inner = affine(expr.left, params)
        if d is None or d <= 0 or inner is None:
            return None
        for var, coef, term in (("q", inner.cq, inner.tq), ("k", inner.ck, inner.tk)):
            other = inner.ck if var == "q" else inner.cq
            if coef == 1 and other == 0 and term.div == 1:
                t = Term(var, d, inner.const)
                return Affine(1, 0, None, tq=t) if var == "q" else Affine(0, 1, None, tk=t)
    return None


def _known_int(expr: ir.Expr, params: dict[str, int | float]) -> int | None:
    """The value of an int expression made of literals and params, if it is one."""
    if isinstance(expr, ir.Const) and expr.type == "int":
        return int(expr.value)
    if isinstance(expr, ir.Param) and expr.type == "int":
        return int(params[expr.name])
    if isinstance(expr, ir.Unary) and expr.op == "neg":
        v = _known_int(expr.operand, params)
        return None if v is None else -v
    return None


def atoms_ge_zero(expr: ir.Expr, params) -> list[Affine] | None:
    """A comparison as a conjunction of `affine >= 0` atoms (ints only), or None."""
    if not (isinstance(expr, ir.Binary) and expr.op in ("lt", "le", "gt", "ge", "eq")):
        return None
    a, b = affine(expr.left, params), affine(expr.right, params)
    if a is None or b is None:
        return None
    diff = _combine(a, b, -1)  # left - right
    if diff is None:
        return None
    negd = Affine(-diff.cq, -diff.ck, _const_scale(diff.const, -1), diff.tq, diff.tk)
    minus_one = ir.Const(type="int", value=-1)
    if expr.op == "ge":
        return [diff]
    if expr.op == "le":
        return [negd]
    if expr.op == "gt":  # left - right - 1 >= 0
        return [Affine(diff.cq, diff.ck, _const_add(diff.const, minus_one), diff.tq, diff.tk)]
    if expr.op == "lt":
        return [Affine(negd.cq, negd.ck, _const_add(negd.const, minus_one), negd.tq, negd.tk)]
    return [diff, negd]  # eq


def _negate(expr: ir.Expr) -> ir.Expr | None:
    """`not expr` pushed one level down, for comparisons; None when not possible."""
    flip = {"lt": "ge", "le": "gt", "gt": "le", "ge": "lt"}
    if isinstance(expr, ir.Binary) and expr.op in flip:
        return expr.model_copy(update={"op": flip[expr.op]})
    if isinstance(expr, ir.Binary) and expr.op in ("and", "or"):
        return ir.Binary(type="bool", op="or" if expr.op == "and" else "and",
                         left=ir.Unary(type="bool", op="not", operand=expr.left),
                         right=ir.Unary(type="bool", op="not", operand=expr.right))
    if isinstance(expr, ir.Unary) and expr.op == "not":
        return expr.operand
    if isinstance(expr, ir.Const) and expr.type == "bool":
        return expr.model_copy(update={"value": not expr.value})
    return None


def _atom_region(atom: Affine, loop: str) -> Region:
    """The region of one `cq*Tq + ck*Tk + c >= 0` atom, looping over `loop` ('k' or 'q')."""
    other = "q" if loop == "k" else "k"
    c_loop, t_loop = (atom.ck, atom.tk) if loop == "k" else (atom.cq, atom.tq)
    c_other, t_other = (atom.cq, atom.tq) if loop == "k" else (atom.ck, atom.tk)
    lo_var, hi_var = f"{other}0", f"{other}1"
    # The other index enters through a non-decreasing Term, so c_other*T(y) is extreme at a tile end.
    # Some y of the tile allows x (visit): y maximising c_other*T(y); every y allows x (full): y minimising it.
    y_some = hi_var if c_other > 0 else lo_var
    y_all = lo_var if c_other > 0 else hi_var
    if c_loop == 0:  # uniform along the loop: the tile either allows the whole loop or none of it
        def gated(y: str) -> Span:
            cond = Linear(c_other, y, atom.const, 1, "floor", t_other.div, t_other.offset)
            return Span(Gate(cond, "lo"), Gate(cond, "hi"))
        return Region(gated(y_some), gated(y_all))
    neg_c = _const_scale(atom.const, -1)
    d, off = t_loop.div, t_loop.offset
    # c_loop * T(x) >= -c - c_other * T(y), then T(x) >= m  <=>  x >= d*m - off,
    # and T(x) <= m  <=>  x <= d*m + d - 1 - off.
    if c_loop > 0:  # T(x) >= ceil((-c - c_other*T(y)) / c_loop)
        def lower(y: str) -> Linear:
            return Linear(-c_other, y, neg_c, c_loop, "ceil", t_other.div, t_other.offset,
                          d, _const_scale(off, -1))
        return Region(Span(lower(y_some), None), Span(lower(y_all), None))

    def upper(y: str) -> Linear:  # T(x) <= floor((c + c_other*T(y)) / -c_loop)
        return Linear(c_other, y, atom.const, -c_loop, "floor", t_other.div, t_other.offset,
                      d, _const_add(_int(d - 1), off, -1))
    return Region(Span(None, upper(y_some)), Span(None, upper(y_all)))


def _extremum(op: str, a: Bound, b: Bound, absent_wins: bool) -> Bound:
    if a is None or b is None:
        return None if absent_wins else (b if a is None else a)
    return Extremum(op, (a, b))


def _intersect(a: Span | None, b: Span | None) -> Span | None:
    if a is None or b is None:
        return None
    return Span(_extremum("max", a.lo, b.lo, False), _extremum("min", a.hi, b.hi, False))


def _hull(a: Span | None, b: Span | None) -> Span | None:
    """The smallest span holding both (a superset of the union)."""
    if a is None:
        return b
    if b is None:
        return a
    return Span(_extremum("min", a.lo, b.lo, True), _extremum("max", a.hi, b.hi, True))


def _all_or_nothing(s: Span) -> bool:
    return isinstance(s.lo, Gate) and isinstance(s.hi, Gate)


def _union_inside(a: Span, b: Span) -> Span:
    """A span inside the union of two full spans. The hull is exact when one side is everything
    or nothing (a gate), or when both are unbounded on the same side (`k < prefix or causal`);
    otherwise keep the first."""
    if _all_or_nothing(a) or _all_or_nothing(b):
        return _hull(a, b)
    if a.lo is None and b.lo is None:
        return Span(None, _extremum("max", a.hi, b.hi, True))
    if a.hi is None and b.hi is None:
        return Span(_extremum("min", a.lo, b.lo, True), None)
    return a


def _hull_is_union(a: Span | None, b: Span | None) -> bool:
    """Whether the hull of two visit spans adds nothing: one is empty, everything or all-or-nothing,
    or both are unbounded on the same side (so they overlap)."""
    if a is None or b is None or a == EVERYTHING or b == EVERYTHING:
        return True
    if _all_or_nothing(a) or _all_or_nothing(b):
        return True
    return (a.lo is None and b.lo is None) or (a.hi is None and b.hi is None)


def region(mask: ir.Expr | None, loop: str, params: dict[str, int | float]) -> Region:
    """Which indices along `loop` a tile of the other index visits, and which are full."""
    if mask is None:
        return Region(EVERYTHING, EVERYTHING)
    if isinstance(mask, ir.Const):
        return Region(EVERYTHING, EVERYTHING) if mask.value else Region(None, None)
    if isinstance(mask, ir.Binary) and mask.op == "and":
        a, b = region(mask.left, loop, params), region(mask.right, loop, params)
        return Region(_intersect(a.visit, b.visit), _intersect(a.full, b.full), a.exact and b.exact)
    if isinstance(mask, ir.Binary) and mask.op == "or":
        a, b = region(mask.left, loop, params), region(mask.right, loop, params)
        full = a.full if b.full is None else b.full if a.full is None else _union_inside(a.full, b.full)
        exact = a.exact and b.exact and _hull_is_union(a.visit, b.visit) and (
            a.full is None or b.full is None or _hull_is_union(a.full, b.full))
        return Region(_hull(a.visit, b.visit), full, exact)
    if isinstance(mask, ir.Unary) and mask.op == "not":
        pushed = _negate(mask.operand)
        return region(pushed, loop, params) if pushed is not None else Region(EVERYTHING, None, False)
    atoms = atoms_ge_zero(mask, params)
    if atoms is None:
        return Region(EVERYTHING, None, False)
    result = Region(EVERYTHING, EVERYTHING)
    for atom in atoms:
        r = _atom_region(atom, loop)
        result = Region(_intersect(result.visit, r.visit), _intersect(result.full, r.full))
    return result


def mask_inputs(spec: ir.Spec) -> tuple[str, ...]:
    """The inputs the mask reads, in declaration order (a tile table is keyed on them)."""
    return tuple(i.name for i in spec.inputs if ir.uses(spec.mask, ir.Load, i.name))


def regions(mask: ir.Expr | None, params: dict[str, int | float]) -> dict[str, Region]:
    """The region of each loop: 'k' (keys for one query tile), 'q' (queries for one key tile)."""
    return {loop: region(mask, loop, params) for loop in ("k", "q")}


def needs_tile_table(mask: ir.Expr | None, params: dict[str, int | float],
                     known: Mapping[str, Region] | None = None) -> bool:
    """Whether the kernels should follow a tile table built at call time rather than the closed-form
    spans: the mask has a part that varies over a tile in a way `region` cannot bound exactly (it
    reads an input at q or k, as documents and block layouts do; it is not affine, like
    `q % 2 == 0`; or it is the `or` of two disjoint bands, whose hull would visit the gap).
    `known`: the mask's `regions`, when the caller has them."""
    return not all(r.exact for r in (known or regions(mask, params)).values())


# A block layout constant on aligned blocks at least this long is coarse: tiles rarely split a block.
COARSE_BLOCK = 64
NARROW_TEXT = ("each query tile sees a band of keys of constant width, or the mask is decided element "
               "by element from inputs, so most visited tiles are partial: smaller starting tiles")
DENSE_TEXT = (f"most visited tiles are full (no band of constant width; inputs at q or k, if any, are read "
              f"in blocks at least {COARSE_BLOCK} long): large starting tiles")


def is_narrow(mask: ir.Expr | None, params: dict[str, int | float],
              known: Mapping[str, Region] | None = None, steps: Mapping[str, int | None] | None = None) -> bool:
    """Whether most visited tiles are partial, so small tiles waste less: each query tile sees only a
    band of keys of constant width (windows, chunks), or the mask is decided element by element from
    inputs (documents). Dense masks (none, causal, prefix-LM, coarse block layouts) want large tiles.
    `known`, `steps`: the mask's `regions` and `block_steps`, when the caller has them."""
    if mask is None:
        return False
    known = known or regions(mask, params)
    if needs_tile_table(mask, params, known):
        steps = steps if steps is not None else block_steps(mask, params)
        return any(step is not None and step < COARSE_BLOCK for step in steps.values())
    span = known["k"].visit
    return span is not None and bool(_slopes(span.lo, "lo") & _slopes(span.hi, "hi"))


def _slopes(bound: Bound, side: str) -> set[Fraction]:
    """How fast each bound that holds on this side moves with the query tile (keys per query). A lo
    (hi) bound that is the max (min) of terms holds for each term; other forms give no slope."""
    if isinstance(bound, Linear):
        return {Fraction(bound.coef * bound.out_scale, bound.den * bound.var_div)} if bound.coef else set()
    if isinstance(bound, Extremum) and bound.op == ("max" if side == "lo" else "min"):
        return set().union(*(_slopes(t, side) for t in bound.terms))
    return set()


def block_steps(mask: ir.Expr | None, params: dict[str, int | float]) -> dict[str, int | None]:
    """For q and k: d >= 1 when the mask reads that index only as `index // d'` with constants d' that
    d divides (so it is constant on aligned blocks of d, as block layouts are); None when it does not
    read it at all; 0 when it reads it otherwise. A tile-table kernel then needs one point per block."""
    divisors: dict[str, list[int]] = {"q": [], "k": []}
    broken: set[str] = set()

    def visit(node: ir.Expr) -> None:
        if isinstance(node, ir.Binary) and node.op == "floordiv" and isinstance(node.left, ir.Var) \
                and node.left.name in divisors:
            d = _known_int(node.right, params)
            if d is not None and d > 0:
                divisors[node.left.name].append(d)
                visit(node.right)
                return
        if isinstance(node, ir.Var) and node.name in divisors:
            broken.add(node.name)
        for child in ir.children(node):
            visit(child)

    if mask is not None:
        visit(mask)
    return {name: 0 if name in broken else (math.gcd(*ds) if ds else None) for name, ds in divisors.items()}


def _constant(expr: ir.Expr | None, params: Mapping[str, int | float]) -> int | None:
    """An atom's constant, when its interval is one int (it reads no size, input or head)."""
    if expr is None:
        return 0
    box = intervals.TileBox((0, 0), (0, 0), params, {}, {})
    v = intervals.value(expr, box)
    return int(v.lo) if isinstance(v, intervals.Num) and v.lo == v.hi and not v.is_float else None


def _conjuncts(mask: ir.Expr) -> list[ir.Expr]:
    """The terms of a conjunction, `not` pushed down where it can be."""
    if isinstance(mask, ir.Binary) and mask.op == "and":
        return _conjuncts(mask.left) + _conjuncts(mask.right)
    if isinstance(mask, ir.Unary) and mask.op == "not":
        pushed = _negate(mask.operand)
        if pushed is not None:
            return _conjuncts(pushed)
    return [mask]


def allows_nothing(mask: ir.Expr | None, params: Mapping[str, int | float]) -> bool:
    """Whether no query is allowed any key, at every length and position: proven over the mask's
    affine comparisons of q and k with constant offsets (others are dropped, which only widens the
    allowed set), by Fourier-Motzkin elimination of k over q, k >= 0, each inequality first tightened
    to its integer points. False means not proven, not that some key is allowed."""
    if mask is None:
        return False
    if isinstance(mask, ir.Const):
        return not mask.value
    if isinstance(mask, ir.Binary) and mask.op == "or":
        return allows_nothing(mask.left, params) and allows_nothing(mask.right, params)
    rows = [(1, 0, 0), (0, 1, 0)]  # a*q + b*k + c >= 0
    for term in _conjuncts(mask):
        if isinstance(term, ir.Const) or (isinstance(term, ir.Binary) and term.op == "or"):
            if allows_nothing(term, params):
                return True
            continue
        for atom in atoms_ge_zero(term, params) or []:
            c = _constant(atom.const, params)
            if c is not None and atom.tq == Term("q") and atom.tk == Term("k"):
                rows.append((atom.cq, atom.ck, c))
    return not _feasible(rows)


def _tight(a: int, b: int, c: int) -> tuple[int, int, int]:
    g = math.gcd(a, b)
    return (a // g, b // g, c // g) if g else (0, 0, c)


def _feasible(rows: list[tuple[int, int, int]]) -> bool:
    """Whether integers q, k satisfy every a*q + b*k + c >= 0 (False only when proven not)."""
    rows = [_tight(*r) for r in rows]
    up, down = [r for r in rows if r[1] > 0], [r for r in rows if r[1] < 0]
    q_rows = [r for r in rows if r[1] == 0]
    q_rows += [_tight(a1 * -b2 + a2 * b1, 0, c1 * -b2 + c2 * b1) for a1, b1, c1 in up for a2, b2, c2 in down]
    lo, hi = -math.inf, math.inf
    for a, _, c in q_rows:
        if a == 0 and c < 0:
            return False
        if a > 0:
            lo = max(lo, -(c // a))  # q >= ceil(-c / a)
        elif a < 0:
            hi = min(hi, c // -a)  # q <= floor(c / -a)
    return lo <= hi
