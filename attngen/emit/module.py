"""Renders a spec and its plan into the source of its kernel module: what the spec decides (jinja2
skeletons, IR hooks, its facts) and a declaration that hands it to attngen.runtime."""

from __future__ import annotations

import ast
import hashlib
import math
import textwrap
from functools import lru_cache

import jinja2

from attngen import families as registry
from attngen import intervals, ir
from attngen.analysis import Analysis
from attngen.errors import ArgumentError
from attngen.emit.families import emit_side
from attngen.emit.hooks import kernel_context
from attngen.frontend.printer import expr_to_source, python_expr
from attngen.plan.visits import STATIC
from attngen.plan import Plan
from attngen.plan import families as plan_families
from attngen.version import __version__

# The runtime names a module imports: its declaration's classes, and the @triton.jit helpers and
# constants its kernels call (attngen/runtime/helpers.py; tests/test_static.py checks the list is whole).
HELPER_NAMES = ("LOG2E", "LN2", "_floordiv", "_floormod", "_ceildiv", "_floordiv_f", "_floormod_f", "_tanh",
                "_tanh_approx", "_tan", "_atan", "_round", "_pow", "_dot", "_load_tile", "_page_numbers",
                "_min_max_sum", "_sum_pair", "_index_bound", "_tile_ranges", "_tile_start", "_count_visit",
                "EXACT_DIGITS", "EXACT_WORDS", "_exact_add", "_grad_add", "DROPOUT_ROUNDS", "_dropout_state",
                "_dropout_counters", "_dropout_half_kept", "_dropout_halves_kept", "_dropout_keep",
                "_dropout_keep_tile", "_dropout_quarter", "_dropout_eighth", "_cache_query_offset", "_cache_row_bad",
                "_fp8_descales")
# The kernels no spec changes, in attngen/runtime/kernels.py, which a module imports where its code names them
# (tests/test_static.py checks the list is whole; the runtime launches the others itself).
SHARED_KERNEL_NAMES = ("_bwd_preprocess", "_base2_lse", "_exact_finish", "_cache_values_check")
_RUNTIME_IMPORTS_LINE = "# (the runtime imports)\n"


def runtime_imports(code: str) -> str:
    """The import lines of a module whose code (but these lines) is `code`: the declaration's classes,
    and the helpers its kernels call (the shared ones, and each family's from its runtime side)."""
    used = {n.id for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Name)}
    helpers = ", ".join(name for name in HELPER_NAMES if name in used)
    kernels = ", ".join(name for name in SHARED_KERNEL_NAMES if name in used)
    lines = ["from attngen.runtime.attention import Attention\n",
             "from attngen.runtime.facts import Kernels, SpecFacts, shape_table\n"]
    if helpers:
        lines.append(f"from attngen.runtime.helpers import {helpers}  # the kernels call them\n")
    if kernels:
        lines.append(f"from attngen.runtime.kernels import {kernels}  # the same in every spec\n")
    for name in registry.FAMILIES:
        family_helpers = ", ".join(h for h in emit_side(name).DEVICE_HELPERS if h in used)
        if family_helpers:
            lines.append(f"from attngen.families.{name}.device import {family_helpers}  # its kernels call them\n")
    return "".join(lines)


# The line before the module's declaration (its facts and kernels handed to the runtime): a bundle
# (attngen.emit.bundle) puts the runtime between the kernels and this line.
DECLARATION_MARKER = "# ---- the declaration: this spec's facts and kernels, handed to the runtime ----\n"


def _identifier(name: object) -> str:
    """`name`, which the template writes where Python reads text (the docstring), if it is an
    identifier the IR allows; checked here again since a Spec can skip its validation."""
    problem = ir.name_problem(name, declared=False)
    if problem is not None:
        raise ArgumentError(f"a name in the generated module must be an identifier, got {name!r} ({problem})")
    return name


@lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    # Template names are paths in the package: emit/module.py.jinja is the module's skeleton, emit/ holds
    # the shared parts, and each kernel family's templates are in its folder, families/<name>/.
    environment = jinja2.Environment(loader=jinja2.PackageLoader("attngen", ""),
                                     undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                                     autoescape=False)
    environment.filters["identifier"] = _identifier
    return environment


def _length_reason(facts: Analysis) -> str:
    if facts.length_culprit is None:
        return "positions are int32 in the kernels"
    return f"beyond it '{expr_to_source(facts.length_culprit)}' overflows int64"


