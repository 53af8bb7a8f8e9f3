"""Lowers a parse tree into the typed, validated IR (`Spec`), one method per grammar rule."""

from __future__ import annotations

import difflib
import math

from lark import Token, Tree

from attngen import ir
from attngen.frontend import checks
from attngen.errors import Position, SpecError

_BUILTIN_CONSTANTS = {"true": ("bool", True), "false": ("bool", False), "inf": ("float", math.inf)}
_BUILTIN_MASKS = tuple(ir.BUILTIN_MASKS)
assert {*_BUILTIN_CONSTANTS, *_BUILTIN_MASKS} <= ir.BUILTIN_NAMES  # no input may shadow them
_COMPARISONS = {"==": "eq", "!=": "ne", "<": "lt", "<=": "le", ">": "gt", ">=": "ge"}
_OP_TEXT = {"add": "+", "sub": "-", "mul": "*", "div": "/", "floordiv": "//", "mod": "%",
            "pow": "**", "and": "and", "or": "or", "bitand": "&", "bitor": "|", "bitxor": "^",
            "lshift": "<<", "rshift": ">>"}
# On bools `&`, `|`, `^` and `~` are the logical operators, as in torch: the IR says so in its own words.
_LOGICAL_BITWISE = {"bitand": "and", "bitor": "or", "bitxor": "ne"}
_DIM_NAMES = ("B", "H", "HKV", "Q_LEN", "KV_LEN")
# Every later stage walks expressions recursively (pydantic serialises at most 255 levels, and the
# backward pass differentiates, which nests deeper): expressions nesting deeper than this are
# refused, with the depth measured on the parse tree, without recursion, before lowering.
MAX_DEPTH = 100
# A run of one operator (`a + b - c + ...`, `a * b * ...`, `a and b and ...`, `a or b or ...`) of
# more operands than this nests as a balanced tree, about log2(operands) deep, not as the
# left-leaning chain the grammar reads: a sum of a thousand terms is flat text, and no stage
# should recurse through it a thousand deep. Shorter runs keep the order written, and so do runs
# mixing int and float operands: left to right, an int operand after a float one is added as a float,
# and grouping it with other ints would make an int sum of them (which may not fit in int64). A
# balanced sum adds pairwise (in floats more accurately than left to right; ints are exact either
# way), and its printed text reads back as the same tree while the run has at most 2**(_RUN - 1)
# operands. The depth of what lowering built is checked again (_ir_depth): a long mixed run nests
# as deep as it is long.
_RUN = 16
# The grammar rules that continue a run, by the rule of its head: `-` continues a sum.
_RUNS = {"add": ("add", "sub"), "sub": ("add", "sub"), "mul": ("mul",), "and_op": ("and_op",),
         "or_op": ("or_op",)}
_RUN_OPS = {"add": "add", "sub": "sub", "mul": "mul", "and_op": "and", "or_op": "or"}


def position(node: Tree | Token) -> Position:
    """The span of a tree or token (end column kept only when it ends on the same line)."""
    if isinstance(node, Token):
        end = node.end_column if node.end_line == node.line else None
        return Position(node.line, node.column, end)
    meta = node.meta
    end = meta.end_column if getattr(meta, "end_line", None) == meta.line else None
    return Position(meta.line, meta.column, end)


def _numeric(t: str) -> bool:
    return t in ("int", "float")


def _promote(*types: str) -> str:
    return "float" if "float" in types else "int"


def _run(tree: Tree) -> list[tuple[str | None, Tree]]:
    """The operands of the run of one operator that `tree` heads, x0 op1 x1 op2 x2 ..., each with
    the rule joining it to those before it (None for x0); found without recursion."""
    rules = _RUNS[tree.data]
    tail, node = [], tree
    while isinstance(node, Tree) and node.data in rules:
        left, right = node.children
        tail.append((node.data, right))
        node = left
    return [(None, node), *reversed(tail)]


def _balanced(run: list, join, balance: bool = True):
    """A run as a tree, `join(left, rule, right)` making each node: left-leaning as written up to
    _RUN operands (or whenever `balance` is false), else halved down to single operands."""
    if len(run) <= _RUN or not balance:
        tree = run[0][1]
        for rule, operand in run[1:]:
            tree = join(tree, rule, operand)
        return tree
    return _halves(run, join)


