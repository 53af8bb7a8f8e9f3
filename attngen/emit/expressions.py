"""Spells IR expressions, constant-folded, and the analysis' loop bounds as Triton statements of the kernels."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from typing import Mapping

from attngen import ir
from attngen.analysis.spans import CLOSED_HI, CLOSED_LO, OPEN_HI, OPEN_LO, Bound, Extremum, Gate, Linear
from attngen.intervals import Num, Ranges
from attngen.ir import I32_RANGE, I64_RANGE, postorder
from attngen.analysis.fold import fold, pinned
from attngen.analysis.gathers import corner_bounded, uniform
from attngen.frontend.printer import literal

_BINARY = {"add": "+", "sub": "-", "mul": "*", "eq": "==", "ne": "!=", "lt": "<", "le": "<=",
           "gt": ">", "ge": ">=", "and": "&", "or": "|", "bitand": "&", "bitor": "|", "bitxor": "^",
           "lshift": "<<", "rshift": ">>"}
_UNARY_FN = {"exp": "tl.exp", "exp2": "tl.exp2", "log": "tl.log", "log2": "tl.log2",
             "sqrt": "tl.sqrt", "rsqrt": "tl.rsqrt", "sigmoid": "tl.sigmoid", "abs": "tl.abs",
             "sin": "tl.sin", "cos": "tl.cos", "tan": "_tan", "atan": "_atan", "erf": "tl.erf"}


def indented(lines: list[str]) -> list[str]:
    """Statements (each maybe of several lines) one block deeper."""
    return [textwrap.indent(line, "    ") for line in lines]


def address(input_name: str, indices: list[str]) -> tuple[str, str]:
    """The offset of an input's entry at `indices` (codes) and the condition that they lie within its sizes."""
    offset = " + ".join(f"({i}) * stride_{input_name}_{n}" for n, i in enumerate(indices)) or "0"
    return offset, " & ".join(f"({i} >= 0) & ({i} < size_{input_name}_{n})" for n, i in enumerate(indices))


def int64(code: str) -> str:
    """`code` (a literal, constexpr, scalar or tensor) as int64. tl.cast takes all of them; a literal
    at or above 2**31 becomes int64 through it too (alone Triton types 2**31..2**32-1 as uint32)."""
    return f"tl.cast({code}, tl.int64)"


@dataclass
class Spelling:
    """How one kernel names the things an expression may use; `dims` says which index varies
    along which tile axis, so results can be broadcast to the full tile (`zeros` is a zero fp32
    tile of its shape); `tanh` names the tanh helper it calls; `rows` is the index along the tile's
    rows ("m": queries; "n": keys, in the dK/dV kernels' transposed tiles)."""
    names: dict[str, str]
    dims: dict[str, frozenset]
    zeros: str
    tanh: str = "_tanh"
    rows: str = "m"
    # Scalar code of the tile's first and last q and k, where the kernel has them (q_first, q_last,
    # k_first, k_last, padding rows included), and the names that code reads: an input read at one
    # entry over the whole tile is then loaded once (`TritonEmitter.interval`).
    corners: tuple[str, str, str, str] | None = None
    corner_names: tuple[str, ...] = ()
    # Sizes the kernel knows at compile time, folded as constants: a kernel that never runs a cache
    # call has its query rows at positions 0 .. Q_LEN - 1, so Q_OFFSET is 0 there.
    sizes: Mapping[str, int] = field(default_factory=dict)
    # A family whose tiles lay their rows out otherwise (the decode family's rows mix query heads) names
    # what a hook over a tile's elements may read and the tile's in-sequence checks (queries, keys) here;
    # None: the ones the tile's orientation gives (emit.hooks).
    element_names: tuple[str, ...] | None = None
    bounds_checks: tuple[str, str] | None = None