def comment_lines(text: str, indent: str = "    ") -> str:
    """`text` as Python comment lines, whatever it holds.

    Each line of the text (split at every character str.splitlines treats as a line break, a
    superset of Python's \\n, \\r and \\r\\n) becomes `#` + indent + the line, with every character
    that is not printable (controls, NUL, lone surrogates, other separators) written as its escape.
    So no text can end a comment, start a statement, or make the file undecodable; and since the
    module starts with a fixed docstring, no line of it can land where Python reads an encoding
    declaration (the first two lines).
    """
    def printable(ch: str) -> str:
        return ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii")
    return "\n".join(f"#{indent}{''.join(map(printable, line))}".rstrip() for line in text.splitlines() or [""])


def _python_tuple(values) -> str:
    return repr(tuple(values))


def sink_literal(expr: ir.Expr, params: dict[str, int | float]) -> str:
    """A `sink:` expression as FACTS.sink, the literal tree attngen.runtime.sinks evaluates: nested tuples
    of names (validated identifiers, functions and operators of the IR's closed sets) and numbers, params
    replaced by their values; data, never code."""
    def node(e: ir.Expr) -> tuple:
        if isinstance(e, ir.Const):
            return ("const", e.type, _number(e.value, e.type))
        if isinstance(e, ir.Param):
            return ("const", e.type, _number(params[e.name], e.type))
        if isinstance(e, ir.Var):
            return ("var", e.name)
        if isinstance(e, ir.Size):
            return ("size", e.name)
        if isinstance(e, ir.Load):
            return ("load", _identifier(e.input), e.type, tuple(node(i) for i in e.index))
        if isinstance(e, ir.Unary):
            return ("unary", e.op, e.type, node(e.operand))
        if isinstance(e, ir.Binary):
            return ("binary", e.op, e.type, node(e.left), node(e.right))
        assert isinstance(e, ir.Call) and e.fn in ir.FUNCTIONS, e
        return ("call", e.fn, e.type, tuple(node(a) for a in e.args))
    return repr(node(expr))


def _number(value: int | float, type_: str) -> int | float | str:
    # inf has no literal: the runtime reads a float constant through float(), which takes 'inf'.
    if type_ == "float":
        value = float(value)
        return value if math.isfinite(value) else repr(value)
    return int(value) if type_ == "int" else bool(value)


def _plan_comment(plan: Plan) -> str:
    """The header's word on the plan beyond PLAN: its target, and the reasons all its entries share."""
    lines = [f"Plan: target {plan.target}; its tiles are PLAN below (`attngen explain` gives each entry's "
             "reasons)."]
    reasons = {e.reasons for e in plan.entries}
    if len(reasons) == 1:
        lines += [textwrap.fill(r, 96) for r in reasons.pop()]
    return "\n".join(lines)


def _reads_math(expr: str) -> bool:
    """Whether Python expression `expr` uses the math module (else the module must not import it)."""
    return any(isinstance(n, ast.Name) and n.id == "math" for n in ast.walk(ast.parse(expr, mode="eval")))


def _shape_rows(table: dict[tuple, str]) -> list[tuple[tuple, tuple, tuple, str]]:
    """A table keyed by (head dim, value head dim, dtype) as rows (head dims, value head dims, dtypes,
    value) that cover it exactly, each a product of keys of one value: by value, the key pairs of one
    set of dtypes, then the head dims whose value head dims agree."""
    rows = []
    for value in dict.fromkeys(table.values()):
        dtypes_of: dict[tuple, list] = {}
        for (d, dv, dtype), v in table.items():
            if v == value:
                dtypes_of.setdefault((d, dv), []).append(dtype)
        for dtypes in dict.fromkeys(tuple(ts) for ts in dtypes_of.values()):
            value_dims_of: dict[int, list] = {}
            for (d, dv), ts in dtypes_of.items():
                if tuple(ts) == dtypes:
                    value_dims_of.setdefault(d, []).append(dv)
            for dvs in dict.fromkeys(tuple(dvs) for dvs in value_dims_of.values()):
                ds = tuple(d for d, these in value_dims_of.items() if tuple(these) == dvs)
                rows.append((ds, dvs, dtypes, value))
    return rows


def _shape_table(table: dict[tuple, str]) -> str:
    """The literal of a table keyed by (head dim, value head dim, dtype) whose values are literals: a
    runtime.facts.shape_table call, one row per product of keys of one value."""
    if not table:
        return "{}"
    return "shape_table(\n" + "".join(
        f"        (({_python_tuple(ds)}, {_python_tuple(dvs)}, {_python_tuple(dtypes)}), {value}),\n"
        for ds, dvs, dtypes, value in _shape_rows(table)) + "    )"


