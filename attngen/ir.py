"""The typed intermediate representation of a spec: frozen, validated once, serialisable, fingerprinted."""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from attngen.errors import ArgumentError

ValueType = Literal["int", "float", "bool"]

INDEX_VARS = ("b", "h", "hkv", "q", "k")
SIZES = ("B", "H", "HKV", "Q_LEN", "KV_LEN", "D")
DTYPES = ("f32", "f16", "bf16", "i32", "i64", "bool")
FLOAT_DTYPES = ("f32", "f16", "bf16")
DTYPE_BYTES: dict[str, int] = {"f32": 4, "f16": 2, "bf16": 2, "i32": 4, "i64": 8, "bool": 1}
DTYPE_VALUE_TYPE: dict[str, ValueType] = {
    "f32": "float", "f16": "float", "bf16": "float", "i32": "int", "i64": "int", "bool": "bool",
}

# Element-wise functions: name -> (number of arguments, result rule).
# "float": always float; "same": type of the (promoted) arguments; "int": int.
FUNCTIONS: dict[str, tuple[int, str]] = {
    "tanh": (1, "float"), "exp": (1, "float"), "exp2": (1, "float"), "log": (1, "float"),
    "log2": (1, "float"), "sqrt": (1, "float"), "rsqrt": (1, "float"), "sigmoid": (1, "float"),
    "abs": (1, "same"), "floor": (1, "int"), "ceil": (1, "int"),
    "min": (2, "same"), "max": (2, "same"), "clamp": (3, "same"), "softcap": (2, "float"),
    "where": (3, "same"),
}

ARITHMETIC_OPS = ("add", "sub", "mul", "div", "floordiv", "mod", "pow")
COMPARISON_OPS = ("eq", "ne", "lt", "le", "gt", "ge")
LOGICAL_OPS = ("and", "or")
BinaryOp = Literal["add", "sub", "mul", "div", "floordiv", "mod", "pow",
                   "eq", "ne", "lt", "le", "gt", "ge", "and", "or"]
UnaryOp = Literal["neg", "not"]


class Node(BaseModel):
    # inf must survive JSON: the fingerprint and the cache key are computed from it.
    model_config = ConfigDict(frozen=True, extra="forbid", ser_json_inf_nan="constants")


class Const(Node):
    kind: Literal["const"] = "const"
    type: ValueType
    value: Union[bool, int, float]


class Var(Node):
    """An index variable: b, h, hkv, q or k."""
    kind: Literal["var"] = "var"
    type: ValueType = "int"
    name: Literal["b", "h", "hkv", "q", "k"]


class Size(Node):
    """A problem size known at call time: B, H, HKV, Q_LEN, KV_LEN or D."""
    kind: Literal["size"] = "size"
    type: ValueType = "int"
    name: Literal["B", "H", "HKV", "Q_LEN", "KV_LEN", "D"]


class Score(Node):
    kind: Literal["score"] = "score"
    type: ValueType = "float"


class Param(Node):
    """A compile-time constant; its value lives in Spec.params."""
    kind: Literal["param"] = "param"
    type: ValueType
    name: str


class Load(Node):
    """An element of a tensor input; one int index per declared dim (none for a scalar)."""
    kind: Literal["load"] = "load"
    type: ValueType
    input: str
    index: tuple["Expr", ...]


class Unary(Node):
    kind: Literal["unary"] = "unary"
    type: ValueType
    op: UnaryOp
    operand: "Expr"


class Binary(Node):
    kind: Literal["binary"] = "binary"
    type: ValueType
    op: BinaryOp
    left: "Expr"
    right: "Expr"


class Call(Node):
    kind: Literal["call"] = "call"
    type: ValueType
    fn: str
    args: tuple["Expr", ...]


Expr = Annotated[Union[Const, Var, Size, Score, Param, Load, Unary, Binary, Call],
                 Field(discriminator="kind")]

for _cls in (Load, Unary, Binary, Call):
    _cls.model_rebuild()

Dim = Union[int, Literal["B", "H", "HKV", "Q_LEN", "KV_LEN", "*"]]


class ParamDecl(Node):
    name: str
    type: ValueType
    value: Union[int, float]


class InputDecl(Node):
    name: str
    dtype: Literal["f32", "f16", "bf16", "i32", "i64", "bool"]
    dims: tuple[Dim, ...]
    learnable: bool = False

    @property
    def value_type(self) -> ValueType:
        return DTYPE_VALUE_TYPE[self.dtype]


class Spec(Node):
    """A whole attention variant. `mask`, `score` and `scale` are None when the spec omits them."""
    name: str
    params: tuple[ParamDecl, ...] = ()
    inputs: tuple[InputDecl, ...] = ()
    mask: Expr | None = None
    score: Expr | None = None
    scale: Expr | None = None

    def param(self, name: str) -> ParamDecl:
        return next(p for p in self.params if p.name == name)

    def input(self, name: str) -> InputDecl:
        return next(i for i in self.inputs if i.name == name)

    @property
    def learnable_inputs(self) -> tuple[InputDecl, ...]:
        return tuple(i for i in self.inputs if i.learnable)

    def with_params(self, overrides: dict[str, int | float] | None) -> "Spec":
        """The same spec with some params given new values (build-time overrides)."""
        if not overrides:
            return self
        declared = {p.name: p for p in self.params}
        for name, value in overrides.items():
            if name not in declared:
                known = ", ".join(declared) or "none"
                raise ArgumentError(f"params: unknown param '{name}' (the spec declares: {known})")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ArgumentError(f"params: '{name}' must be a number, got {value!r}")
            if declared[name].type == "int" and not float(value).is_integer():
                raise ArgumentError(f"params: '{name}' is an int param and must be an integer, got {value!r}")
        params = tuple(
            p.model_copy(update={"value": (int(overrides[p.name]) if p.type == "int" else float(overrides[p.name]))})
            if p.name in overrides else p
            for p in self.params)
        return self.model_copy(update={"params": params})

    def fingerprint(self) -> str:
        """A stable hash of the meaning of the spec (params included, source text excluded)."""
        text = json.dumps(self.model_dump(mode="json"), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def children(expr: Expr) -> tuple[Expr, ...]:
    """The direct subexpressions of a node, in source order."""
    if isinstance(expr, Load):
        return expr.index
    if isinstance(expr, Unary):
        return (expr.operand,)
    if isinstance(expr, Binary):
        return (expr.left, expr.right)
    if isinstance(expr, Call):
        return expr.args
    return ()


def walk(expr: Expr):
    """Every node of an expression tree, parents before children."""
    yield expr
    for child in children(expr):
        yield from walk(child)


def uses(expr: Expr | None, cls: type, name: str | None = None) -> bool:
    """Whether an expression contains a node of class `cls` (with that name, if given)."""
    if expr is None:
        return False
    return any(isinstance(n, cls) and (name is None or getattr(n, "name", None) == name
                                       or getattr(n, "input", None) == name)
               for n in walk(expr))