@dataclass
class TritonEmitter:
    """Emits one expression (and what it depends on) as SSA statements; equal subtrees are shared.

    Ints are computed as the reference computes them, exactly: in int32 where `ranges` proves the
    value fits, else in int64 (operands cast up; `wide` holds the names of int64 values)."""
    spelling: Spelling
    params: dict[str, int | float]
    inputs: dict[str, ir.InputDecl]
    prefix: str
    ranges: Ranges
    lines: list[str] = field(default_factory=list)
    memo: dict = field(default_factory=dict)
    shapes: dict = field(default_factory=dict)
    wide: set = field(default_factory=set)
    statements: dict = field(default_factory=dict)  # (code, dims, wide) -> the name that holds it
    taken: int = 0  # statements `local` took out of `lines`: names stay unique

    def _name(self) -> str:
        return f"{self.prefix}{len(self.lines) + self.taken}"

    def local(self, emit):
        """(emit(), the statements it added): taken out of `lines` and forgotten, for a branch of their own
        (a later use emits them again)."""
        mark, memo, statements = len(self.lines), set(self.memo), set(self.statements)
        result = emit()
        lines = self.lines[mark:]
        del self.lines[mark:]
        self.taken += len(lines)
        for key in set(self.memo) - memo:
            del self.memo[key]
        for key in set(self.statements) - statements:
            del self.statements[key]
        return result, lines

    def _temp(self, code: str, dims: frozenset, wide: bool = False) -> str:
        # Statements are pure, so one that was emitted before is reused, as `memo` reuses subtrees
        # (the bounds of a tile cast the same index to int64 for several spans).
        if (code, dims, wide) in self.statements:
            return self.statements[code, dims, wide]
        name = self._name()
        self.statements[code, dims, wide] = name
        self.lines.append(f"{name} = {code}")
        self.shapes[name] = dims
        if wide:
            self.wide.add(name)
        return name

    def dims_of(self, code: str) -> frozenset:
        return self.shapes.get(code, frozenset())

    def emit(self, e: ir.Expr) -> str:
        """The name or literal that holds `e`, constant-folded (`fold`), after the statements it needs."""
        return self._spell(self._fold(e))

    def _fold(self, e: ir.Expr) -> ir.Expr:
        return fold(pinned(e, self.spelling.sizes), self.params)

    def _spell(self, e: ir.Expr) -> str:
        if e in self.memo:
            return self.memo[e]
        code = self._emit(e)
        self.memo[e] = code
        return code

    def emit_full(self, e: ir.Expr) -> str:
        """A float expression as a full fp32 tile (broadcast when it does not vary along both axes)."""
        code = self.emit(e)
        if self.dims_of(code) != frozenset("mn"):
            code = self._temp(f"{self.spelling.zeros} + {code}",
                              frozenset("mn"))
        return code

    def _int_literal(self, value: int) -> str:
        # Beyond int32 a literal is spelled int64 outright (see `int64`).
        return str(value) if I32_RANGE[0] <= value <= I32_RANGE[1] else int64(str(value))

    def _is_float(self, e: ir.Expr) -> bool:
        """Whether the reference computes `e` as a float (torch keeps int ** int an int, see `integers`)."""
        return e.type == "float" and not self.ranges.is_int(e)

    def _operands(self, e: ir.Expr, codes: list[str], nodes) -> tuple[list[str], bool]:
        """The operand codes of `e`, cast to int64 where `e` is an int that needs it; and whether
        the result is int64 (it needs it, or an operand already is, and Triton promotes)."""
        if not self.ranges.is_int(e):
            return codes, False
        if any(c in self.wide for c in codes):
            return codes, True
        if not self.ranges.wide(e):
            return codes, False
        # One int64 operand is enough: Triton computes int32 op int64 in int64.
        first = next(i for i, n in enumerate(nodes) if self.ranges.is_int(n))
        return [int64(c) if i == first else c for i, c in enumerate(codes)], True

    def _emit(self, e: ir.Expr) -> str:
        sp = self.spelling
        if isinstance(e, ir.Const):  # params are constants too, after `fold`
            if e.type != "int":
                return literal(e.value, e.type)
            code = self._int_literal(int(e.value))
            if code != str(int(e.value)):
                self.wide.add(code)
            return code
        if isinstance(e, (ir.Var, ir.Size, ir.Score)):
            key = "score" if isinstance(e, ir.Score) else e.name
            code = sp.names[key]
            self.shapes[code] = sp.dims.get(key, frozenset())
            return code
        if isinstance(e, ir.Load):
            return self._load(e)
        if isinstance(e, ir.Unary):
            x = self._spell(e.operand)
            dims = self.dims_of(x)
            (x,), wide = self._operands(e, [x], [e.operand])
            code = {"not": f"({x} == 0)", "neg": f"-{x}", "invert": f"~{x}"}[e.op]
            return self._temp(code, dims, wide)
        if isinstance(e, ir.Binary):
            return self._binary(e)
        return self._call(e)

    def _load(self, e: ir.Load) -> str:
        wide = self.inputs[e.input].dtype == "i64"
        point = self.point(e.index) if self.varies_on_tile(e.index) else None
        if point is None:
            indices = [self._spell(i) for i in e.index]
            dims = frozenset().union(*(self.dims_of(i) for i in indices)) if indices else frozenset()
            return self._temp(self._load_code(e.input, indices), dims, wide)
        # A tile whose every element reads one entry (a clamped relative position far from the diagonal)
        # loads it once and broadcasts it; the others gather, their indices computed in that branch only.
        is_point, entry = point
        indices, index_lines = self.local(lambda: [self._spell(i) for i in e.index])
        name = self._name()
        self.lines.append("\n".join([
            f"if {is_point}:", f"    {name}_entry = {self._load_code(e.input, entry)}",
            f"    {name} = tl.where({self.spelling.zeros} == 0.0, {name}_entry, {name}_entry)",
            "else:", *indented(index_lines), f"    {name} = {self._load_code(e.input, indices)}"]))
        self.shapes[name] = frozenset("mn")
        if wide:
            self.wide.add(name)
        return name

    def varies_on_tile(self, index: tuple[ir.Expr, ...]) -> bool:
        """Whether a load's index varies along both tile axes (a gather an element, not a row or column)."""
        dims = {d for i in index for n in postorder(self._fold(i)) if isinstance(n, (ir.Var, ir.Size))
                for d in self.spelling.dims.get(n.name, ())}
        return dims == {"m", "n"}

    def _load_code(self, input_name: str, indices: list[str]) -> str:
        offset, bounds = address(input_name, indices)
        # Masked: padding rows/columns of a tile, and out-of-range user indices, never read memory.
        mask = f", mask={bounds}, other=0" if bounds else ""
        code = f"tl.load({input_name}_ptr + {offset}{mask})"
        dtype = self.inputs[input_name].dtype
        if dtype == "bool":
            return f"({code} != 0)"
        if dtype in ("f16", "bf16"):
            return f"{code}.to(tl.float32)"
        return code

    def point(self, index: tuple[ir.Expr, ...]) -> tuple[str, list[str]] | None:
        """For a load's index over the tile: (a scalar condition that holds when every element of the tile
        has the same index, the scalar index then), or None where `interval` cannot follow an index."""
        intervals = [self.interval(i) for i in index]
        if not intervals or None in intervals:
            return None
        varying = [f"({lo} == {hi})" for lo, hi in intervals if lo != hi]
        return " & ".join(varying) or "True", [lo for lo, _ in intervals]

    def interval(self, e: ir.Expr) -> tuple[str, str] | None:
        """Scalar int64 names of bounds on the values int `e` takes over the tile: interval arithmetic
        from the tile's corners (`spelling.corners`), exact ops only, so when the bounds are equal every
        element has that value. None where the kernel has no corners, or the analysis' rule does not bound
        `e` (`analysis.gathers.corner_bounded`, which this spells)."""
        if self.spelling.corners is None:
            return None
        folded = self._fold(e)
        if not corner_bounded(folded, self.ranges, self._varying):
            return None
        return self._interval(folded)

    @property
    def _varying(self) -> frozenset[str]:
        return frozenset(name for name, dims in self.spelling.dims.items() if dims)

    def _interval(self, e: ir.Expr) -> tuple[str, str]:
        key = ("interval", e)
        if key not in self.memo:
            self.memo[key] = self._interval_of(e)
        return self.memo[key]

    def _interval_of(self, e: ir.Expr) -> tuple[str, str]:
        """The bounds of `e`, which `corner_bounded` admits, as are all the subexpressions this reaches."""
        scalar = frozenset()
        if isinstance(e, ir.Const):
            code = self._int_literal(int(e.value))
            return code, code
        if uniform(e, self._varying):
            code = self._spell(e)
            assert not self.dims_of(code), code
            code = self._temp(int64(code), scalar, True)
            return code, code
        if isinstance(e, ir.Var) and e.name in ("q", "k"):
            first, last = self.spelling.corners[:2] if e.name == "q" else self.spelling.corners[2:]
            return self._temp(int64(first), scalar, True), self._temp(int64(last), scalar, True)
        # A `where` is bounded by its branches, whatever its condition.
        children = e.args[1:] if isinstance(e, ir.Call) and e.fn == "where" else ir.children(e)
        args = [self._interval(c) for c in children]

        def op(code: str) -> str:
            return self._temp(code, scalar, True)

        if isinstance(e, ir.Unary) and e.op == "neg":
            (lo, hi), = args
            return op(f"-{hi}"), op(f"-{lo}")
        if isinstance(e, ir.Binary) and e.op in ("add", "sub"):
            (alo, ahi), (blo, bhi) = args
            if e.op == "add":
                return op(f"{alo} + {blo}"), op(f"{ahi} + {bhi}")
            return op(f"{alo} - {bhi}"), op(f"{ahi} - {blo}")
        if isinstance(e, ir.Binary) and e.op == "mul":
            for factor, (lo, hi) in ((e.left, args[1]), (e.right, args[0])):
                if isinstance(factor, ir.Const):
                    c = self._int_literal(int(factor.value))
                    return (op(f"{c} * {lo}"), op(f"{c} * {hi}")) if factor.value >= 0 else \
                        (op(f"{c} * {hi}"), op(f"{c} * {lo}"))
        if isinstance(e, ir.Binary) and e.op == "floordiv" and isinstance(e.right, ir.Const) and e.right.value > 0:
            (lo, hi), (c, _) = args
            return op(f"_floordiv({lo}, {c})"), op(f"_floordiv({hi}, {c})")
        if isinstance(e, ir.Call) and e.fn in ("min", "max", "clamp", "where", "abs", "floor", "ceil", "round"):
            if e.fn in ("floor", "ceil", "round"):  # of an int: the int itself
                return args[0]
            if e.fn == "abs":
                (lo, hi), = args
                return (op(f"tl.where({lo} >= 0, {lo}, tl.where({hi} <= 0, -{hi}, 0))"),
                        op(f"tl.maximum(-{lo}, {hi})"))
            if e.fn == "where":
                (alo, ahi), (blo, bhi) = args
                return op(f"tl.minimum({alo}, {blo})"), op(f"tl.maximum({ahi}, {bhi})")
            (lo, hi) = args[0]
            steps = {"min": [("tl.minimum", 1)], "max": [("tl.maximum", 1)],
                     "clamp": [("tl.maximum", 1), ("tl.minimum", 2)]}[e.fn]
            for fn, n in steps:  # monotone in every argument
                lo, hi = op(f"{fn}({lo}, {args[n][0]})"), op(f"{fn}({hi}, {args[n][1]})")
            return lo, hi
        raise AssertionError(f"corner_bounded admits an expression the emitter does not bound: {e!r}")

    def _binary(self, e: ir.Binary) -> str:
        if e.op == "pow" and self.ranges.is_int(e):
            return self._int_pow(e)
        a, b = self._spell(e.left), self._spell(e.right)
        dims = self.dims_of(a) | self.dims_of(b)
        (a, b), wide = self._operands(e, [a, b], [e.left, e.right])
        if e.op in ir.SHIFT_OPS and not wide and self.ranges.value(e.right).hi > 31:
            # A shift of an int32 by 32 or more is undefined in Triton (LLVM), and Python's is what 31
            # gives there: x >> 31 is x's sign, and x << n fits int32 only for x == 0 then.
            b = str(min(int(e.right.value), 31)) if isinstance(e.right, ir.Const) else \
                self._temp(f"tl.minimum({b}, 31)", self.dims_of(b))
        if e.op in _BINARY:
            if e.op in ("add", "sub") and b.startswith("-"):
                b = f"({b})"  # a folded negative literal: `x - (-0.5)` reads better than `x - -0.5`
            return self._temp(f"{a} {_BINARY[e.op]} {b}", dims, wide)
        if e.op == "div":
            if not (self._is_float(e.left) or self._is_float(e.right)):
                a = f"({a}) * 1.0"  # true division, as in Python
            return self._temp(f"{a} / {b}", dims)
        if e.op in ("floordiv", "mod"):
            if self.ranges.is_int(e) and _at_least(self.ranges.value(e.left), 0) and _at_least(self.ranges.value(e.right), 1):
                # Triton's // and % truncate toward zero, Python's floor: they agree where neither operand is
                # negative, and there the helpers' sign fix-ups (a second division, compares, a select per
                # element) are dead work.
                return self._temp(f"{a} {'//' if e.op == 'floordiv' else '%'} {b}", dims, wide)
            helper = {"floordiv": "_floordiv", "mod": "_floormod"}[e.op]
            if not self.ranges.is_int(e):
                helper += "_f"
            return self._temp(f"{helper}({a}, {b})", dims, wide)
        assert e.op == "pow"
        exponent = e.right
        if isinstance(exponent, ir.Const) and float(exponent.value).is_integer() and 0 <= exponent.value <= 4:
            n = int(exponent.value)
            if n == 0:
                return self._temp(f"{a} * 0.0 + 1.0", self.dims_of(a))
            return self._temp(" * ".join([a] * n), self.dims_of(a))
        # A float power (an int to a negative power too: torch refuses it, the IR types it float).
        a, b = (x if self._is_float(node) else f"({x}) * 1.0" for x, node in ((a, e.left), (b, e.right)))
        return self._temp(f"_pow({a}, {b})", dims)

    def _int_pow(self, e: ir.Binary) -> str:
        """An int to a constant power n >= 0, exactly, by repeated squaring. When x ** n fits, so
        does every power of x on the way (each is x ** m with m <= n)."""
        n = self.ranges.value(e.right)
        assert n.lo == n.hi and n.lo >= 0, f"an int power needs a constant exponent: {e}"
        n = int(n.lo)
        x = self._spell(e.left)
        dims = self.dims_of(x)
        (cast,), wide = self._operands(e, [x], [e.left])
        if cast != x:
            x = self._temp(cast, dims, wide)
        if n == 0:
            return self._temp(f"{x} * 0 + 1", dims, wide)
        base, result = x, None
        while True:
            if n & 1:
                result = x if result is None else self._temp(f"{result} * {x}", dims, wide)
            n >>= 1
            if not n:
                return self._temp(result, dims, wide) if result == base else result
            x = self._temp(f"{x} * {x}", dims, wide)

    def _call(self, e: ir.Call) -> str:
        args = [self._spell(a) for a in e.args]
        dims = frozenset().union(*(self.dims_of(a) for a in args))
        fn = e.fn
        if fn in _UNARY_FN or fn == "tanh":
            x = args[0]
            if not self._is_float(e.args[0]) and fn != "abs":
                x = self._temp(f"({x}) * 1.0", self.dims_of(x))
            (x,), wide = self._operands(e, [x], e.args)
            name = self.spelling.tanh if fn == "tanh" else _UNARY_FN[fn]
            return self._temp(f"{name}({x})", dims, wide)
        if fn in ("floor", "ceil", "round"):
            if self.ranges.is_int(e.args[0]):
                return args[0]
            width = "tl.int64" if self.ranges.wide(e) else "tl.int32"
            rounded = "_round" if fn == "round" else f"tl.{fn}"
            return self._temp(f"{rounded}({args[0]}).to({width})", dims, self.ranges.wide(e))
        if fn == "sign":
            # The sign of an int fits any width; a float's keeps a zero's sign and a NaN, as torch.sign.
            if self.ranges.is_int(e):
                return self._temp(f"tl.where({args[0]} > 0, 1, tl.where({args[0]} < 0, -1, 0))", dims)
            return self._temp(f"tl.where({args[0]} > 0, 1.0, tl.where({args[0]} < 0, -1.0, {args[0]}))", dims)
        if fn == "softcap":
            return self._temp(f"{args[1]} * {self.spelling.tanh}({args[0]} / {args[1]})", dims)
        # min, max, clamp and where: the result is one of the operands, so it fits where they do.
        wide = self.ranges.is_int(e) and any(a in self.wide for a in args)
        if fn == "min":
            return self._temp(f"tl.minimum({args[0]}, {args[1]})", dims, wide)
        if fn == "max":
            return self._temp(f"tl.maximum({args[0]}, {args[1]})", dims, wide)
        if fn == "clamp":
            return self._temp(f"tl.minimum(tl.maximum({args[0]}, {args[1]}), {args[2]})", dims, wide)
        assert fn == "where", fn
        return self._temp(f"tl.where({args[0]}, {args[1]}, {args[2]})", dims, wide)

    def bound(self, b: Bound, tile_vars: dict[str, str]) -> str:
        """A loop bound from the analysis, as the name of a scalar int64 (made exact by `integers.exact_span`;
        `integers.linear_steps` follows these steps, folded: a sum computes no partial sums of its own)."""
        if isinstance(b, Extremum):
            terms = [self.bound(t, tile_vars) for t in b.terms]
            fn = "tl.minimum" if b.op == "min" else "tl.maximum"
            code = terms[0]
            for t in terms[1:]:
                code = self._temp(f"{fn}({code}, {t})", frozenset(), code in self.wide or t in self.wide)
            return code
        if isinstance(b, Gate):
            cond = self.bound(b.cond, tile_vars)
            opened, closed = (OPEN_LO, CLOSED_LO) if b.side == "lo" else (OPEN_HI, CLOSED_HI)
            return self._temp(f"tl.where({cond} >= 0, {opened}, {closed})", frozenset())
        assert isinstance(b, Linear)
        terms = []
        if b.coef:
            var = self._temp(int64(tile_vars[b.var]), frozenset(), True)
            if b.var_div != 1 or b.var_offset is not None:
                shifted = self._sum([(1, var), *self._terms(b.var_offset)])
                var = self._temp(f"_floordiv({shifted}, {self._int_literal(b.var_div)})", frozenset(), True)
            terms.append((b.coef, var))
        const = self._terms(b.const)
        if not terms:  # the constant alone: computed in int64 like the rest of the bound
            const = [(c, code if code in self.wide else int64(code)) for c, code in const]
        code = self._sum(terms + const) if terms or const else int64("0")
        if b.den != 1:
            helper = "_floordiv" if b.round == "floor" else "_ceildiv"
            code = f"{helper}({code}, {self._int_literal(b.den)})"
        elif b.out_scale != 1 and not code.isidentifier():
            code = f"({code})"
        if b.out_scale != 1:
            code = f"{self._int_literal(b.out_scale)} * {code}"
        if b.out_offset is not None:
            code = self._sum([(1, code), *self._terms(b.out_offset)])
        # A bound that is one name already (the tile's own index, a constant) needs no statement.
        return code if code.isidentifier() else self._temp(code, frozenset(), True)

    def _terms(self, e: ir.Expr | None) -> list[tuple[int, str]]:
        """A uniform int of a bound as (coefficient, code) terms of a sum: none for 0, a literal
        or a negation with its sign (so that `_sum` subtracts it), else the expression itself. The
        expression is not split further: `integers.exact_span` proved its value fits int64, not
        that of partial sums of its parts."""
        e = None if e is None else self._fold(e)
        if e is None or (isinstance(e, ir.Const) and e.value == 0):
            return []
        if isinstance(e, ir.Const) and e.value < 0 and -e.value <= I64_RANGE[1]:
            return [(-1, self._spell(ir.Const(type="int", value=-e.value)))]
        if isinstance(e, ir.Unary) and e.op == "neg":
            return [(-1, self._spell(e.operand))]
        return [(1, self._spell(e))]

    def _sum(self, terms: list[tuple[int, str]]) -> str:
        """sum(coefficient * code) as one int64 expression: `b - a` and `a - 3`, not `-1 * a + b` and
        `a + -3`. The first term spelled is int64 or the sum has an int64 term, so Triton computes
        every partial sum in int64 (at most one term is a bare int32 name or literal)."""
        terms = sorted(terms, key=lambda term: term[0] < 0)  # a positive term first: nothing to negate
        code = ""
        for coef, term in terms:
            magnitude = term if abs(coef) == 1 else f"{self._int_literal(abs(coef))} * {term}"
            if not code:
                code = magnitude if coef > 0 else f"-{magnitude}"
            else:
                code += f" + {magnitude}" if coef > 0 else f" - {magnitude}"
        return code


def _at_least(value, bound: int) -> bool:
    """Whether an int node's range (intervals.Num; a Truth for a bool) lies at or above `bound`."""
    return isinstance(value, Num) and value.lo >= bound
