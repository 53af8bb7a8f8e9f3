"""The typed intermediate representation of a spec: frozen, validated once, serialisable, fingerprinted."""

from __future__ import annotations

import hashlib
import json
import keyword
import re
from collections import Counter
from typing import Annotated, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from attngen.errors import ArgumentError

ValueType = Literal["int", "float", "bool"]

INDEX_VARS = ("b", "h", "hkv", "q", "k")
SIZES = ("B", "H", "HKV", "Q_LEN", "KV_LEN", "D")
DTYPES = ("f32", "f16", "bf16", "i32", "i64", "bool")
FLOAT_DTYPES = ("f32", "f16", "bf16")
DTYPE_BYTES: dict[str, int] = {"f32": 4, "f16": 2, "bf16": 2, "i32": 4, "i64": 8, "bool": 1}
# The ranges of the int dtypes; an `int` of the language is an int64, as the reference computes it.
I32_RANGE = (-(2 ** 31), 2 ** 31 - 1)
I64_RANGE = (-(2 ** 63), 2 ** 63 - 1)
DTYPE_VALUE_TYPE: dict[str, ValueType] = {
    "f32": "float", "f16": "float", "bf16": "float", "i32": "int", "i64": "int", "bool": "bool",
}

# Element-wise functions: name -> (number of arguments, result rule).
# "float": always float; "same": type of the (promoted) arguments; "int": int.
FUNCTIONS: dict[str, tuple[int, str]] = {
    "tanh": (1, "float"), "exp": (1, "float"), "exp2": (1, "float"), "log": (1, "float"),
    "log2": (1, "float"), "sqrt": (1, "float"), "rsqrt": (1, "float"), "sigmoid": (1, "float"),
    "abs": (1, "same"), "floor": (1, "int"), "ceil": (1, "int"),
    "sin": (1, "float"), "cos": (1, "float"), "tan": (1, "float"), "atan": (1, "float"), "erf": (1, "float"),
    "sign": (1, "same"), "round": (1, "int"),
    "min": (2, "same"), "max": (2, "same"), "clamp": (3, "same"), "softcap": (2, "float"),
    "where": (3, "same"),
}

# Names the language itself gives a meaning: no param or input may take one.
BUILTIN_NAMES = frozenset({"true", "false", "inf", "causal", "causal_bottom_right", "attention", "param",
                           "input", "mask", "score", "scale", "learnable", "and", "or", "not",
                           *INDEX_VARS, *SIZES, "Q_OFFSET", *FUNCTIONS})
# Inputs are passed by keyword beside these: attn(q, k, v, *, kv_len=..., q_offset=..., page_table=...,
# cu_seqlens_q=..., cu_seqlens_k=..., max_seqlen_q=..., max_seqlen_k=..., return_lse=..., tile_tables=...,
# dropout_p=..., generator=..., deterministic=..., check_values=..., **inputs), and Attention.__call__ takes
# `self`; an input of one of these names could never be passed.
CALL_ARGUMENTS = frozenset({"q", "k", "v", "self", "kv_len", "q_offset", "page_table", "cu_seqlens_q", "cu_seqlens_k",
                            "max_seqlen_q", "max_seqlen_k", "return_lse", "tile_tables", "dropout_p", "generator",
                            "deterministic", "check_values"})
# Names become parts of file names, module names and kernel parameter names (`doc_ptr`): ASCII
# identifiers of bounded length, so no name can carry a path, a quote or code.
MAX_NAME_LENGTH = 64
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def name_problem(name: object, declared: bool = True) -> str | None:
    """Why `name` cannot name a spec (declared=False) or one of its params or inputs, or None if it can."""
    if not isinstance(name, str) or not _IDENTIFIER.match(name):
        return f"a name must be an ASCII identifier (letters, digits, '_'), got {name!r}"
    if len(name) > MAX_NAME_LENGTH:
        return f"a name must be at most {MAX_NAME_LENGTH} characters, got {len(name)}"
    if keyword.iskeyword(name):
        return f"'{name}' is a Python keyword (it could not be passed as a keyword argument); choose another name"
    if declared and name in BUILTIN_NAMES:
        return f"'{name}' is a reserved name; choose another name"
    if declared and name in CALL_ARGUMENTS:
        return f"'{name}' is an argument of the attention call itself; choose another name"
    return None


