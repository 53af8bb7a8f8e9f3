"""Renders a spec and its plan into the source of a standalone kernel module (jinja2 skeletons, IR hooks
and the static code, inlined verbatim)."""

from __future__ import annotations

import ast
import hashlib
import textwrap
from functools import lru_cache
from importlib import resources

import jinja2

from attngen import intervals, ir
from attngen.analysis import Analysis
from attngen.errors import ArgumentError
from attngen.emit.hooks import kernel_context
from attngen.frontend.printer import expr_to_source, python_expr
from attngen.plan import Plan
from attngen.plan.families import DECODE_MAX_ROWS, FAMILIES, PORTABLE
from attngen.version import __version__

# What the preamble in module.py.jinja defines (the spec's facts) and what the kernel templates define
# (the kernels the host launches): the static files read them as globals, so pyflakes takes them
# as builtins there.
PREAMBLE_NAMES = ("SPEC_NAME", "FINGERPRINT", "INPUTS", "PLAN", "TILE_TABLE", "TABLE_READS", "TABLE_PER_B",
                  "TABLE_PER_H", "TABLE_STEPS", "ONE_LAUNCH_BACKWARD", "MAX_LENGTH", "MAX_LENGTH_REASON",
                  "MAX_BATCH_HEADS", "MASKED_WIDTH_FLOOR", "FAMILY_TILES", "softmax_scale")
KERNEL_NAMES = ("_fwd_kernel", "_bwd_preprocess", "_bwd_kernel", "_table_by_query_classify",
                "_table_by_key_classify", "_table_compact")
# What the module defines after the host code: the families' forward and backward launches, in order of
# preference.
FAMILY_TABLE_NAMES = ("FORWARD_FAMILIES", "TABLE_FAMILIES", "BACKWARD_FAMILIES", "PACKED_FAMILIES",
                      "PACKED_BACKWARD_FAMILIES")
LINT_BUILTINS = PREAMBLE_NAMES + KERNEL_NAMES + FAMILY_TABLE_NAMES

# Each static file is inlined from the line after this one.
INLINE_MARKER = "# ---- inlined into every generated module from here on ----\n"
# The static files by name, in the order module.py.jinja inlines them, with their paths in the package:
# plan/shared.py first, the facts the planner shares with every module; then the emitter's own host code.
STATIC_PATHS = {"shared": "plan/shared.py", "launch": "emit/static/launch.py", "helpers": "emit/static/helpers.py",
                "host": "emit/static/host.py"}
STATIC_FILES = tuple(STATIC_PATHS)


def _identifier(name: object) -> str:
    """`name`, which the template writes where Python reads text (the docstring), if it is an
    identifier the IR allows; checked here again since a Spec can skip its validation."""
    problem = ir.name_problem(name, declared=False)
    if problem is not None:
        raise ArgumentError(f"a name in the generated module must be an identifier, got {name!r} ({problem})")
    return name


@lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    # module.py.jinja is the module's skeleton; each kernel family's templates are in families/<name>/.
    environment = jinja2.Environment(loader=jinja2.PackageLoader("attngen", "emit"),
                                     undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                                     autoescape=False)
    environment.filters["identifier"] = _identifier
    return environment


@lru_cache(maxsize=None)
def static_code(name: str) -> str:
    """The code of static file `name` (STATIC_PATHS) that every module inlines, verbatim: the file after its
    INLINE_MARKER line."""
    return _inlined(resources.files("attngen").joinpath(STATIC_PATHS[name]).read_text(), name)


@lru_cache(maxsize=None)
def family_launch_code(family: str) -> str:
    """The host code of a kernel family beside the portable one (emit/families/`family`/launch.py,
    after its INLINE_MARKER line): its per-call rule `_<family>_serves(q, k, v, HKV, KV_LEN, cached)` and its
    launch `_<family>_forward(q, k, v, tensors, table, cache=None, page_table=None, plan=None)` -> (out, lse)."""
    return _inlined(resources.files("attngen.emit").joinpath(f"families/{family}/launch.py").read_text(), family)


def _inlined(text: str, name: str) -> str:
    _, marker, code = text.partition(INLINE_MARKER)
    assert marker and INLINE_MARKER not in code, name
    return code.strip("\n")


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


