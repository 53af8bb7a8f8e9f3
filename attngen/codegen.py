"""Spells IR expressions as Triton statements (for kernels) and as Python (for the host-side scale)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from attngen import ir
from attngen.analysis import CLOSED_HI, CLOSED_LO, OPEN_HI, OPEN_LO, Bound, Extremum, Gate, Linear

_BINARY = {"add": "+", "sub": "-", "mul": "*", "eq": "==", "ne": "!=", "lt": "<", "le": "<=",
           "gt": ">", "ge": ">=", "and": "&", "or": "|"}
_UNARY_FN = {"exp": "tl.exp", "exp2": "tl.exp2", "log": "tl.log", "log2": "tl.log2",
             "sqrt": "tl.sqrt", "rsqrt": "tl.rsqrt", "sigmoid": "tl.sigmoid", "abs": "tl.abs",
             "tanh": "_tanh"}


def literal(value, type_: str) -> str:
    if type_ == "bool":
        return "True" if value else "False"
    if type_ == "int":
        return str(int(value))
    if math.isinf(value):
        return 'float("inf")' if value > 0 else 'float("-inf")'
    return repr(float(value))


@dataclass
class Spelling:
    """How one kernel names the things an expression may use; `dims` says which index varies
    along which tile axis, so results can be broadcast to the full tile shape."""
    names: dict[str, str]
    dims: dict[str, frozenset]
    full_shape: str


@dataclass
class TritonEmitter:
    """Emits one expression (and what it depends on) as SSA statements; equal subtrees are shared."""
    spelling: Spelling
    params: dict[str, int | float]
    inputs: dict[str, ir.InputDecl]
    prefix: str
    lines: list[str] = field(default_factory=list)
    memo: dict = field(default_factory=dict)
    shapes: dict = field(default_factory=dict)

    def _temp(self, code: str, dims: frozenset) -> str:
        name = f"{self.prefix}{len(self.lines)}"
        self.lines.append(f"{name} = {code}")
        self.shapes[name] = dims
        return name

    def dims_of(self, code: str) -> frozenset:
        return self.shapes.get(code, frozenset())

    def emit(self, e: ir.Expr) -> str:
        if e in self.memo:
            return self.memo[e]
        code = self._emit(e)
        self.memo[e] = code
        return code

    def emit_full(self, e: ir.Expr) -> str:
        """A float expression as a full fp32 tile (broadcast when it does not vary along both axes)."""
        code = self.emit(e)
        if self.dims_of(code) != frozenset("mn"):
            code = self._temp(f"tl.zeros({self.spelling.full_shape}, dtype=tl.float32) + {code}",
                              frozenset("mn"))
        return code

    def _emit(self, e: ir.Expr) -> str:
        sp = self.spelling
        if isinstance(e, ir.Const):
            return literal(e.value, e.type)
        if isinstance(e, (ir.Var, ir.Size, ir.Score)):
            key = "score" if isinstance(e, ir.Score) else e.name
            code = sp.names[key]
            self.shapes[code] = sp.dims.get(key, frozenset())
            return code
        if isinstance(e, ir.Param):
            return literal(self.params[e.name], e.type)
        if isinstance(e, ir.Load):
            return self._load(e)
        if isinstance(e, ir.Unary):
            x = self.emit(e.operand)
            code = f"({x} == 0)" if e.op == "not" else f"-{x}"
            return self._temp(code, self.dims_of(x))
        if isinstance(e, ir.Binary):
            return self._binary(e)
        return self._call(e)

    def _load(self, e: ir.Load) -> str:
        decl = self.inputs[e.input]
        indices = [self.emit(i) for i in e.index]
        dims = frozenset().union(*(self.dims_of(i) for i in indices)) if indices else frozenset()
        offset = " + ".join(f"({i}) * stride_{e.input}_{n}" for n, i in enumerate(indices)) or "0"
        # Masked: padding rows/columns of a tile, and out-of-range user indices, never read memory.
        bounds = " & ".join(f"({i} >= 0) & ({i} < size_{e.input}_{n})" for n, i in enumerate(indices))
        mask = f", mask={bounds}, other=0" if bounds else ""
        code = f"tl.load({e.input}_ptr + {offset}{mask})"
        if decl.dtype == "bool":
            code = f"({code} != 0)"
        elif decl.dtype in ("f16", "bf16"):
            code = f"{code}.to(tl.float32)"
        return self._temp(code, dims)

    def _binary(self, e: ir.Binary) -> str:
        a, b = self.emit(e.left), self.emit(e.right)
        dims = self.dims_of(a) | self.dims_of(b)
        if e.op in _BINARY:
            return self._temp(f"{a} {_BINARY[e.op]} {b}", dims)
        if e.op == "div":
            if e.left.type != "float" and e.right.type != "float":
                a = f"({a}) * 1.0"  # true division, as in Python
            return self._temp(f"{a} / {b}", dims)
        if e.op in ("floordiv", "mod"):
            helper = {"floordiv": "_floordiv", "mod": "_floormod"}[e.op]
            if e.type == "float":
                helper += "_f"
            return self._temp(f"{helper}({a}, {b})", dims)
        assert e.op == "pow"
        exponent = e.right
        if isinstance(exponent, ir.Const) and float(exponent.value).is_integer() and 0 <= exponent.value <= 4:
            n = int(exponent.value)
            if n == 0:
                return self._temp(f"{a} * 0 + 1" if e.type == "int" else f"{a} * 0.0 + 1.0", self.dims_of(a))
            return self._temp(" * ".join([a] * n), self.dims_of(a))
        return self._temp(f"_pow({a}, {b})", dims)

    def _call(self, e: ir.Call) -> str:
        args = [self.emit(a) for a in e.args]
        dims = frozenset().union(*(self.dims_of(a) for a in args))
        fn = e.fn
        if fn in _UNARY_FN:
            x = args[0]
            if e.args[0].type != "float" and fn != "abs":
                x = self._temp(f"({x}) * 1.0", self.dims_of(x))
            return self._temp(f"{_UNARY_FN[fn]}({x})", dims)
        if fn in ("floor", "ceil"):
            if e.args[0].type == "int":
                return args[0]
            return self._temp(f"tl.{fn}({args[0]}).to(tl.int32)", dims)
        if fn == "min":
            return self._temp(f"tl.minimum({args[0]}, {args[1]})", dims)
        if fn == "max":
            return self._temp(f"tl.maximum({args[0]}, {args[1]})", dims)
        if fn == "clamp":
            return self._temp(f"tl.minimum(tl.maximum({args[0]}, {args[1]}), {args[2]})", dims)
        if fn == "where":
            return self._temp(f"tl.where({args[0]}, {args[1]}, {args[2]})", dims)
        if fn == "softcap":
            return self._temp(f"{args[1]} * _tanh({args[0]} / {args[1]})", dims)
        raise AssertionError(fn)

    def bound(self, b: Bound, tile_vars: dict[str, str]) -> str:
        """A loop bound from the analysis, as a scalar statement."""
        if isinstance(b, Extremum):
            terms = [self.bound(t, tile_vars) for t in b.terms]
            fn = "tl.minimum" if b.op == "min" else "tl.maximum"
            code = terms[0]
            for t in terms[1:]:
                code = self._temp(f"{fn}({code}, {t})", frozenset())
            return code
        if isinstance(b, Gate):
            cond = self.bound(b.cond, tile_vars)
            opened, closed = (OPEN_LO, CLOSED_LO) if b.side == "lo" else (OPEN_HI, CLOSED_HI)
            return self._temp(f"tl.where({cond} >= 0, {opened}, {closed})", frozenset())
        assert isinstance(b, Linear)
        var = tile_vars[b.var]
        if b.coef and (b.var_div != 1 or b.var_offset is not None):
            shifted = var if b.var_offset is None else f"{var} + {self.emit(b.var_offset)}"
            var = self._temp(f"_floordiv({shifted}, {b.var_div})", frozenset())
        parts = []
        if b.coef:
            parts.append(f"{b.coef} * {var}")
        if b.const is not None:
            parts.append(self.emit(b.const))
        code = " + ".join(parts) or "0"
        if b.den != 1:
            helper = "_floordiv" if b.round == "floor" else "_ceildiv"
            code = f"{helper}({code}, {b.den})"
        if b.out_scale != 1:
            code = f"{b.out_scale} * ({code})"
        if b.out_offset is not None:
            code = f"{code} + {self.emit(b.out_offset)}"
        return self._temp(code, frozenset())


def python_expr(e: ir.Expr, params: dict[str, int | float]) -> str:
    """A host-side Python expression (for `scale:`, which may use only D, params and numbers)."""
    if isinstance(e, ir.Const):
        return literal(e.value, e.type) if e.type != "float" or not math.isinf(e.value) else (
            "math.inf" if e.value > 0 else "-math.inf")
    if isinstance(e, ir.Size):
        return e.name
    if isinstance(e, ir.Param):
        return literal(params[e.name], e.type)
    if isinstance(e, ir.Unary):
        x = python_expr(e.operand, params)
        return f"(not {x})" if e.op == "not" else f"(-{x})"
    if isinstance(e, ir.Binary):
        ops = {**_BINARY, "and": "and", "or": "or", "div": "/", "floordiv": "//", "mod": "%", "pow": "**"}
        return f"({python_expr(e.left, params)} {ops[e.op]} {python_expr(e.right, params)})"
    assert isinstance(e, ir.Call)
    args = [python_expr(a, params) for a in e.args]
    simple = {"tanh": "math.tanh", "exp": "math.exp", "log": "math.log", "log2": "math.log2",
              "sqrt": "math.sqrt", "abs": "abs", "floor": "math.floor", "ceil": "math.ceil",
              "min": "min", "max": "max"}
    if e.fn in simple:
        return f"{simple[e.fn]}({', '.join(args)})"
    if e.fn == "exp2":
        return f"(2.0 ** {args[0]})"
    if e.fn == "rsqrt":
        return f"(1.0 / math.sqrt({args[0]}))"
    if e.fn == "sigmoid":
        return f"(1.0 / (1.0 + math.exp(-{args[0]})))"
    if e.fn == "clamp":
        return f"min(max({args[0]}, {args[1]}), {args[2]})"
    if e.fn == "where":
        return f"({args[1]} if {args[0]} else {args[2]})"
    assert e.fn == "softcap", e.fn
    return f"({args[1]} * math.tanh({args[0]} / {args[1]}))"