def _checked_name(name: str, declared: bool = True) -> str:
    problem = name_problem(name, declared)
    if problem is not None:
        raise ValueError(problem)
    return name


# The name of a param or input, as every IR node that carries one declares it.
DeclaredName = Annotated[str, AfterValidator(lambda name: _checked_name(name))]


ARITHMETIC_OPS = ("add", "sub", "mul", "div", "floordiv", "mod", "pow")
# Ints only, with Python's meaning (two's complement of unbounded width; `>>` floors). On bools `&`,
# `|`, `^` and `~` are the logical operators, which lowering writes as and, or, != and not.
BITWISE_OPS = ("bitand", "bitor", "bitxor", "lshift", "rshift")
SHIFT_OPS = ("lshift", "rshift")
# A shift count lies in 0 .. MAX_SHIFT (checked at compile time): int64's and torch's shifts are
# Python's there.
MAX_SHIFT = 63
COMPARISON_OPS = ("eq", "ne", "lt", "le", "gt", "ge")
LOGICAL_OPS = ("and", "or")
BinaryOp = Literal["add", "sub", "mul", "div", "floordiv", "mod", "pow", "bitand", "bitor", "bitxor", "lshift",
                   "rshift", "eq", "ne", "lt", "le", "gt", "ge", "and", "or"]
UnaryOp = Literal["neg", "not", "invert"]


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
    """A problem size known at call time: B, H, HKV, Q_LEN, KV_LEN or D; or Q_OFFSET, the position of
    query row 0 (q_offset[b] in a cache call, 0 in training and packed calls), which no spec text names:
    only `causal_bottom_right` reads it (BUILTIN_MASKS)."""
    kind: Literal["size"] = "size"
    type: ValueType = "int"
    name: Literal["B", "H", "HKV", "Q_LEN", "KV_LEN", "D", "Q_OFFSET"]


class Score(Node):
    kind: Literal["score"] = "score"
    type: ValueType = "float"


class Param(Node):
    """A compile-time constant; its value lives in Spec.params."""
    kind: Literal["param"] = "param"
    type: ValueType
    name: DeclaredName


class Load(Node):
    """An element of a tensor input; one int index per declared dim (none for a scalar)."""
    kind: Literal["load"] = "load"
    type: ValueType
    input: DeclaredName
    index: tuple["Expr", ...]


ReduceOp = Literal["sum", "max", "min", "mean"]
# The reductions over whole dimensions of an input, by name; `max` and `min` of two arguments stay FUNCTIONS.
REDUCTIONS = ("sum", "max", "min", "mean")


def reduction_type(op: str, dtype: str) -> ValueType:
    """The type of `op` over an input of `dtype`: mean is float; sum of bools counts (int); max and min of
    bools are any and all (bool); otherwise the input's value type."""
    if op == "mean":
        return "float"
    if op == "sum" and dtype == "bool":
        return "int"
    return DTYPE_VALUE_TYPE[dtype]


class Reduce(Node):
    """sum, max, min or mean of an input over the dims written ':' (None in `index`), read at the other
    indices, one int expression each: `sum(x[b, :])` is Reduce(op='sum', input='x', index=(Var(b), None))."""
    kind: Literal["reduce"] = "reduce"
    type: ValueType
    op: ReduceOp
    input: DeclaredName
    index: tuple[Union["Expr", None], ...]

    @property
    def reduced_dims(self) -> tuple[int, ...]:
        return tuple(d for d, i in enumerate(self.index) if i is None)


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


Expr = Annotated[Union[Const, Var, Size, Score, Param, Load, Reduce, Unary, Binary, Call],
                 Field(discriminator="kind")]

for _cls in (Load, Reduce, Unary, Binary, Call):
    _cls.model_rebuild()


def _int(op: str, left: Expr, right: Expr) -> Binary:
    return Binary(type="int", op=op, left=left, right=right)