def render(facts: Analysis, plan: Plan, source: str) -> str:
    """The source text of the kernel module for the analysed spec under `plan`; `source` is shown in
    its header."""
    spec = facts.spec
    # Its names and expressions become code: refuse a Spec that skipped validation (ir.revalidated).
    ir.revalidated(spec)
    inputs_table = "{" + ", ".join(
        f"{i.name!r}: ({i.dtype!r}, {_python_tuple(i.dims)}, {i.learnable})" for i in spec.inputs) + "}"
    plan_table = "{\n" + "".join(
        f"    ({e.head_dim_pad}, {e.head_dim_v_pad}, {e.dtype!r}): ("
        + ", ".join(_python_tuple((t.block_m, t.block_n, t.num_warps, t.num_stages))
                    for t in (e.fwd, e.bwd_dkdv, e.bwd_dq)) + "),\n"
        for e in plan.entries) + "}"
    family_tiles_table = "{\n" + "".join(
        f"    ({e.head_dim_pad}, {e.head_dim_v_pad}, {e.dtype!r}): {{"
        + ", ".join(f"{family!r}: {_python_tuple((t.block_m, t.block_n, t.num_warps, t.num_stages, t.buffers))}"
                    for family, t in e.family_tiles) + "},\n"
        for e in plan.entries if e.family_tiles) + "}" if any(e.family_tiles for e in plan.entries) else "{}"
    others = [family for family in plan.families if family != PORTABLE.name]
    forward_families = "(" + "".join(f"({f!r}, _{f}_serves, _{f}_forward), " for f in others).rstrip(" ") + ")"
    table_families = _python_tuple(f.name for f in FAMILIES if f.name in others and f.follows_tables)
    packed_families = _python_tuple(f.name for f in FAMILIES if f.name in others and f.packed_forward)
    packed_backward_families = _python_tuple(f.name for f in FAMILIES if f.name in others and f.packed_backward)
    backward_families = "(" + "".join(
        f"({f.name!r}, {f.backward_name!r}, _{f.name}_backward_serves, _{f.name}_backward), " for f in FAMILIES
        if f.name in others and f.backward_tiles is not None).rstrip(" ") + ")"
    scale = python_expr(spec.scale, facts.params) if spec.scale is not None else "1.0 / math.sqrt(D)"
    context = dict(
        name=spec.name, version=__version__, fingerprint=spec.fingerprint(),
        source_comment=comment_lines(source.strip()),
        plan_comment=comment_lines(_plan_comment(plan), indent=" "),
        masked_width_floor=plan.masked_width_floor,
        one_launch_backward=plan.one_launch_backward, launch_reason=plan.launch_reason,
        inputs=spec.inputs, inputs_table=inputs_table, plan_table=plan_table,
        scale_expr=scale, import_math=_reads_math(scale),
        table_reads=_python_tuple(facts.table_reads),
        table_steps=repr(dict(facts.block_steps)),
        table_per_b=facts.table_per_batch, table_per_h=facts.table_per_head,
        max_length=facts.length_limit, max_length_reason=_length_reason(facts),
        max_batch_heads=intervals.MAX_BATCH_HEADS,
        static={name: static_code(name) for name in STATIC_FILES}, families=plan.families,
        family_tiles_table=family_tiles_table, family_launch=[family_launch_code(f) for f in others],
        forward_families=forward_families, table_families=table_families, backward_families=backward_families,
        packed_families=packed_families, packed_backward_families=packed_backward_families,
        decode_max_rows=DECODE_MAX_ROWS,
        **kernel_context(facts, plan.families),
    )
    return _with_digest(_environment().get_template("module.py.jinja").render(**context))


_DIGEST_LINE = 'MODULE_DIGEST = ""\n'


def _with_digest(text: str) -> str:
    """The module with its MODULE_DIGEST line filled in: a hash of its code (every line but comment
    lines), which names its custom operators, so two modules share operators only when their code
    is the same."""
    # Spec text enters only as comment lines (comment_lines), so this line is host.py's own.
    assert text.count("\n" + _DIGEST_LINE) == 1
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    digest = hashlib.sha256(code.encode()).hexdigest()[:16]
    return text.replace("\n" + _DIGEST_LINE, f'\nMODULE_DIGEST = "{digest}"\n')