def render(facts: Analysis, plan: Plan, source: str) -> str:
    """The source text of the kernel module for the analysed spec under `plan`; `source` is shown in
    its header."""
    spec = facts.spec
    # Its names and expressions become code: refuse a Spec that skipped validation (ir.revalidated).
    ir.revalidated(spec)
    for r in facts.reductions:
        _identifier(r.name), _identifier(r.source)
    inputs_table = "{" + ", ".join(
        f"{i.name!r}: ({i.dtype!r}, {_python_tuple(i.dims)}, {i.learnable})" for i in spec.inputs) + "}"
    plan_table = _shape_table({
        (e.head_dim_pad, e.head_dim_v_pad, e.dtype):
            "(" + ", ".join(_python_tuple((t.block_m, t.block_n, t.num_warps, t.num_stages))
                            for t in (e.fwd, e.bwd_dkdv, e.bwd_dq)) + ")"
        for e in plan.entries})
    family_tiles_table = _shape_table({
        (e.head_dim_pad, e.head_dim_v_pad, e.dtype):
            "{" + ", ".join(f"{family!r}: {_python_tuple((t.block_m, t.block_n, t.num_warps, t.num_stages, t.buffers))}"
                            for family, t in e.family_tiles) + "}"
        for e in plan.entries if e.family_tiles})
    # The families beside the last (which serves every call, through the Attention's own kernels), which the
    # host tries first, each by its per-call rule.
    others = list(plan.families[:-1])
    entries = [family for family in plan_families.FAMILIES if family.name in others]
    forward_families = _python_tuple(others)
    table_families = _python_tuple(f.name for f in entries if f.follows_tables)
    packed_families = _python_tuple(f.name for f in entries if f.packed_forward)
    packed_backward_families = _python_tuple(f.name for f in entries if f.packed_backward)
    dropout_families = _python_tuple(f.name for f in entries if f.dropout)
    fp8_families = _python_tuple(f.name for f in entries if f.fp8_forward)
    backward_families = _python_tuple((f.name, f.backward_name) for f in entries if f.backward_tiles is not None)
    families_table = ("{" + "".join(f"\n        {f!r}: dict({emit_side(f).DECLARATION})," for f in others) + "\n    }"
                      if others else "{}")
    scale = python_expr(spec.scale, facts.params) if spec.scale is not None else "1.0 / math.sqrt(D)"
    context = dict(
        name=spec.name, version=__version__, fingerprint=facts.source.fingerprint(),
        reductions=repr(tuple((r.name, r.op, r.source, r.dims) for r in facts.reductions)),
        source_inputs=facts.source.inputs,
        source_comment=comment_lines(source.strip()),
        plan_comment=comment_lines(_plan_comment(plan), indent=" "),
        masked_width_floor=plan.masked_width_floor,
        one_launch_backward=plan.one_launch_backward, launch_reason=plan.launch_reason,
        inputs=spec.inputs, inputs_table=inputs_table, plan_table=plan_table,
        scale_expr=scale, import_math=_reads_math(scale),
        table_reads=_python_tuple(facts.table_reads),
        table_steps=repr(dict(facts.block_steps)),
        table_per_b=facts.table_per_batch, table_per_h=facts.table_per_head,
        static_tables=_python_tuple(facts.table_sizes) if plan.visits == STATIC else None,
        max_length=facts.length_limit, max_length_reason=_length_reason(facts),
        max_batch_heads=intervals.MAX_BATCH_HEADS,
        runtime_imports=_RUNTIME_IMPORTS_LINE.rstrip("\n"), declaration_marker=DECLARATION_MARKER.rstrip("\n"),
        families=plan.families, family_tiles_table=family_tiles_table, families_table=families_table,
        forward_families=forward_families, table_families=table_families, backward_families=backward_families,
        packed_families=packed_families, packed_backward_families=packed_backward_families,
        dropout_families=dropout_families, fp8_families=fp8_families,
        sink=sink_literal(spec.sink, facts.params) if spec.sink is not None else None,
        sigmoid=spec.sigmoid,
        **kernel_context(facts, plan.families),
    )
    text = _environment().get_template("emit/module.py.jinja").render(**context)
    assert text.count(_RUNTIME_IMPORTS_LINE) == 1
    return _with_digest(text.replace(_RUNTIME_IMPORTS_LINE, runtime_imports(text)))


_DIGEST_LINE = 'MODULE_DIGEST = ""\n'


def _with_digest(text: str) -> str:
    """The module with its MODULE_DIGEST line filled in: a hash of its code (every line but comment
    lines), which names its custom operators, so two modules share operators only when their code
    is the same."""
    # Spec text enters only as comment lines (comment_lines), so this line is the template's own.
    assert text.count("\n" + _DIGEST_LINE) == 1
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    digest = hashlib.sha256(code.encode()).hexdigest()[:16]
    return text.replace("\n" + _DIGEST_LINE, f'\nMODULE_DIGEST = "{digest}"\n')
