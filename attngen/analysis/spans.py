"""Static facts about a spec's mask: which stretch of keys (or queries) a tile may touch, and where it is fully allowed.

A mask atom that is affine in `q` and `k`, or in their floor quotients by constants
(`causal`, windows, prefixes, chunks like `q // c == k // c`, and their `and`/`or`/`not`),
bounds the looped index arithmetically from the other index's tile bounds. The kernels
loop only over the `visit` span and run mask code only outside the `full` span, so
masked-out tiles cost nothing and no mask object exists at run time. An atom that does
not vary along the loop (`k < prefix[b]` while looping over queries) gates the whole
loop on or off for the tile. Anything not understood here stays correct: it is visited and
masked element by element. The spans are exact (no empty tile visited, no full one masked)
for the families the exactness section below proves; `needs_tile_table` hands every other
mask to a tile table, which is exact by construction.
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


def _all_everything(r: Region) -> bool:
    return r.visit == EVERYTHING and r.full == EVERYTHING


# --- exactness ---------------------------------------------------------------------------------
#
# The kernels visit, for a tile of rows y0..y1 (tiles of the other index), the looped tiles that meet
# the span `visit` evaluated for that tile, and run those inside `full` without mask code. `region`
# builds both from the mask's atoms: a bound is evaluated at the tile end where it is extreme
# (`_atom_region`), `and` takes the max of lower bounds and the min of upper ones, `or` the hull. The
# spans are always sound. They are *exact* (for every tile size, every length and every value of what
# the bounds read, the visited tiles are those with an allowed element and the unmasked ones those
# fully allowed) when, for the per-row allowed sets I(y) of the looped index x:
#
#   (E) the union of I(y) over any run of rows is what `visit` computes, and their intersection what
#       `full` computes; clipping to [0, LEN) commutes with both, so only the unclipped sets matter.
#
# `_region` works out a `_Shape` of each sub-mask and proves (E) for three families, conservatively
# (anything else goes to a tile table):
#
# One-sided (`side` upper or lower): I(y) = (-inf, R(y)] (or [L(y), inf)), each bound of the
# conjunction moving with y the same way (`orient`, the sign of the other index's coefficients; a gate
# on y, an atom in y alone, is R jumping from -inf to inf the same way). Then the intervals are nested,
# their union is the one at the end where R is largest and their intersection the one at the other
# end, which is where `_atom_region` evaluates each bound; the min (max) of bounds that move the same
# way moves that way too. Any slope, chunk or staircase qualifies: `2 * q >= k`, `q >> 2 >= k >> 2`.
#
# Unit (`_unit_exact`): a conjunction of bounds on x that are constant (C: `k < prefix[b]`) or of unit
# slope (U: x >= y + a, x <= y + b, from `q - k < w`, `causal`), and gates on y (G: `q >= 3`). Without
# gates L = max of the lower bounds and R = min of the upper ones have integer steps of 0 or 1 (L
# convex, R concave), so a row's set touches the next one's: L(y + 1) <= L(y) + 1 <= R(y) + 1. R - L is
# concave, so the non-empty rows are one run [cs, ce]; a step into it raises R - L, which only a step
# of R with L flat does, and L being convex was flat before too: L is constant up to cs (and R from ce
# on). So over a tile the union is [L(y0), R(y1)] and the intersection [L(y1), R(y0)], exactly what the
# spans compute, and when no row of the tile allows anything, [L(y0), R(y1)] = I(y1) or I(y0) is empty
# too. A pair of unit bounds must leave a band, b - a >= 0, provably (else with b < a every row is
# empty while a tall tile's [y0 + a, y1 + b] is not). A gate y >= g empties the rows below g, where a
# unit lower bound y + a keeps falling: the spans would start at y0 + a, not g + a. So each gate with a
# unit bound on the same side must be a plain `y >= g` (or `y <= g`), and `region` adds the bound it
# implies, x >= g + a: then L(y0) = L(max(y0, g)) and the argument above holds on the gated rows. A
# gate below and one above need g_lo <= g_hi provably (else a tile straddling both opens both).
#
# Diagonal (`_diagonal_exact`): every atom that reads q and k does so with coefficients of opposite signs
# (so each bound is non-decreasing in the other index) and holds on the diagonal q = k at every position
# (`q // c == k // c`, `causal`, `q - k < w`, `(q + 1) // c >= k // c`, `k >= q // 2`). Then L and R do
# not decrease and every row holds its own index: L(y + 1) <= y + 1 <= R(y) + 1, so rows touch and
# the union over a tile is [L(y0), R(y1)], the intersection [L(y1), R(y0)]. Bounds on x alone (C: x >= a,
# x <= b) keep this: with L' = max(L, a) and R' = min(R, b) a row is non-empty where L(y) <= b (a run from
# the start, L not decreasing) and R(y) >= a (a run to the end), so the non-empty rows are one run; two
# neighbours in it touch (L'(y + 1) <= max(R(y) + 1, a) = R(y) + 1, and <= b); the rows before the run are
# empty for R(y) < a, so its first row f has L(f) <= f <= R(f - 1) + 1 <= a and L'(y0) = L'(f) = a (the last
# row likewise), and an empty row in a tile empties [L'(y1), R'(y0)] as it empties the intersection. Plain
# gates on y (G: y >= g, y <= g) empty the rows on one side, a run again; with the bound each implies added
# (`_implied_bound`: the bounds of that side with g for y, which needs g, or through a quotient g and its
# shift, known), a tile straddling g starts at L(g) = L' of the first gated row, as for unit bounds. A gate
# below and one above need g_lo <= g_hi provably.
#
# `or` keeps (E) when both sides are one-sided the same way with no gate at the unbounded end (the
# union of nested families is nested: `k < prefix[b] or causal`), or when one side is a single gate
# and the other one-sided with the gate's orientation (rows past the gate get everything:
# `k < prefix[b] or causal` looping over queries), or a uniform condition (`h < 1 or ...`). `and` of
# such parts keeps it when all are one-sided the same way. Masks outside these (a band or a column,
# `%`, bit tests, inputs read at q or k) get a tile table, which is exact by construction.


@dataclass(frozen=True)
class _Shape:
    """What `_region` knows of a sub-mask's rows, looping over one index: `exact`, whether the spans are
    (see above); `side` 'upper' (only upper bounds on the looped index), 'lower', 'rows' (every row all or
    nothing: gates) or None (both sides); `orient` the common sign of the other index's coefficients (0:
    none read it), None if mixed; `gate`, one gate atom (its spans are gates on both sides); `atoms`, the
    atoms of a conjunction of comparisons; `parts`, the flat conjuncts of a nested `and`."""
    exact: bool
    side: str | None = None
    orient: int | None = None
    gate: bool = False
    atoms: tuple[Affine, ...] | None = None
    parts: tuple = ()


_INEXACT = _Shape(False)
_ALL = _Shape(True, "rows", 0, atoms=())


def _oriented(atom: Affine, loop: str) -> tuple[int, int, Term, Term]:
    """(coefficient of the looped index, of the other one, their Terms) of an atom."""
    return (atom.ck, atom.cq, atom.tk, atom.tq) if loop == "k" else (atom.cq, atom.ck, atom.tq, atom.tk)


def _sign(n: int) -> int:
    return (n > 0) - (n < 0)


def _atoms_shape(atoms: tuple[Affine, ...], loop: str, params) -> _Shape:
    loops = {_sign(_oriented(a, loop)[0]) for a in atoms} - {0}
    others = {_sign(_oriented(a, loop)[1]) for a in atoms} - {0}
    side = "rows" if not loops else "upper" if loops == {-1} else "lower" if loops == {1} else None
    orient = (next(iter(others)) if len(others) == 1 else None) if others else 0
    exact = (side is not None and orient is not None) or _unit_exact(atoms, loop, params) \
        or _diagonal_exact(atoms, loop, params)
    return _Shape(exact, side, orient, gate=len(atoms) == 1 and side == "rows", atoms=atoms)


def _is_plain_gate(atom: Affine, loop: str) -> bool:
    """Whether an atom is a gate `y >= g` or `y <= g` on the other index itself (coefficient +-1)."""
    c_loop, c_other, _, t_other = _oriented(atom, loop)
    return c_loop == 0 and abs(c_other) == 1 and t_other == Term(t_other.var)


def _threshold(gate: Affine, loop: str) -> ir.Expr | None:
    """g of a plain gate y >= g (y + c >= 0) or y <= g (c - y >= 0), as an int expression (None for 0)."""
    return _const_scale(gate.const, -1) if _oriented(gate, loop)[1] > 0 else gate.const


def _unit_bounds(atoms, loop: str):
    """The unit-slope atoms (x - y or y - x with bare indices) split into lower and upper bounds of the
    looped index x, and the gates on y split likewise; None if an atom is none of C, U, G."""
    lowers, uppers, lower_gates, upper_gates = [], [], [], []
    for atom in atoms:
        c_loop, c_other, t_loop, t_other = _oriented(atom, loop)
        if c_other == 0:
            continue  # constant over the tile's rows (C), or uniform
        if c_loop == 0:
            (lower_gates if c_other > 0 else upper_gates).append(atom)
            continue
        if c_loop != -c_other or t_loop != Term(t_loop.var) or t_other != Term(t_other.var):
            return None
        (lowers if c_loop > 0 else uppers).append(atom)
    return lowers, uppers, lower_gates, upper_gates


def _unit_offset(atom: Affine, loop: str, params) -> int | None:
    """a of x >= y + a (a lower unit bound) or b of x <= y + b (an upper one), when it is known."""
    c_loop = _oriented(atom, loop)[0]
    c = _constant(atom.const, params)
    if c is None:
        return None
    return -(c // c_loop) if c_loop > 0 else c // -c_loop  # ceil(-c / s), floor(c / s)


def _band_is_open(lower: Affine, upper: Affine, loop: str, params) -> bool:
    """Whether b - a >= 0 is proven for a lower bound y + a and an upper bound y + b."""
    a, b = _unit_offset(lower, loop, params), _unit_offset(upper, loop, params)
    if a is not None and b is not None:
        return b - a >= 0
    if abs(_oriented(lower, loop)[0]) == 1 and abs(_oriented(upper, loop)[0]) == 1:
        gap = _constant(_const_add(lower.const, upper.const), params)  # b - a = c_upper + c_lower
        return gap is not None and gap >= 0
    return False


def _unit_exact(atoms, loop: str, params) -> bool:
    split = _unit_bounds(atoms, loop)
    if split is None:
        return False
    lowers, uppers, lower_gates, upper_gates = split
    if not all(_band_is_open(lo, hi, loop, params) for lo in lowers for hi in uppers):
        return False
    if (lowers and not all(_is_plain_gate(g, loop) for g in lower_gates)) or \
            (uppers and not all(_is_plain_gate(g, loop) for g in upper_gates)):
        return False
    return _gates_in_order(lower_gates, upper_gates, loop, params)


def _gates_in_order(lower_gates, upper_gates, loop: str, params) -> bool:
    """Whether each gate below (y >= g_lo) and each gate above (y <= g_hi) are plain gates with g_lo <= g_hi
    proven: else every row is empty while a tile straddling both opens both."""
    for g_lo in lower_gates:
        for g_hi in upper_gates:
            if not (_is_plain_gate(g_lo, loop) and _is_plain_gate(g_hi, loop)):
                return False
            gap = _constant(_const_add(_threshold(g_hi, loop), _threshold(g_lo, loop), -1), params)
            if gap is None or gap < 0:
                return False
    return True


def _implied_bound(gate: Affine, atom: Affine, loop: str, params) -> Affine | None:
    """For a plain gate y >= g (y <= g) and a bound on the looped index x that does not fall as y grows (the
    indices' coefficients of opposite signs: x >= y + a, `k // c >= q // c`) on the same side (a lower bound
    for a lower gate), the bound on x alone that they imply: the atom with g for y, which the gate makes the
    extreme row. None where g cannot go in: the atom reads y in a quotient (or shifted) and g or the shift
    is not a known int."""
    c_loop, c_other, t_loop, t_other = _oriented(atom, loop)
    g = _threshold(gate, loop)
    if t_other == Term(t_other.var):
        const = _const_add(atom.const, _const_scale(g, c_other))
    else:
        known = [_constant(e, params) for e in (g, t_other.offset)]
        if None in known:
            return None
        const = _const_add(atom.const, _int(c_other * ((known[0] + known[1]) // t_other.div)))
    return Affine(0, c_loop, const, tk=t_loop) if loop == "k" else Affine(c_loop, 0, const, tq=t_loop)


def _gated_pairs(atoms, loop: str):
    """(gate, bound) for each plain gate on y and each bound on x of the same side whose coefficients of x
    and y have opposite signs (_implied_bound's pairs)."""
    for gate in atoms:
        if not _is_plain_gate(gate, loop):
            continue
        lower = _oriented(gate, loop)[1] > 0
        for atom in atoms:
            c_loop, c_other = _oriented(atom, loop)[:2]
            if c_loop * c_other < 0 and (c_loop > 0) == lower:
                yield gate, atom


def _implied_bounds(atoms, loop: str, params) -> list[Affine]:
    """The bounds _implied_bound derives from the conjunction's gates and bounds: with them the spans of a
    tile that straddles a gate start at the gated rows' bound (_unit_exact, _diagonal_exact). Each is
    implied by the conjunction, so adding them is sound for any mask."""
    implied = (_implied_bound(gate, atom, loop, params) for gate, atom in _gated_pairs(atoms, loop))
    return [bound for bound in implied if bound is not None]


# The longest period `_diagonal_exact` checks position by position.
_DIAGONAL_PERIOD = 1 << 12


def _diagonal_exact(atoms, loop: str, params) -> bool:
    """Whether every atom that reads both q and k bounds each by a non-decreasing function of the other (q and
    k with coefficients of opposite signs) and holds on the diagonal q = k at every position y >= 0, the
    others being uniform, bounds on the looped index alone (C) or plain gates on the other one (G) whose
    implied bounds can be written (_implied_bound), a gate below and one above provably in order. On the
    diagonal an atom is f(y) = cq * floor((y + oq) / dq) + ck * floor((y + ok) / dk) + c, with known ints:
    f(y + P) = f(y) + P * (cq / dq + ck / dk) for the period P = lcm(dq, dk), so f stays >= 0 for every
    y >= 0 exactly when that trend is >= 0 and f >= 0 on the first period."""
    gates = {"lower": [], "upper": []}
    for atom in atoms:
        c_loop, c_other = _oriented(atom, loop)[:2]
        if c_other == 0:
            continue  # uniform, or a bound on the looped index alone
        if c_loop == 0:
            if not _is_plain_gate(atom, loop):
                return False
            gates["lower" if c_other > 0 else "upper"].append(atom)
            continue
        if atom.cq * atom.ck >= 0:
            return False
        known = [_constant(e, params) for e in (atom.const, atom.tq.offset, atom.tk.offset)]
        if None in known:
            return False
        c, oq, ok = known
        dq, dk = atom.tq.div, atom.tk.div
        period = math.lcm(dq, dk)
        if period > _DIAGONAL_PERIOD or atom.cq * dk + atom.ck * dq < 0:  # the trend's sign
            return False
        if any(atom.cq * ((y + oq) // dq) + atom.ck * ((y + ok) // dk) + c < 0 for y in range(period)):
            return False
    if any(_implied_bound(gate, atom, loop, params) is None for gate, atom in _gated_pairs(atoms, loop)):
        return False
    return _gates_in_order(gates["lower"], gates["upper"], loop, params)


def _conjunction_shape(parts: tuple[_Shape, ...], loop: str, params) -> _Shape:
    """The shape of the conjunction of `parts` (flat: none is an `and`)."""
    if all(p.atoms is not None for p in parts):
        return _atoms_shape(tuple(a for p in parts for a in p.atoms), loop, params)
    if not all(p.exact for p in parts):
        return _INEXACT
    sides = {p.side for p in parts} - {"rows"}
    orients = {p.orient for p in parts} - {0}
    if None in sides or len(sides) > 1 or None in orients or len(orients) > 1:
        return _INEXACT
    return _Shape(True, next(iter(sides)) if sides else "rows", next(iter(orients)) if orients else 0)


def _free(r: Region, side: str) -> bool:
    """Whether the spans are unbounded at the end opposite `side` (where `_union_inside` takes the hull)."""
    end = "lo" if side == "upper" else "hi"
    return r.full is not None and getattr(r.visit, end) is None and getattr(r.full, end) is None


def _or_shape(a: Region, sa: _Shape, b: Region, sb: _Shape) -> _Shape:
    if a.visit is None:
        return sb
    if b.visit is None:
        return sa
    if (_all_everything(a) and sa.exact) or (_all_everything(b) and sb.exact):
        return _ALL
    if not (sa.exact and sb.exact):
        return _INEXACT
    for gate, other in ((sa, sb), (sb, sa)):
        if gate.gate:
            if gate.orient == 0:
                return _Shape(True, other.side, other.orient)
            if other.gate:  # gates the same way nest; opposite ones can cover a tile's rows together
                return _Shape(True) if other.orient == gate.orient else _INEXACT
            if other.side in ("upper", "lower") and other.orient in (gate.orient, 0):
                return _Shape(True, other.side, gate.orient)
            return _INEXACT
    if sa.side == sb.side and sa.side in ("upper", "lower") and _free(a, sa.side) and _free(b, sb.side):
        orients = {sa.orient, sb.orient} - {0}
        if len(orients) <= 1:
            return _Shape(True, sa.side, next(iter(orients)) if orients else 0)
    return _INEXACT


def _region(mask: ir.Expr | None, loop: str, params, inner: bool = False) -> tuple[Region, _Shape]:
    """`region` and the shape of `mask`; `inner`: an `and` below another `and`, whose shape the outermost
    one works out from all their conjuncts at once (so its implied bounds are added once, there)."""
    if mask is None:
        return Region(EVERYTHING, EVERYTHING), _ALL
    if isinstance(mask, ir.Const):
        return (Region(EVERYTHING, EVERYTHING), _ALL) if mask.value else (Region(None, None), _Shape(True, atoms=()))
    if isinstance(mask, ir.Binary) and mask.op == "and":
        (a, sa), (b, sb) = _region(mask.left, loop, params, True), _region(mask.right, loop, params, True)
        visit, full = _intersect(a.visit, b.visit), _intersect(a.full, b.full)
        parts = (sa.parts or (sa,)) + (sb.parts or (sb,))
        if inner:
            return Region(visit, full), _Shape(False, parts=parts)
        shape = _conjunction_shape(parts, loop, params)
        if shape.atoms is not None:
            for atom in _implied_bounds(shape.atoms, loop, params):
                r = _atom_region(atom, loop)
                visit, full = _intersect(visit, r.visit), _intersect(full, r.full)
        return Region(visit, full, shape.exact or visit is None), shape
    if isinstance(mask, ir.Binary) and mask.op == "or":
        (a, sa), (b, sb) = _region(mask.left, loop, params), _region(mask.right, loop, params)
        full = a.full if b.full is None else b.full if a.full is None else _union_inside(a.full, b.full)
        shape = _or_shape(a, sa, b, sb)
        return Region(_hull(a.visit, b.visit), full, shape.exact), shape
    if isinstance(mask, ir.Unary) and mask.op == "not":
        pushed = _negate(mask.operand)
        if pushed is not None:
            return _region(pushed, loop, params, inner)
        return Region(EVERYTHING, None, False), _INEXACT
    atoms = atoms_ge_zero(mask, params)
    if atoms is None:
        return Region(EVERYTHING, None, False), _INEXACT
    result = Region(EVERYTHING, EVERYTHING)
    for atom in atoms:
        r = _atom_region(atom, loop)
        result = Region(_intersect(result.visit, r.visit), _intersect(result.full, r.full))
    shape = _atoms_shape(tuple(atoms), loop, params)
    return Region(result.visit, result.full, shape.exact), shape


def _untranslated(mask: ir.Expr, params) -> ir.Expr | None:
    """The mask with `q + A` read as `q` and `k + B` as `k`, where it reads q only as q + A and k only as k + B,
    A and B one uniform expression each, provably >= 0 (a block of a sequence at its global positions:
    frontend.positions); None where it reads them otherwise, bare, or shifted by what may be negative.

    Exactness survives the translation: the translated mask's rows are I'(y) = I(y + A) - B, its spans are
    evaluated by the same atoms at the translated tile ends, a run of its rows is a run of the original's
    (at y >= 0, where the proofs hold, as A >= 0 keeps them), and clipping to any interval commutes with the
    union and the intersection of intervals. So the translated mask's spans are exact where the original's
    are, though its atoms' constants (A - B, which the proofs cannot evaluate) hide it."""
    box = intervals.TileBox((0, 0), (0, 0), params, {}, {})
    shifts: dict[str, set[str]] = {"q": set(), "k": set()}
    shifted = {"q": 0, "k": 0}
    for node in ir.walk(mask):
        name = _shifted_index(node)
        if name is None:
            continue
        shift = intervals.value(node.right, box)
        if not isinstance(shift, intervals.Num) or not shift.lo >= 0:
            return None  # the proofs hold at positions y >= 0: a shift must keep them there
        shifts[name].add(node.right.model_dump_json())
        shifted[name] += 1
    reads = {name: sum(isinstance(n, ir.Var) and n.name == name for n in ir.walk(mask)) for name in shifts}
    if not any(shifted.values()) or any(len(s) > 1 or shifted[n] != reads[n] for n, s in shifts.items()):
        return None
    return ir.rewrite(mask, lambda node: node.left if _shifted_index(node) is not None else None)


def _shifted_index(node: ir.Expr) -> str | None:
    """"q" or "k" where `node` is that index plus an expression that reads neither (`q + A`), else None."""
    if isinstance(node, ir.Binary) and node.op == "add" and isinstance(node.left, ir.Var) \
            and node.left.name in ("q", "k") and not _mentions_qk(node.right):
        return node.left.name
    return None


def region(mask: ir.Expr | None, loop: str, params: dict[str, int | float]) -> Region:
    """Which indices along `loop` a tile of the other index visits, and which are full; `exact` when the
    spans are provably the allowed tiles' (the section above), or those of the mask it translates."""
    found = _region(mask, loop, params)[0]
    if not found.exact and mask is not None and (plain := _untranslated(mask, params)) is not None:
        return Region(found.visit, found.full, _region(plain, loop, params)[0].exact)
    return found


def mask_inputs(spec: ir.Spec) -> tuple[str, ...]:
    """The inputs the mask reads, in declaration order (a tile table is keyed on them)."""
    return tuple(i.name for i in spec.inputs if ir.uses(spec.mask, ir.Load, i.name))


def regions(mask: ir.Expr | None, params: dict[str, int | float]) -> dict[str, Region]:
    """The region of each loop: 'k' (keys for one query tile), 'q' (queries for one key tile)."""
    return {loop: region(mask, loop, params) for loop in ("k", "q")}


def needs_tile_table(mask: ir.Expr | None, params: dict[str, int | float],
                     known: Mapping[str, Region] | None = None) -> bool:
    """Whether the kernels should follow a tile table rather than the closed-form spans: the spans are
    not proven exact for some loop (the exactness section: the mask reads an input at q or k, as
    documents and block layouts do; it is not affine, like `q % 2 == 0`; it is the `or` of a band and a
    column, or of two disjoint bands, whose hull would visit the gap).
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
