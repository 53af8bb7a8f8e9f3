"""Static facts about a spec's mask: which stretch of keys (or queries) a tile may touch, and where it is fully allowed.

A mask atom that is affine in `q` and `k` (`causal`, windows, prefixes, and their
`and`/`or`/`not`) bounds the looped index arithmetically from the other index's tile
bounds. The kernels loop only over the `visit` span and run mask code only outside
the `full` span, so masked-out tiles cost nothing. Anything not understood here
stays exact: it is visited and masked element by element.
"""

from __future__ import annotations

from dataclasses import dataclass

from attngen import ir

UNIFORM_VARS = ("b", "h", "hkv")  # constant over a tile: fine inside an affine constant


@dataclass(frozen=True)
class Affine:
    """cq * q + ck * k + const, with const an int expression uniform over a tile (or None for 0)."""
    cq: int
    ck: int
    const: ir.Expr | None = None


@dataclass(frozen=True)
class Linear:
    """round((coef * var + const) / den), var one of q0 q1 k0 k1 (a tile's first and last index)."""
    coef: int
    var: str
    const: ir.Expr | None
    den: int
    round: str  # "floor" or "ceil"


@dataclass(frozen=True)
class Extremum:
    op: str  # "min" or "max"
    terms: tuple


Bound = Linear | Extremum | None  # None: unbounded on that side


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


def _mentions_qk(expr: ir.Expr) -> bool:
    return any(isinstance(n, ir.Var) and n.name in ("q", "k") for n in ir.walk(expr))


def affine(expr: ir.Expr, params: dict[str, int | float]) -> Affine | None:
    """The affine form of an int expression in q and k, or None if it is not affine."""
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
        return None if a is None else Affine(-a.cq, -a.ck, _const_scale(a.const, -1))
    if isinstance(expr, ir.Binary) and expr.op in ("add", "sub"):
        a, b = affine(expr.left, params), affine(expr.right, params)
        if a is None or b is None:
            return None
        s = 1 if expr.op == "add" else -1
        return Affine(a.cq + s * b.cq, a.ck + s * b.ck, _const_add(a.const, b.const, s))
    if isinstance(expr, ir.Binary) and expr.op == "mul":
        for left, right in ((expr.left, expr.right), (expr.right, expr.left)):
            factor = _known_int(left, params)
            inner = affine(right, params)
            if factor is not None and inner is not None:
                return Affine(factor * inner.cq, factor * inner.ck, _const_scale(inner.const, factor))
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
    diff = Affine(a.cq - b.cq, a.ck - b.ck, _const_add(a.const, b.const, -1))  # left - right
    negd = Affine(-diff.cq, -diff.ck, _const_scale(diff.const, -1))
    minus_one = ir.Const(type="int", value=-1)
    if expr.op == "ge":
        return [diff]
    if expr.op == "le":
        return [negd]
    if expr.op == "gt":  # left - right - 1 >= 0
        return [Affine(diff.cq, diff.ck, _const_add(diff.const, minus_one))]
    if expr.op == "lt":
        return [Affine(negd.cq, negd.ck, _const_add(negd.const, minus_one))]
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
    return None


def _atom_region(atom: Affine, loop: str) -> Region:
    """The region of one `cq*q + ck*k + c >= 0` atom, looping over `loop` ('k' or 'q')."""
    other = "q" if loop == "k" else "k"
    c_loop = atom.ck if loop == "k" else atom.cq
    c_other = atom.cq if loop == "k" else atom.ck
    if c_loop == 0:
        return Region(EVERYTHING, None)  # uniform along the loop: decided element by element
    lo_var, hi_var = f"{other}0", f"{other}1"
    # c_loop * x >= -c - c_other * y.  Some y of the tile allows x (visit): y maximising
    # c_other*y; every y allows x (full): y minimising it.
    y_some = hi_var if c_other > 0 else lo_var
    y_all = lo_var if c_other > 0 else hi_var
    neg_c = _const_scale(atom.const, -1)
    if c_loop > 0:  # x >= ceil((-c - c_other*y) / c_loop)
        visit = Span(Linear(-c_other, y_some, neg_c, c_loop, "ceil"), None)
        full = Span(Linear(-c_other, y_all, neg_c, c_loop, "ceil"), None)
    else:  # x <= floor((c + c_other*y) / -c_loop)
        visit = Span(None, Linear(c_other, y_some, atom.const, -c_loop, "floor"))
        full = Span(None, Linear(c_other, y_all, atom.const, -c_loop, "floor"))
    return Region(visit, full)


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


def region(mask: ir.Expr | None, loop: str, params: dict[str, int | float]) -> Region:
    """Which indices along `loop` a tile of the other index visits, and which are full."""
    if mask is None:
        return Region(EVERYTHING, EVERYTHING)
    if isinstance(mask, ir.Const):
        return Region(EVERYTHING, EVERYTHING) if mask.value else Region(None, None)
    if isinstance(mask, ir.Binary) and mask.op == "and":
        a, b = region(mask.left, loop, params), region(mask.right, loop, params)
        return Region(_intersect(a.visit, b.visit), _intersect(a.full, b.full))
    if isinstance(mask, ir.Binary) and mask.op == "or":
        a, b = region(mask.left, loop, params), region(mask.right, loop, params)
        # Either side's full span is fully allowed; their hull need not be.
        full = a.full if b.full is None else b.full if a.full is None else _overlapping_union(a.full, b.full)
        return Region(_hull(a.visit, b.visit), full)
    if isinstance(mask, ir.Unary) and mask.op == "not":
        pushed = _negate(mask.operand)
        return region(pushed, loop, params) if pushed is not None else Region(EVERYTHING, None)
    atoms = atoms_ge_zero(mask, params)
    if atoms is None:
        return Region(EVERYTHING, None)
    result = Region(EVERYTHING, EVERYTHING)
    for atom in atoms:
        r = _atom_region(atom, loop)
        result = Region(_intersect(result.visit, r.visit), _intersect(result.full, r.full))
    return result


def _overlapping_union(a: Span, b: Span) -> Span:
    """A span inside the union of two full spans. Spans that share a side (both unbounded
    below, say, as `k < prefix or causal` gives) union exactly; otherwise keep the first."""
    if a.lo is None and b.lo is None:
        return Span(None, _extremum("max", a.hi, b.hi, True))
    if a.hi is None and b.hi is None:
        return Span(_extremum("min", a.lo, b.lo, True), None)
    return a
