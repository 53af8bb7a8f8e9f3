"""Interval arithmetic over the IR: is a mask full, empty or mixed on a tile, and what range has each int a spec computes over every call?

Every expression of the language gets an abstract value over the tile `q in [q0, q1]`,
`k in [k0, k1]` (with params, and sizes when known): a number interval (plus whether
NaN is possible) or, for a boolean, whether it may be true and whether it may be
false. The rules are sound for every construct: when unsure, the answer is "may be
either", so a tile may be called partial when it is full or empty, never the reverse.
Float comparisons are decided only with a margin, so fp32 rounding in the kernels
cannot flip a tile's class. Tensor inputs are unknown here (any value of their
dtype); masks that read them at `q` or `k` are classified at call time by the tile
table kernel instead.

The same values, over every tile at once and sizes given as ranges (`box`: lengths up to a
limit, batch and heads up to the launch grid's limit, head dims 1..256, params as set, tensor
inputs anywhere in their dtype), bound each int of a spec (`Ranges`). The reference computes
every int in int64 (torch), and "exact" means the kernels agree with it and neither wraps: the
kernels compute a node in int32 where its range fits, and in int64 otherwise (`Ranges.wide`).
Where a range does not fit int64 either at the longest sequences, `length_limit` finds the
longest lengths at which every int fits; the module refuses longer ones at call time, and the
frontend's number checks (`frontend.checks`) reject a spec whose limit is too short to be of use.

It reads only the IR, so the frontend's checks, the analysis (spans, exact loop bounds in
`analysis.integers`), the emitter's int widths and `attngen explain`'s tile map all build on it.
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
_INT_DTYPE_RANGES = {"i32": ir.I32_RANGE, "i64": ir.I64_RANGE}


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
    # Inputs' declared dims by name (a reduction's size is their product); a missing one is unknown.
    dims: Mapping[str, tuple] = field(default_factory=dict)
    # Inputs that hold a reduction of another input (ir.without_reductions): name -> (op, source, dims).
    reduced: Mapping[str, tuple] = field(default_factory=dict)


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
    if isinstance(e, ir.Reduce):
        return _reduce(e, box)
    if isinstance(e, ir.Unary):
        (x,) = args
        if e.op == "not":
            return Truth(x.may_false, x.may_true)
        if e.op == "invert":  # ~x == -x - 1
            return Num(-x.hi - 1, -x.lo - 1, False, x.nan)
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
    if e.input in box.reduced:
        op, source, dims = box.reduced[e.input]
        return _reduction(op, source, dims, e.type, box)
    if e.type == "bool":
        return UNKNOWN_BOOL
    if e.type == "int":
        return Num(*_INT_DTYPE_RANGES.get(box.dtypes.get(e.input), ir.I64_RANGE))
    return ANY_FLOAT


def _reduce(e: ir.Reduce, box: TileBox) -> Num | Truth:
    return _reduction(e.op, e.input, e.reduced_dims, e.type, box)


def _reduction(op: str, source: str, reduced_dims: tuple[int, ...], type_: str, box: TileBox) -> Num | Truth:
    # A max, min or mean lies within the input's values. A sum of ints or bools lies within the count of
    # the reduced elements times the values' range, where the dims bound that count; over a `*` dim the
    # count is unknown, and the sum is taken to fit int64 (as torch's int64 sum the host computes).
    if type_ == "bool":
        return UNKNOWN_BOOL
    if type_ == "float":
        return ANY_FLOAT
    dtype = box.dtypes.get(source)
    lo, hi = (0, 1) if dtype == "bool" else _INT_DTYPE_RANGES.get(dtype, ir.I64_RANGE)
    if op != "sum":
        return Num(lo, hi)
    dims = box.dims.get(source)
    count = 1
    for d in reduced_dims:
        size = dims[d] if dims is not None else "*"
        count *= size if isinstance(size, int) else INF if size == "*" else _size(size, box)[1]
    if count == INF:
        return Num(*ir.I64_RANGE)
    return Num(lo * count, hi * count)


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
    if op in ir.BITWISE_OPS:
        return _bitwise(op, a, b, nan)
    assert op == "pow"
    return _pow(a, b, is_float, nan)


def _bits(x: Num) -> float:
    """The least w with every value of int `x` in [-2**w, 2**w - 1] (inf when unbounded)."""
    if math.isinf(x.lo) or math.isinf(x.hi):
        return INF
    return max(int(v if v >= 0 else -v - 1).bit_length() for v in (x.lo, x.hi))


def _bitwise(op: str, a: Num, b: Num, nan: bool) -> Num:
    """Bounds of int `& | ^ << >>` as Python computes them on ints (two's complement of unbounded width)."""
    if op in ir.SHIFT_OPS:
        if b.lo < 0 or b.hi > ir.MAX_SHIFT or math.isinf(a.lo) or math.isinf(a.hi):
            return Num(-INF, INF, False, True)  # a count outside 0..63 is a compile-time error
        counts = (int(b.lo), int(b.hi))
        if op == "lshift":  # x * 2**n: monotone in x, and in n for either sign of x
            return _hull([x * 2 ** n for x in (a.lo, a.hi) for n in counts], False, nan)
        return _hull([x // 2 ** n for x in (a.lo, a.hi) for n in counts], False, nan)  # floor(x / 2**n)
    w = max(_bits(a), _bits(b))
    full = (-(2 ** w), 2 ** w - 1) if w != INF else (-INF, INF)
    a_pos, b_pos, a_neg, b_neg = a.lo >= 0, b.lo >= 0, a.hi < 0, b.hi < 0
    if op == "bitand":
        # Clearing bits never raises a value: x & y <= x for x >= 0; two negatives give a negative.
        if a_pos or b_pos:
            return Num(0, min(x.hi for x, pos in ((a, a_pos), (b, b_pos)) if pos), False, nan)
        return Num(full[0], max(a.hi, b.hi) if not (a_neg and b_neg) else min(a.hi, b.hi), False, nan)
    if op == "bitor":
        # Setting bits never lowers a value of the same sign: x | y >= x; a negative operand makes it negative.
        if a_pos and b_pos:
            return Num(max(a.lo, b.lo), full[1], False, nan)
        if a_neg or b_neg:
            return Num(max(x.lo for x, neg in ((a, a_neg), (b, b_neg)) if neg), -1, False, nan)
        return Num(min(a.lo, b.lo), full[1], False, nan)
    assert op == "bitxor"
    if (a_pos and b_pos) or (a_neg and b_neg):
        return Num(0, full[1], False, nan)
    if (a_pos and b_neg) or (a_neg and b_pos):
        return Num(full[0], -1, False, nan)
    return Num(*full, False, nan)


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
    if fn in ("floor", "ceil", "round"):
        if not x.is_float:
            return Num(x.lo, x.hi, False, x.nan)
        if x.nan or not (-(2 ** 31) <= x.lo and x.hi < 2 ** 31):
            return Num(*ir.I64_RANGE)  # converting NaN, inf or a huge float to an int is undefined
        f = {"floor": math.floor, "ceil": math.ceil, "round": round}[fn]  # round: ties to even, as torch
        return Num(f(x.lo), f(x.hi), False)
    if fn == "sign":  # monotone; NaN stays NaN
        return Num(_sign(x.lo), _sign(x.hi), x.is_float, x.nan)
    if fn in ("sin", "cos"):
        return Num(-1.0, 1.0, True, x.nan or math.isinf(x.lo) or math.isinf(x.hi))
    if fn == "tan":
        # Increasing between its poles: bounded only where the argument keeps clear of +-pi/2, by enough
        # that the float32 argument's rounding moves tan by far less than FLOAT_MARGIN (|tan| < 5 there).
        clear = math.pi / 2 - 0.2
        if -clear < x.lo and x.hi < clear:
            return Num(math.tan(x.lo), math.tan(x.hi), True, x.nan)
        return Num(-INF, INF, True, True)
    if fn == "softcap":
        cap = args[1]
        if cap.lo == cap.hi and cap.lo > 0 and math.isfinite(cap.lo):  # increasing in x
            c = cap.lo
            return Num(c * math.tanh(x.lo / c), c * math.tanh(x.hi / c), True, nan)
        return ANY_FLOAT
    increasing = {"tanh": math.tanh, "atan": math.atan, "erf": math.erf, "exp": _exp,
                  "exp2": lambda v: _exp(v * math.log(2)),
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


def _sign(v: float) -> float:
    return (v > 0) - (v < 0)


def _exp(v: float) -> float:
    try:
        return math.exp(v)
    except OverflowError:
        return INF


def _log(v: float) -> float:
    return -INF if v == 0 else math.log(v)


# --- each int's range over every call ------------------------------------------------------------

# Positions are int32 in the kernels (their offsets are int32 tiles, and Triton passes an int
# argument below 2**31 as i32), so no length reaches 2**31.
MAX_LENGTH = 2 ** 31 - 1
# The launch grid's second axis is B * H, at most 65535 on CUDA: so B, H and HKV are at most 65535.
MAX_BATCH_HEADS = 65535
HEAD_DIMS = (1, 256)  # the head dims the generated module accepts


def box(spec: ir.Spec, length: int, reductions: tuple[ir.Reduction, ...] = ()) -> TileBox:
    """Everything a call may bring, with Q_LEN and KV_LEN at most `length`; a cache call's query
    positions q_offset + i too, which the module checks lie below `length`, so Q_OFFSET does.
    `reductions`: the spec's inputs that hold reductions of others, bounded as the reductions are."""
    length = max(1, min(length, MAX_LENGTH))
    heads = (1, MAX_BATCH_HEADS)
    return TileBox(q=(0, length - 1), k=(0, length - 1), params=spec.param_values,
                   sizes={"B": heads, "H": heads, "HKV": heads, "Q_LEN": (1, length), "KV_LEN": (1, length),
                          "D": HEAD_DIMS, "Q_OFFSET": (0, length - 1)},
                   uniform={}, dtypes={i.name: i.dtype for i in spec.inputs},
                   dims={i.name: i.dims for i in spec.inputs},
                   reduced={r.name: (r.op, r.source, r.dims) for r in reductions})


def computes_int(e: ir.Expr, args_int: list[bool]) -> bool:
    """Whether the reference computes node `e` as an int (int64), from whether it computes its children so.

    That is its IR type, except that torch keeps an int ** int an int even where the IR types it
    float (`q ** c`, a param exponent), and so do +, -, *, //, %, min, max, clamp, abs and where
    on what it computes as ints."""
    if isinstance(e, ir.Binary):
        return e.op in ir.BITWISE_OPS or (e.op in ir.ARITHMETIC_OPS and e.op != "div" and all(args_int))
    if isinstance(e, ir.Unary):
        return e.op == "invert" or (e.op == "neg" and args_int[0])
    if isinstance(e, ir.Call):
        if e.fn in ("floor", "ceil", "round"):
            return True
        if e.fn == "where":
            return args_int[1] and args_int[2]
        return ir.FUNCTIONS[e.fn][1] == "same" and all(args_int)
    return e.type == "int"


def is_constant(e: ir.Expr) -> bool:
    """Whether an expression is made of literals and params only (known at compile time)."""
    return not any(isinstance(n, (ir.Var, ir.Size, ir.Load, ir.Reduce, ir.Score)) for n in ir.postorder(e))


def fits(value: Num | Truth, bounds: tuple[int, int] = ir.I64_RANGE) -> bool:
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
        return self.is_int(expr) and not fits(self.value(expr), ir.I32_RANGE)

    def overflow(self, expr: ir.Expr) -> ir.Expr | None:
        """The innermost int of `expr` whose range does not fit int64, or None."""
        self._fill(expr)
        return next((n for n in ir.postorder(expr) if self._known[id(n)][2] and not fits(self._known[id(n)][1])),
                    None)


def _expressions(spec: ir.Spec) -> list[ir.Expr]:
    return [e for e in (spec.mask, spec.score, spec.sink) if e is not None]


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