def _halves(run: list, join):
    if len(run) == 1:
        return run[0][1]
    middle = len(run) // 2
    rule, first = run[middle]
    # A `-` between the halves negates the whole right half: a - b - c + d = (a - b) - (c - d).
    flip = {"add": "sub", "sub": "add"} if rule == "sub" else {}
    right = [(None, first), *((flip.get(r, r), operand) for r, operand in run[middle + 1:])]
    return join(_halves(run[:middle], join), rule, _halves(right, join))


def _depth(tree: Tree) -> int:
    """How deeply an expression's IR nests, measured on its parse tree without recursion: a run
    nests as `_balanced` builds it, a chained comparison of n parts n - 1 deeper than its parts."""
    depths: dict[int, int] = {}
    stack = [(tree, False)]
    while stack:
        node, ready = stack.pop()
        run = _run(node) if node.data in _RUNS else None
        parts = [operand for _, operand in run] if run else [c for c in node.children if isinstance(c, Tree)]
        if not ready:
            stack.append((node, True))
            stack.extend((part, False) for part in parts)
        elif run:
            depths[id(node)] = _balanced([(rule, depths[id(operand)]) for rule, operand in run],
                                         lambda left, rule, right: 1 + max(left, right))
        else:
            extra = len(node.children) // 2 - 1 if node.data == "compare" else 0
            depths[id(node)] = 1 + extra + max((depths[id(part)] for part in parts), default=0)
    return depths[id(tree)]