# The builtin masks. `causal_bottom_right` aligns the last query row with the last key: row
# i = q - Q_OFFSET sees keys k <= i + KV_LEN - Q_LEN. Rows, not positions: a cache call has already
# placed row i at position q_offset[b] + i, and shifting that position again would count the offset twice.
BUILTIN_MASKS: dict[str, Expr] = {
    "causal": Binary(type="bool", op="ge", left=Var(name="q"), right=Var(name="k")),
    "causal_bottom_right": Binary(
        type="bool", op="ge", left=_int("add", _int("sub", Var(name="q"), Size(name="Q_OFFSET")),
                                        _int("sub", Size(name="KV_LEN"), Size(name="Q_LEN"))),
        right=Var(name="k")),
}

Dim = Union[int, Literal["B", "H", "HKV", "Q_LEN", "KV_LEN", "*"]]


class ParamDecl(Node):
    name: DeclaredName
    type: ValueType
    value: Union[int, float]


class InputDecl(Node):
    name: DeclaredName
    dtype: Literal["f32", "f16", "bf16", "i32", "i64", "bool"]
    dims: tuple[Dim, ...]
    learnable: bool = False

    @property
    def value_type(self) -> ValueType:
        return DTYPE_VALUE_TYPE[self.dtype]


# How a row's scores become the weights of its values: the softmax over the row's allowed keys, or
# sigmoid(score') of each allowed key on its own (no sum over the row, so no LSE).
NORMALIZERS = ("softmax", "sigmoid")
Normalizer = Literal["softmax", "sigmoid"]


