"""Interval arithmetic over a tile: is a mask true everywhere on it (full), nowhere (empty), or mixed (partial)?

Every expression of the language gets an abstract value over the tile `q in [q0, q1]`,
`k in [k0, k1]` (with params, and sizes when known): a number interval (plus whether
NaN is possible) or, for a boolean, whether it may be true and whether it may be
false. The rules are sound for every construct: when unsure, the answer is "may be
either", so a tile may be called partial when it is full or empty, never the reverse.
Float comparisons are decided only with a margin, so fp32 rounding in the kernels
cannot flip a tile's class. Tensor inputs are unknown here (any value of their
dtype); masks that read them at `q` or `k` are classified at call time by the tile
table kernel instead. The same values, over every tile at once and sizes given as ranges,
bound each int of a spec for `attngen.integers`.

This is what `attngen explain` shows and what the analysis' loop bounds are tested
against; the kernels themselves use the closed-form spans of `analysis.region`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Mapping

from attngen import ir

INF = math.inf
# Relative margin for deciding float comparisons: far above fp32 rounding of a short expression.
FLOAT_MARGIN = 1e-5
I32_RANGE = (-(2 ** 31), 2 ** 31 - 1)
I64_RANGE = (-(2 ** 63), 2 ** 63 - 1)
_INT_DTYPE_RANGES = {"i32": I32_RANGE, "i64": I64_RANGE}


class TileClass(str, Enum):
    FULL = "full"
    PARTIAL = "partial"
    EMPTY = "empty"


@dataclass(frozen=True)
class Num:
    """Every value lies in [lo, hi] (ints stay exact Python ints); `nan`: it may also be NaN."""
    lo: float
    hi: float
    is_float: bool = False
    nan: bool = False


@dataclass(frozen=True)
class Truth:
    """A boolean over the tile: whether it may be true, and whether it may be false."""
    may_true: bool
    may_false: bool


UNKNOWN_BOOL = Truth(True, True)
ANY_FLOAT = Num(-INF, INF, True, True)


@dataclass(frozen=True)
class TileBox:
    """The tile (inclusive index ranges) and what is known about everything else."""
    q: tuple[int, int]
    k: tuple[int, int]
    params: Mapping[str, int | float]
    # Sizes (B, H, HKV, Q_LEN, KV_LEN, D): a value, an inclusive range, or missing (unknown); and
    # Q_OFFSET, the position of query 0, which is 0 when missing (rows are positions outside cache calls).
    sizes: Mapping[str, int | tuple[int, int]]
    uniform: Mapping[str, tuple[int, int]]  # ranges of b, h, hkv (missing: from the sizes, or unknown)
    # Int inputs' dtypes by name ("i32" or "i64"); a missing one may hold any int64.
    dtypes: Mapping[str, str] = field(default_factory=dict)


def classify(mask: ir.Expr | None, box: TileBox) -> TileClass:
    """Full, empty or partial: sound for every mask of the language."""
    if mask is None:
        return TileClass.FULL
    t = value(mask, box)
    assert isinstance(t, Truth)
    if not t.may_false:
        return TileClass.FULL
    if not t.may_true:
        return TileClass.EMPTY
    return TileClass.PARTIAL


def value(e: ir.Expr, box: TileBox) -> Num | Truth:
    return node_value(e, [value(c, box) for c in ir.children(e)], box)


def node_value(e: ir.Expr, args: list, box: TileBox) -> Num | Truth:
    """The value of node `e` from the values `args` of its children (`ir.children` order)."""
    if isinstance(e, ir.Const):
        if e.type == "bool":
            return Truth(bool(e.value), not e.value)
        return _point(e.value, e.type == "float")
    if isinstance(e, ir.Var):
        return _var(e.name, box)
    if isinstance(e, ir.Size):
        return Num(*_size(e.name, box))
    if isinstance(e, ir.Param):
        return _point(box.params[e.name], e.type == "float")
    if isinstance(e, ir.Score):
        return ANY_FLOAT
    if isinstance(e, ir.Load):
        return _load(e, box)
    if isinstance(e, ir.Unary):
        (x,) = args
        if e.op == "not":
            return Truth(x.may_false, x.may_true)
        return Num(-x.hi, -x.lo, x.is_float, x.nan)
    if isinstance(e, ir.Binary):
        return _binary(e, *args)
    return _call(e, args)


def _point(v, is_float: bool) -> Num:
    if is_float and math.isnan(v):
        return Num(-INF, INF, True, True)
    return Num(v, v, is_float)


def _var(name: str, box: TileBox) -> Num:
    if name in ("q", "k"):
        lo, hi = box.q if name == "q" else box.k
        return Num(lo, hi)
    if name in box.uniform:
        lo, hi = box.uniform[name]
        return Num(lo, hi)
    size = {"b": "B", "h": "H", "hkv": "HKV"}[name]
    return Num(0, _size(size, box)[1] - 1)


def _size(name: str, box: TileBox) -> tuple[float, float]:
    n = box.sizes.get(name, 0 if name == "Q_OFFSET" else None)
    if n is None:
        return 1, INF
    return n if isinstance(n, tuple) else (n, n)


def _load(e: ir.Load, box: TileBox) -> Num | Truth:
    if e.type == "bool":
        return UNKNOWN_BOOL
    if e.type == "int":
        return Num(*_INT_DTYPE_RANGES.get(box.dtypes.get(e.input), I64_RANGE))
    return ANY_FLOAT


def _hull(values: list[float], is_float: bool, nan: bool) -> Num:
    finite_nan = any(math.isnan(v) for v in values)
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return Num(-INF, INF, is_float, True)
    return Num(min(values), max(values), is_float, nan or finite_nan)


def _mul(a: float, b: float) -> float:
    if (a == 0 and math.isinf(b)) or (b == 0 and math.isinf(a)):
        return math.nan  # 0 * inf: as IEEE says
    return a * b


def _binary(e: ir.Binary, a, b):
    op = e.op
    if op in ("and", "or"):
        if op == "and":
            return Truth(a.may_true and b.may_true, a.may_false or b.may_false)
        return Truth(a.may_true or b.may_true, a.may_false and b.may_false)
    if op in ir.COMPARISON_OPS:
        return _compare(op, a, b)
    is_float = e.type == "float"
    nan = a.nan or b.nan
    if op == "add":
        if is_float and ((a.lo == -INF and b.hi == INF) or (a.hi == INF and b.lo == -INF)):
            nan = True  # inf - inf
        return Num(_add(a.lo, b.lo, -INF), _add(a.hi, b.hi, INF), is_float, nan)
    if op == "sub":
        return _binary(e.model_copy(update={"op": "add"}), a, Num(-b.hi, -b.lo, b.is_float, b.nan))
    if op == "mul":
        return _hull([_mul(x, y) for x in (a.lo, a.hi) for y in (b.lo, b.hi)], is_float, nan)
    if op == "floordiv" and not is_float:
        return _int_floordiv(a, b, nan)
    if op in ("div", "floordiv"):
        if b.lo <= 0 <= b.hi:
            return Num(-INF, INF, is_float, True)  # may divide by zero
        quotients = [x / y if not (math.isinf(x) and math.isinf(y)) else math.nan
                     for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
        if op == "floordiv":
            quotients = [math.floor(v) if math.isfinite(v) else v for v in quotients]
            if not is_float and all(map(math.isfinite, (a.lo, a.hi, b.lo, b.hi))):
                quotients = [x // y for x in (a.lo, a.hi) for y in (b.lo, b.hi)]  # exact ints
        return _hull(quotients, is_float, nan)
    if op == "mod":
        return _mod(a, b, is_float, nan)
    assert op == "pow"
    return _pow(a, b, is_float, nan)


def _nonzero_divisors(b: Num) -> list[float]:
    """The ends of the int divisor range with 0 taken out: an int divided by 0 has no value (the
    reference raises), and a quotient or remainder is monotone in the divisor on each side of 0."""
    return [d for d in (b.lo, -1, 1, b.hi) if b.lo <= d <= b.hi and d != 0]


def _int_floordiv(a: Num, b: Num, nan: bool) -> Num:
    divisors = _nonzero_divisors(b)
    if not divisors:
        return Num(-INF, INF, False, True)
    # Monotone in the dividend, and in the divisor on each side of 0: the extremes lie at corners.
    return _hull([_floor_quotient(x, y) for x in (a.lo, a.hi) for y in divisors], False, nan)


def _floor_quotient(x: float, y: float) -> float:
    if math.isinf(x) or math.isinf(y):
        v = x / y if not (math.isinf(x) and math.isinf(y)) else math.nan
        return math.floor(v) if math.isfinite(v) else v
    return x // y  # exact for ints of any size


def _add(x: float, y: float, on_nan: float) -> float:
    s = x + y
    return on_nan if isinstance(s, float) and math.isnan(s) else s


def _mod(a: Num, b: Num, is_float: bool, nan: bool) -> Num:
    if not is_float and b.lo <= 0 <= b.hi:
        if not _nonzero_divisors(b):
            return Num(-INF, INF, False, True)
        # Nonzero divisors only (as for //); the remainder has the divisor's sign and is smaller.
        return Num(min(0, b.lo + 1), max(0, b.hi - 1), False, nan)
    if b.lo <= 0 <= b.hi or math.isinf(a.lo) or math.isinf(a.hi):
        return Num(-INF, INF, is_float, True)
    if b.lo == b.hi and not is_float:
        d = b.lo
        if math.floor(a.lo / d) == math.floor(a.hi / d):  # one period: the remainder is monotone
            return Num(a.lo % d, a.hi % d, is_float, nan) if d > 0 else Num(a.hi % d, a.lo % d, is_float, nan)
    # The result has the divisor's sign and is smaller than it in magnitude.
    if b.lo > 0:
        return Num(0, b.hi, is_float, nan)
    return Num(b.lo, 0, is_float, nan)


def _pow(a: Num, b: Num, is_float: bool, nan: bool) -> Num:
    if b.lo == b.hi and not math.isinf(b.lo) and float(b.lo).is_integer() and b.lo >= 0:
        n = int(b.lo)
        if n == 0:
            return Num(1, 1, is_float, False)
        ends = [_ipow(a.lo, n), _ipow(a.hi, n)]
        if n % 2 == 0 and a.lo <= 0 <= a.hi:
            ends.append(0)
        return _hull(ends, is_float, nan)
    if a.lo > 0 and b.lo == b.hi and math.isfinite(b.lo):  # a positive base: monotone in the base
        return _hull([_fpow(a.lo, b.lo), _fpow(a.hi, b.lo)], True, nan)
    return Num(-INF, INF, is_float, True)


def _ipow(x: float, n: int) -> float:
    """x ** n for an integral n >= 0; beyond 2 ** 256 in magnitude it is as good as infinite (and
    computing it exactly could take forever: think 3 ** 10 ** 18)."""
    huge = INF if x > 0 or n % 2 == 0 else -INF
    if abs(x) > 1 and n * math.log2(abs(x)) > 256:
        return huge
    if abs(x) <= 1 and not isinstance(x, float):
        return x ** (n % 2 + 2 if n > 2 else n)  # 0, 1 or -1: the parity of n is all that matters
    try:
        return x ** n
    except OverflowError:
        return huge


def _fpow(x: float, y: float) -> float:
    try:
        return math.pow(x, y)
    except OverflowError:
        return INF
    except ValueError:
        return math.nan


def _widen(x: Num) -> Num:
    if not x.is_float:
        return x
    def out(v: float, sign: int) -> float:
        return v if math.isinf(v) else v + sign * FLOAT_MARGIN * max(abs(v), 1e-30)
    return Num(out(x.lo, -1), out(x.hi, 1), True, x.nan)


def _compare(op: str, a, b) -> Truth:
    if isinstance(a, Truth):  # == and != between booleans
        known = not (a.may_true and a.may_false) and not (b.may_true and b.may_false)
        if not known:
            return UNKNOWN_BOOL
        same = a.may_true == b.may_true
        return Truth(same, not same) if op == "eq" else Truth(not same, same)
    if a.is_float or b.is_float:
        a, b = _widen(a), _widen(b)
    nan = a.nan or b.nan
    if op in ("gt", "ge"):
        op, a, b = {"gt": "lt", "ge": "le"}[op], b, a
    if op == "lt":
        always, never = a.hi < b.lo, a.lo >= b.hi
    elif op == "le":
        always, never = a.hi <= b.lo, a.lo > b.hi
    else:
        single = a.lo == a.hi == b.lo == b.hi and not math.isinf(a.lo) and not (a.is_float or b.is_float)
        disjoint = a.hi < b.lo or b.hi < a.lo
        always, never = (single, disjoint) if op == "eq" else (disjoint, single)
        if op == "ne":
            return Truth(not never or nan, not always)  # NaN != anything is true
    return Truth(not never, not always or nan)


def _call(e: ir.Call, args):
    fn = e.fn
    is_float = e.type == "float"
    if fn == "where":
        cond, x, y = args
        if isinstance(x, Truth):
            options = [v for v, possible in ((x, cond.may_true), (y, cond.may_false)) if possible]
            return Truth(any(o.may_true for o in options), any(o.may_false for o in options))
        options = [v for v, possible in ((x, cond.may_true), (y, cond.may_false)) if possible]
        return _hull([o.lo for o in options] + [o.hi for o in options], is_float, any(o.nan for o in options))
    nan = any(a.nan for a in args)
    if fn in ("min", "max"):
        pick = min if fn == "min" else max
        return Num(pick(args[0].lo, args[1].lo), pick(args[0].hi, args[1].hi), is_float, nan)
    if fn == "clamp":
        x, lo, hi = args
        return Num(min(max(x.lo, lo.lo), hi.lo), min(max(x.hi, lo.hi), hi.hi), is_float, nan)
    x = args[0]
    if fn == "abs":
        if x.lo >= 0:
            return x
        if x.hi <= 0:
            return Num(-x.hi, -x.lo, x.is_float, x.nan)
        return Num(0, max(-x.lo, x.hi), x.is_float, x.nan)
    if fn in ("floor", "ceil"):
        if not x.is_float:
            return Num(x.lo, x.hi, False, x.nan)
        if x.nan or not (-(2 ** 31) <= x.lo and x.hi < 2 ** 31):
            return Num(*I64_RANGE)  # converting NaN, inf or a huge float to an int is undefined
        f = math.floor if fn == "floor" else math.ceil
        return Num(f(x.lo), f(x.hi), False)
    if fn == "softcap":
        cap = args[1]
        if cap.lo == cap.hi and cap.lo > 0 and math.isfinite(cap.lo):  # increasing in x
            c = cap.lo
            return Num(c * math.tanh(x.lo / c), c * math.tanh(x.hi / c), True, nan)
        return ANY_FLOAT
    increasing = {"tanh": math.tanh, "exp": _exp, "exp2": lambda v: _exp(v * math.log(2)),
                  "sigmoid": lambda v: 1 / (1 + _exp(-v)), "log": _log, "log2": lambda v: _log(v) / math.log(2),
                  "sqrt": lambda v: math.sqrt(v) if v >= 0 else math.nan}
    if fn in increasing:
        f = increasing[fn]
        domain_nan = fn in ("log", "log2", "sqrt") and x.lo < 0
        lo, hi = max(x.lo, 0) if domain_nan else x.lo, x.hi
        if hi < lo:
            return Num(-INF, INF, True, True)
        return Num(f(lo), f(hi), True, x.nan or domain_nan)
    assert fn == "rsqrt", fn
    if x.lo <= 0:
        return Num(0, INF, True, True)
    return Num(1 / math.sqrt(x.hi), 1 / math.sqrt(x.lo), True, x.nan)


def _exp(v: float) -> float:
    try:
        return math.exp(v)
    except OverflowError:
        return INF


def _log(v: float) -> float:
    return -INF if v == 0 else math.log(v)