def _ir_depth(expr: ir.Expr) -> int:
    """How deeply a lowered expression nests, without recursion."""
    deepest, stack = 0, [(expr, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in ir.children(node))
    return deepest


def _int64(value: int, what: str, token: Token) -> int:
    if not ir.I64_RANGE[0] <= value <= ir.I64_RANGE[1]:
        got = value if len(str(value)) <= 40 else f"a {len(str(abs(value)))}-digit number"
        raise SpecError(f"{what} must fit in int64 ({ir.I64_RANGE[0]} .. {ir.I64_RANGE[1]}), got {got}", position(token))
    return value


def _number(token: Token) -> ir.Const:
    text = str(token)
    if any(c in text for c in ".eE"):
        return ir.Const(type="float", value=float(text))
    return ir.Const(type="int", value=int(text))


class Lowerer:
    """Walks one parse tree; `context` is the item being lowered ('mask', 'score', 'scale' or 'sink')."""

    def __init__(self, check_numbers: bool = True):
        self.check_numbers = check_numbers
        self.params: dict[str, ir.ParamDecl] = {}
        self.inputs: dict[str, ir.InputDecl] = {}
        self.items: dict[str, tuple[ir.Expr, Position]] = {}
        # `normalize:` names a normaliser rather than holding an expression: (its name, the item's position).
        self.normalize: tuple[str, Position] | None = None
        self.spec_name: str | None = None
        self.context = ""
        # id(node) -> (node, where its text is), for positioning problems found in the whole spec;
        # the node is kept, so no id is reused while the map lives.
        self.positions: dict[int, tuple[ir.Expr, Position]] = {}

    # --- the file --------------------------------------------------------------------------
    def start(self, tree: Tree) -> ir.Spec:
        header, *items = tree.children
        self.header(header)
        # Declarations first, so an item may use a name declared below it (sorted by kind, not
        # by `i not in declarations`: lark compares trees by value, which made this quadratic).
        declarations = [i for i in items if i.data in ("param_decl", "input_decl")]
        for item in declarations + [i for i in items if i.data not in ("param_decl", "input_decl")]:
            getattr(self, item.data)(item)
        spec = ir.Spec(
            name=self.spec_name,
            params=tuple(self.params.values()),
            inputs=tuple(self.inputs.values()),
            mask=self.items.get("mask", (None,))[0],
            score=self.items.get("score", (None,))[0],
            scale=self.items.get("scale", (None,))[0],
            sink=self.items.get("sink", (None,))[0],
            normalize=self.normalize[0] if self.normalize is not None else "softmax",
        )
        # The number checks need the whole spec (a divisor may be a param; an overflow depends on
        # the inputs' dtypes), so they run here, and each problem is placed by its node's identity.
        for problem in (checks.problems(spec)[:1] if self.check_numbers else ()):
            raise SpecError(problem.message, self._where(problem.node))
        return spec

    def _where(self, node: ir.Expr) -> Position:
        """Where a node of the spec came from: its own text, else (made while lowering, as the
        parts of `causal` are) the item that holds it."""
        if id(node) in self.positions:
            return self.positions[id(node)][1]
        return next(where for expr, where in self.items.values() if any(n is node for n in ir.walk(expr)))

    def header(self, tree: Tree) -> None:
        (name,) = tree.children
        problem = ir.name_problem(str(name), declared=False)
        if problem is not None:
            raise SpecError(f"the spec's {problem}", position(name))
        self.spec_name = str(name)

    def _declare(self, token: Token) -> str:
        name = str(token)
        problem = ir.name_problem(name)
        if problem is not None:
            raise SpecError(problem, position(token))
        if name in self.params or name in self.inputs:
            raise SpecError(f"'{name}' is declared twice", position(token))
        return name

    def param_decl(self, tree: Tree) -> None:
        token, number = tree.children
        name = self._declare(token)
        value = getattr(self, number.data)(number)
        if value.type == "int":
            _int64(value.value, f"params: '{name}'", number.children[0])
        elif not math.isfinite(value.value):
            raise SpecError(f"params: '{name}' must be a finite number, got {value.value!r}", position(number))
        self.params[name] = ir.ParamDecl(name=name, type=value.type, value=value.value)

    def signed_number(self, tree: Tree) -> ir.Const:
        return _number(tree.children[0])

    def negative_number(self, tree: Tree) -> ir.Const:
        const = _number(tree.children[0])
        return ir.Const(type=const.type, value=-const.value)

    def input_decl(self, tree: Tree) -> None:
        token, dtype, *dims, learnable = tree.children
        name = self._declare(token)
        if str(dtype) not in ir.DTYPES:
            raise SpecError(f"dtype must be one of {', '.join(ir.DTYPES)}, got '{dtype}'", position(dtype))
        lowered_dims = tuple(self._dim(d) for d in dims if d is not None)
        if learnable is not None and str(dtype) not in ir.FLOAT_DTYPES:
            raise SpecError(f"a learnable input must have a float dtype (f32, f16, bf16), got '{dtype}'",
                            position(learnable))
        self.inputs[name] = ir.InputDecl(name=name, dtype=str(dtype), dims=lowered_dims,
                                         learnable=learnable is not None)

    def _dim(self, tree: Tree):
        if tree.data == "any_dim":
            return "*"
        (token,) = tree.children
        if token.type == "NUMBER":
            if not str(token).isdigit() or int(token) < 1:
                raise SpecError(f"a dim must be a positive integer, got '{token}'", position(token))
            return int(token)
        if str(token) not in _DIM_NAMES:
            raise SpecError(f"a dim must be one of {', '.join(_DIM_NAMES)}, an integer or '*', "
                            f"got '{token}'", position(token))
        return str(token)

    def _item(self, kind: str, tree: Tree) -> ir.Expr:
        if kind in self.items:
            first = self.items[kind][1].line
            raise SpecError(f"duplicate '{kind}:' (the first is at line {first})", position(tree))
        self.context = kind
        depth = _depth(tree.children[0])
        if depth > MAX_DEPTH:
            raise SpecError(f"expression nests too deeply ({depth} levels; at most {MAX_DEPTH})",
                            position(tree.children[0]))
        expr = self.expr(tree.children[0])
        depth = _ir_depth(expr)
        if depth > MAX_DEPTH:
            raise SpecError(f"expression nests too deeply ({depth} levels; at most {MAX_DEPTH}): a run of "
                            f"'+', '-' or '*' mixing int and float operands keeps its written order, one level "
                            f"an operand", position(tree.children[0]))
        self.items[kind] = (expr, position(tree))
        return expr

    def mask_item(self, tree: Tree) -> None:
        expr = self._item("mask", tree)
        if expr.type != "bool":
            raise SpecError(f"mask must be a boolean expression, got {expr.type}",
                            position(tree.children[0]))

    def score_item(self, tree: Tree) -> None:
        expr = self._item("score", tree)
        if not _numeric(expr.type):
            raise SpecError(f"score must be a number, got {expr.type}", position(tree.children[0]))

    def scale_item(self, tree: Tree) -> None:
        expr = self._item("scale", tree)
        if not _numeric(expr.type):
            raise SpecError(f"scale must be a number, got {expr.type}", position(tree.children[0]))

    def sink_item(self, tree: Tree) -> None:
        expr = self._item("sink", tree)
        if expr.type != "float":
            hint = " (write a float, e.g. '1.0 * x')" if expr.type == "int" else ""
            raise SpecError(f"sink must be a float expression, got {expr.type}{hint}", position(tree.children[0]))
        self._check_sink_normalizer()

    def normalize_item(self, tree: Tree) -> None:
        (token,) = tree.children
        if self.normalize is not None:
            raise SpecError(f"duplicate 'normalize:' (the first is at line {self.normalize[1].line})", position(tree))
        name = str(token)
        if name not in ir.NORMALIZERS:
            close = difflib.get_close_matches(name, ir.NORMALIZERS, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise SpecError(f"normalize must be {' or '.join(ir.NORMALIZERS)}, got '{name}'{hint}", position(token))
        self.normalize = (name, position(tree))
        self._check_sink_normalizer()

    def _check_sink_normalizer(self) -> None:
        """A sink is a term of the softmax's sum over a row, which sigmoid attention does not form: the two
        items are refused together, at whichever of them comes second."""
        if "sink" not in self.items or self.normalize is None or self.normalize[0] == "softmax":
            return
        sink, normalize = self.items["sink"][1], self.normalize[1]
        if (sink.line, sink.column) > (normalize.line, normalize.column):
            raise SpecError(f"a sink needs normalize: softmax, but line {normalize.line} says "
                            f"'normalize: {self.normalize[0]}' (a sink is a term of the softmax's sum over a row)",
                            sink)
        raise SpecError(f"normalize: {self.normalize[0]} cannot have a sink (line {sink.line}): a sink is a term of the "
                        f"softmax's sum over a row, which {self.normalize[0]} attention does not form", normalize)

    # --- expressions -----------------------------------------------------------------------
    def expr(self, node: Tree | Token) -> ir.Expr:
        lowered = getattr(self, node.data)(node)
        self.positions.setdefault(id(lowered), (lowered, position(node)))
        return lowered

    def number(self, tree: Tree) -> ir.Expr:
        const = _number(tree.children[0])
        if const.type == "int":
            _int64(const.value, "an int literal", tree.children[0])
        return const

    def score_ref(self, tree: Tree) -> ir.Expr:
        if self.context != "score":
            why = {"mask": " (the mask must be decidable from positions alone)",
                   "sink": " (a sink is one logit per query row, before any key is scored)"}.get(
                       self.context, " (the scale may use only D, params and numbers)")
            raise SpecError(f"'{self.context}' may not use 'score': only 'score:' can read it{why}",
                            position(tree))
        return ir.Score()

    def name(self, tree: Tree) -> ir.Expr:
        (token,) = tree.children
        name = str(token)
        where = position(token)
        if name in _BUILTIN_CONSTANTS:
            t, v = _BUILTIN_CONSTANTS[name]
            return ir.Const(type=t, value=v)
        if self.context == "scale" and name not in self.params and name != "D":
            raise SpecError(f"scale may use only D, params and numbers, got '{name}'", where)
        if self.context == "sink" and name == "k":
            raise SpecError("'sink' may not use 'k': a sink is one logit per query row, shared by all its keys",
                            where)
        if name in _BUILTIN_MASKS:
            # A copy of its own: positions are found by node identity.
            return ir.BUILTIN_MASKS[name].model_copy(deep=True)
        if name in ir.INDEX_VARS:
            return ir.Var(name=name)
        if name in ir.SIZES:
            return ir.Size(name=name)
        if name in self.params:
            return ir.Param(type=self.params[name].type, name=name)
        if name in self.inputs:
            decl = self.inputs[name]
            if decl.dims:
                raise SpecError(f"input '{name}' has {len(decl.dims)} dim(s): index it as "
                                f"{name}[{', '.join('...' for _ in decl.dims)}]", where)
            return ir.Load(type=decl.value_type, input=name, index=())
        if name in ir.FUNCTIONS:
            raise SpecError(f"'{name}' is a function: call it as {name}(...)", where)
        known = (list(self.params) + list(self.inputs) + list(ir.INDEX_VARS) + list(ir.SIZES)
                 + list(_BUILTIN_MASKS) + list(_BUILTIN_CONSTANTS))
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise SpecError(f"unknown name '{name}'{hint}", where)

    def index(self, tree: Tree) -> ir.Expr:
        token, *indices = tree.children
        name = str(token)
        if self.context == "scale":
            raise SpecError(f"scale may use only D, params and numbers, got '{name}'", position(token))
        if name not in self.inputs:
            raise SpecError(f"only inputs can be indexed, and '{name}' is not an input", position(token))
        decl = self.inputs[name]
        indices = [i for i in indices if i is not None]
        if len(indices) != len(decl.dims):
            raise SpecError(f"input '{name}' has {len(decl.dims)} dim(s), indexed with {len(indices)}",
                            position(tree))
        lowered = []
        for node in indices:
            if isinstance(node, Tree) and node.data == "whole":
                raise SpecError("':' (a whole dim) is only allowed inside sum(), max(), min() or mean(), as in "
                                f"sum({name}[..., :])", position(node))
            e = self.expr(node)
            if e.type != "int":
                raise SpecError(f"an index of '{name}' must be an int, got {e.type}", position(node))
            lowered.append(e)
        return ir.Load(type=decl.value_type, input=name, index=tuple(lowered))

    def _reduce(self, fn: str, tree: Tree, node: Tree) -> ir.Expr:
        """sum/max/min/mean(x[..., :, ...]): x reduced over its ':' dims, read at its other indices."""
        token, *indices = node.children
        name = str(token)
        if self.context == "scale":
            raise SpecError(f"scale may use only D, params and numbers, got '{name}'", position(token))
        if name not in self.inputs:
            raise SpecError(f"only inputs can be reduced, and '{name}' is not an input", position(token))
        decl = self.inputs[name]
        indices = [i for i in indices if i is not None]
        if len(indices) != len(decl.dims):
            raise SpecError(f"input '{name}' has {len(decl.dims)} dim(s), indexed with {len(indices)}",
                            position(node))
        lowered = []
        for i in indices:
            if isinstance(i, Tree) and i.data == "whole":
                lowered.append(None)
                continue
            e = self.expr(i)
            if e.type != "int":
                raise SpecError(f"an index of '{name}' must be an int, got {e.type}", position(i))
            lowered.append(e)
        return ir.Reduce(type=ir.reduction_type(fn, decl.dtype), op=fn, input=name, index=tuple(lowered))

    def call(self, tree: Tree) -> ir.Expr:
        token, *args = tree.children
        fn = str(token)
        nodes = [a for a in args if a is not None]
        if fn in ir.REDUCTIONS and (fn not in ir.FUNCTIONS or len(nodes) == 1):
            whole = (len(nodes) == 1 and isinstance(nodes[0], Tree) and nodes[0].data == "index"
                     and any(isinstance(i, Tree) and i.data == "whole" for i in nodes[0].children))
            if not whole:
                if fn in ir.FUNCTIONS:
                    raise SpecError(f"{fn}() takes 2 argument(s), or one input read with ':' over the dims it "
                                    f"reduces (as in {fn}(x[b, :])), got 1 without ':'", position(tree))
                raise SpecError(f"{fn}() takes one input read with ':' over the dims it reduces, as in "
                                f"{fn}(x[b, :]), got {len(nodes)} argument(s)"
                                + (" without ':'" if len(nodes) == 1 else ""), position(tree))
            return self._reduce(fn, tree, nodes[0])
        if fn not in ir.FUNCTIONS:
            close = difflib.get_close_matches(fn, list(ir.FUNCTIONS), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise SpecError(f"unknown function '{fn}'{hint}; functions are {', '.join(ir.FUNCTIONS)}, and the "
                            f"reductions {', '.join(ir.REDUCTIONS)}", position(token))
        arity, rule = ir.FUNCTIONS[fn]
        if len(nodes) != arity:
            raise SpecError(f"{fn}() takes {arity} argument(s), got {len(nodes)}", position(tree))
        lowered = [self.expr(a) for a in nodes]
        if fn == "where":
            cond, a, b = lowered
            if cond.type != "bool":
                raise SpecError(f"the condition of where() must be a boolean, got {cond.type}",
                                position(nodes[0]))
            if a.type == "bool" and b.type == "bool":
                return ir.Call(type="bool", fn=fn, args=tuple(lowered))
            for arg, node in ((a, nodes[1]), (b, nodes[2])):
                if not _numeric(arg.type):
                    raise SpecError(f"the branches of where() must both be numbers or both booleans, "
                                    f"got {a.type} and {b.type}", position(node))
            return ir.Call(type=_promote(a.type, b.type), fn=fn, args=tuple(lowered))
        for arg, node in zip(lowered, nodes):
            if not _numeric(arg.type):
                raise SpecError(f"the arguments of {fn}() must be numbers, got {arg.type}", position(node))
        result = {"float": "float", "int": "int", "same": _promote(*(a.type for a in lowered))}[rule]
        return ir.Call(type=result, fn=fn, args=tuple(lowered))

    def _arithmetic(self, op: str, tree: Tree) -> ir.Expr:
        left_node, right_node = tree.children
        left, right = self.expr(left_node), self.expr(right_node)
        for e, node in ((left, left_node), (right, right_node)):
            if not _numeric(e.type):
                raise SpecError(f"the operands of '{_OP_TEXT[op]}' must be numbers, got {e.type}",
                                position(node))
        if op == "div":
            result = "float"
        elif op == "pow":
            exact = (left.type == right.type == "int" and isinstance(right, ir.Const) and right.value >= 0)
            result = "int" if exact else "float"
        else:
            result = _promote(left.type, right.type)
        return ir.Binary(type=result, op=op, left=left, right=right)

    def _run_of(self, tree: Tree) -> ir.Expr:
        """A run of one operator (`+` and `-`, `*`, `and`, `or`), lowered without recursion
        through it and nested as `_balanced` says; each node it makes is placed at its operands' span."""
        run = _run(tree)
        lowered = []
        for i, (_, node) in enumerate(run):
            lowered.append((self.expr(node), node))
            # Checked in the order the left-leaning chain checks them: the first two together.
            for j in ((0, 1) if i == 1 else (i,) if i > 1 else ()):
                self._run_operand(_RUN_OPS[run[max(j, 1)][0]], *lowered[j])

        def join(left, rule, right):
            (a, start, _), (b, _, end) = left, right
            op = _RUN_OPS[rule]
            node = ir.Binary(type="bool" if op in ("and", "or") else _promote(a.type, b.type), op=op, left=a, right=b)
            span = Position(start.line, start.column, end.end_column if end.line == start.line else None)
            self.positions.setdefault(id(node), (node, span))
            return node, start, end

        return _balanced([(rule, (expr, position(node), position(node))) for (rule, _), (expr, node)
                          in zip(run, lowered)], join, balance=len({expr.type for expr, _ in lowered}) == 1)[0]

    @staticmethod
    def _run_operand(op: str, expr: ir.Expr, node: Tree) -> None:
        if op in ("and", "or"):
            if expr.type != "bool":
                raise SpecError(f"the operands of '{op}' must be booleans, got {expr.type}", position(node))
        elif not _numeric(expr.type):
            raise SpecError(f"the operands of '{_OP_TEXT[op]}' must be numbers, got {expr.type}", position(node))

    def add(self, tree): return self._run_of(tree)
    def sub(self, tree): return self._run_of(tree)
    def mul(self, tree): return self._run_of(tree)
    def div(self, tree): return self._arithmetic("div", tree)
    def floordiv(self, tree): return self._arithmetic("floordiv", tree)
    def mod(self, tree): return self._arithmetic("mod", tree)
    def pow(self, tree): return self._arithmetic("pow", tree)

    def neg(self, tree: Tree) -> ir.Expr:
        (node,) = tree.children
        operand = self.expr(node)
        if not _numeric(operand.type):
            raise SpecError(f"the operand of unary '-' must be a number, got {operand.type}", position(node))
        return ir.Unary(type=operand.type, op="neg", operand=operand)

    def pos(self, tree: Tree) -> ir.Expr:
        (node,) = tree.children
        operand = self.expr(node)
        if not _numeric(operand.type):
            raise SpecError(f"the operand of unary '+' must be a number, got {operand.type}", position(node))
        return operand

    def _bitwise(self, op: str, tree: Tree) -> ir.Expr:
        """`&`, `|`, `^`, `<<` and `>>`: on two ints, exact as Python's; `&`, `|`, `^` on two bools, logical."""
        left_node, right_node = tree.children
        left, right = self.expr(left_node), self.expr(right_node)
        if op in _LOGICAL_BITWISE and left.type == right.type == "bool":
            return ir.Binary(type="bool", op=_LOGICAL_BITWISE[op], left=left, right=right)
        if left.type == right.type == "int":
            return ir.Binary(type="int", op=op, left=left, right=right)
        operands = ((left, left_node), (right, right_node))
        culprit = next((n for e, n in operands if e.type == "float"), None) or \
            next(n for e, n in operands if e.type != "int")
        what = "ints" if op in ir.SHIFT_OPS else "ints or both booleans"
        raise SpecError(f"the operands of '{_OP_TEXT[op]}' must both be {what}, got {left.type} and {right.type}",
                        position(culprit))

    def bitand(self, tree): return self._bitwise("bitand", tree)
    def bitor(self, tree): return self._bitwise("bitor", tree)
    def bitxor(self, tree): return self._bitwise("bitxor", tree)
    def lshift(self, tree): return self._bitwise("lshift", tree)
    def rshift(self, tree): return self._bitwise("rshift", tree)

    def invert(self, tree: Tree) -> ir.Expr:
        (node,) = tree.children
        operand = self.expr(node)
        if operand.type == "bool":  # logical, as torch's ~ on a bool tensor
            return ir.Unary(type="bool", op="not", operand=operand)
        if operand.type != "int":
            raise SpecError(f"the operand of '~' must be an int or a boolean, got {operand.type}", position(node))
        return ir.Unary(type="int", op="invert", operand=operand)

    def compare(self, tree: Tree) -> ir.Expr:
        nodes = tree.children
        operands = [self.expr(n) for n in nodes[0::2]]
        result = None
        for i, op_token in enumerate(nodes[1::2]):
            op = _COMPARISONS[str(op_token)]
            left, right = operands[i], operands[i + 1]
            both_bool = left.type == right.type == "bool"
            if not (both_bool and op in ("eq", "ne")):
                for e, node in ((left, nodes[2 * i]), (right, nodes[2 * i + 2])):
                    if not _numeric(e.type):
                        raise SpecError(f"the operands of '{op_token}' must be numbers, got {e.type}",
                                        position(node))
            term = ir.Binary(type="bool", op=op, left=left, right=right)
            result = term if result is None else ir.Binary(type="bool", op="and", left=result, right=term)
        return result

    def and_op(self, tree): return self._run_of(tree)
    def or_op(self, tree): return self._run_of(tree)

    def not_op(self, tree: Tree) -> ir.Expr:
        (node,) = tree.children
        operand = self.expr(node)
        if operand.type != "bool":
            raise SpecError(f"the operand of 'not' must be a boolean, got {operand.type}", position(node))
        return ir.Unary(type="bool", op="not", operand=operand)


def lower(tree: Tree, check_numbers: bool = True) -> ir.Spec:
    """Lower a parse tree to a Spec; raise SpecError (without source attached) on a semantic error.

    `check_numbers=False` skips attngen.frontend.checks (exact integers, zero divisors, a finite scale):
    for tests of the syntax and types alone, such as the printer's round trips over random IR."""
    return Lowerer(check_numbers).start(tree)