class Spec(Node):
    """A whole attention variant. `mask`, `score`, `scale` and `sink` are None when the spec omits them.
    `sink` is a logit with no value in every row's softmax (attention sinks): a float of b, h, hkv, q,
    sizes, params and inputs, never of k or score. `normalize` is one of NORMALIZERS; a sink needs softmax."""
    name: str
    params: tuple[ParamDecl, ...] = ()
    inputs: tuple[InputDecl, ...] = ()
    mask: Expr | None = None
    score: Expr | None = None
    scale: Expr | None = None
    sink: Expr | None = None
    normalize: Normalizer = "softmax"

    @field_validator("name")
    @classmethod
    def _spec_name(cls, name: str) -> str:
        return _checked_name(name, declared=False)

    @model_validator(mode="after")
    def _references(self) -> "Spec":
        # A Spec may be built in Python, not only lowered from text: every name an expression uses
        # must be declared, with its declared type and arity, so later stages can trust the IR.
        declared = Counter([p.name for p in self.params] + [i.name for i in self.inputs])
        twice = sorted(n for n, count in declared.items() if count > 1)
        if twice:
            raise ValueError(f"names must be declared once, got {', '.join(map(repr, twice))} twice")
        params = {p.name: p for p in self.params}
        inputs = {i.name: i for i in self.inputs}
        for item, expected in (("mask", ("bool",)), ("score", ("int", "float")), ("scale", ("int", "float")),
                               ("sink", ("float",))):
            expr = getattr(self, item)
            if expr is None:
                continue
            if expr.type not in expected:
                raise ValueError(f"{item} must be of type {' or '.join(expected)}, got {expr.type}")
            for node in walk(expr):
                if isinstance(node, Score) and item != "score":
                    raise ValueError(f"{item} may not use 'score'")
                if isinstance(node, Param) and (node.name not in params or params[node.name].type != node.type):
                    raise ValueError(f"{item} uses param {node.name!r} as {node.type}, but the spec declares "
                                     + (f"it {params[node.name].type}" if node.name in params else "no such param"))
                if isinstance(node, Load):
                    decl = inputs.get(node.input)
                    if decl is None or len(decl.dims) != len(node.index) or decl.value_type != node.type:
                        raise ValueError(f"{item} reads input {node.input!r} with {len(node.index)} index(es) as "
                                         f"{node.type}, but the spec declares "
                                         + (f"{decl.dtype}[{', '.join(map(str, decl.dims))}]" if decl else
                                            "no such input"))
                if isinstance(node, Reduce):
                    decl = inputs.get(node.input)
                    if (decl is None or len(decl.dims) != len(node.index) or not node.reduced_dims
                            or reduction_type(node.op, decl.dtype) != node.type):
                        raise ValueError(f"{item} reduces input {node.input!r} as {node.op}() over dims "
                                         f"{node.reduced_dims} of {len(node.index)} to {node.type}, but the spec "
                                         f"declares " + (f"{decl.dtype}[{', '.join(map(str, decl.dims))}]" if decl
                                                         else "no such input"))
                if item == "scale" and isinstance(node, (Var, Load, Reduce)):
                    raise ValueError("scale may use only D, params and numbers")
                if item == "sink" and isinstance(node, Var) and node.name == "k":
                    raise ValueError("sink may not use 'k': a sink is one logit per query row")
        if self.sink is not None and self.normalize != "softmax":
            raise ValueError(f"a sink needs normalize: softmax, got normalize: {self.normalize} (a sink is a term of "
                             f"the softmax's sum over the row)")
        return self

    def param(self, name: str) -> ParamDecl:
        return next(p for p in self.params if p.name == name)

    def input(self, name: str) -> InputDecl:
        return next(i for i in self.inputs if i.name == name)

    @property
    def param_values(self) -> dict[str, int | float]:
        """Each param's value by name, as every stage reads them."""
        return {p.name: p.value for p in self.params}

    @property
    def sigmoid(self) -> bool:
        """Whether each key's weight is sigmoid(score') on its own (normalize: sigmoid): no row sum, no LSE."""
        return self.normalize == "sigmoid"

    @property
    def learnable_inputs(self) -> tuple[InputDecl, ...]:
        return tuple(i for i in self.inputs if i.learnable)

    def fingerprint(self) -> str:
        """A stable hash of the meaning of the spec (params included, source text excluded)."""
        # A spec without a sink, or with the default softmax, hashes as it did before those items existed: its
        # fingerprint names cached modules.
        defaults = {"sink"} if self.sink is None else set()
        defaults |= {"normalize"} if self.normalize == "softmax" else set()
        text = json.dumps(self.model_dump(mode="json", exclude=defaults or None), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


class Reduction(Node):
    """One distinct reduction of a spec as the kernels read it: input `name` (no user declares it), the
    reduction `op` of input `source` over its dims `dims`, computed once per call before the kernels."""
    name: DeclaredName
    op: ReduceOp
    source: DeclaredName
    dims: tuple[int, ...]


def _reduced_dtype(op: str, dtype: str) -> str:
    """The dtype the kernels read a reduction in: floats and means in f32, int and bool sums in i64
    (exact), int max and min in the input's dtype, bool max and min as bool."""
    return {"float": "f32", "bool": "bool"}.get(reduction_type(op, dtype), "i64" if op == "sum" else dtype)


def without_reductions(spec: Spec) -> tuple[Spec, tuple[Reduction, ...]]:
    """`spec` with every reduction read as a load of an input of its own (appended to the inputs, learnable
    iff its source is), and those reductions: the spec the kernels run, and what the host computes first."""
    declared = {p.name for p in spec.params} | {i.name for i in spec.inputs}
    found: dict[tuple, Reduction] = {}

    def replaced(expr: Expr | None) -> Expr | None:
        if expr is None:
            return None
        if isinstance(expr, Reduce):
            key = (expr.op, expr.input, expr.reduced_dims)
            if key not in found:
                n = len(found)
                name = f"{expr.op}{n}_{expr.input}"[:MAX_NAME_LENGTH]
                while name in declared or name in BUILTIN_NAMES or name in CALL_ARGUMENTS:
                    n += 1
                    name = f"{expr.op}{n}_{expr.input}"[:MAX_NAME_LENGTH]
                declared.add(name)
                found[key] = Reduction(name=name, op=expr.op, source=expr.input, dims=expr.reduced_dims)
            return Load(type=expr.type, input=found[key].name,
                        index=tuple(replaced(i) for i in expr.index if i is not None))
        if isinstance(expr, Load):
            return expr.model_copy(update={"index": tuple(replaced(i) for i in expr.index)})
        if isinstance(expr, Unary):
            return expr.model_copy(update={"operand": replaced(expr.operand)})
        if isinstance(expr, Binary):
            return expr.model_copy(update={"left": replaced(expr.left), "right": replaced(expr.right)})
        if isinstance(expr, Call):
            return expr.model_copy(update={"args": tuple(replaced(a) for a in expr.args)})
        return expr

    items = {item: replaced(getattr(spec, item)) for item in ("mask", "score", "scale", "sink")}
    if not found:
        return spec, ()
    derived = []
    for r in found.values():
        source = spec.input(r.source)
        derived.append(InputDecl(name=r.name, dtype=_reduced_dtype(r.op, source.dtype),
                                 dims=tuple(d for i, d in enumerate(source.dims) if i not in r.dims),
                                 learnable=source.learnable))
    return Spec.model_validate({**spec.model_dump(), **{k: (v.model_dump() if v is not None else None)
                                                        for k, v in items.items()},
                                "inputs": [i.model_dump() for i in (*spec.inputs, *derived)]}), tuple(found.values())


def revalidated(spec: Spec) -> Spec:
    """`spec` validated anew from its fields. pydantic's model_copy and model_construct skip
    validation, so a Spec object proves nothing: whatever turns one into code or a file name
    takes it through here first."""
    if not isinstance(spec, Spec):
        raise ArgumentError(f"spec must be an attngen.Spec, got {type(spec).__name__}")
    try:
        return Spec.model_validate(spec.model_dump(warnings=False))
    except (ValueError, TypeError, AttributeError) as e:  # pydantic's ValidationError is a ValueError
        first = e.errors()[0] if isinstance(e, ValidationError) else {"loc": (), "msg": str(e)}
        where = ".".join(map(str, first["loc"]))
        raise ArgumentError(f"spec must be a valid Spec (model_copy and model_construct skip validation), got "
                            f"one whose {where or 'fields'} is invalid: {first['msg'].removeprefix('Value error, ')}"
                            ) from None


def children(expr: Expr) -> tuple[Expr, ...]:
    """The direct subexpressions of a node, in source order."""
    if isinstance(expr, Load):
        return expr.index
    if isinstance(expr, Reduce):
        return tuple(i for i in expr.index if i is not None)
    if isinstance(expr, Unary):
        return (expr.operand,)
    if isinstance(expr, Binary):
        return (expr.left, expr.right)
    if isinstance(expr, Call):
        return expr.args
    return ()


def rewrite(expr: Expr | None, replace) -> Expr | None:
    """`expr` with every node for which replace(node) is not None replaced by it (a replaced node's children
    are not visited). Nodes are rebuilt by model_copy, which skips validation: callers that make a Spec of the
    result validate it anew (revalidated, model_validate)."""
    if expr is None:
        return None
    found = replace(expr)
    if found is not None:
        return found
    if isinstance(expr, Load):
        return expr.model_copy(update={"index": tuple(rewrite(i, replace) for i in expr.index)})
    if isinstance(expr, Reduce):
        return expr.model_copy(update={"index": tuple(rewrite(i, replace) if i is not None else None
                                                      for i in expr.index)})
    if isinstance(expr, Unary):
        return expr.model_copy(update={"operand": rewrite(expr.operand, replace)})
    if isinstance(expr, Binary):
        return expr.model_copy(update={"left": rewrite(expr.left, replace), "right": rewrite(expr.right, replace)})
    if isinstance(expr, Call):
        return expr.model_copy(update={"args": tuple(rewrite(a, replace) for a in expr.args)})
    return expr


def walk(expr: Expr):
    """Every node of an expression tree, parents before children."""
    yield expr
    for child in children(expr):
        yield from walk(child)


def postorder(expr: Expr):
    """Every node of an expression, children before parents, without recursion."""
    stack = [(expr, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            yield node
            continue
        stack.append((node, True))
        stack.extend((child, False) for child in reversed(children(node)))



def uses(expr: Expr | None, cls: type, name: str | None = None) -> bool:
    """Whether an expression contains a node of class `cls` (with that name, if given)."""
    if expr is None:
        return False
    return any(isinstance(n, cls) and (name is None or getattr(n, "name", None) == name
                                       or getattr(n, "input", None) == name)
               for n in walk(expr))
