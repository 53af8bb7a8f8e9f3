"""Renders a spec and its plan into the source of a standalone kernel module (jinja2 skeletons + IR hooks)."""

from __future__ import annotations

import hashlib
from functools import lru_cache

import jinja2

from attngen import __version__, ir
from attngen.analysis import integers
from attngen.analysis import Analysis
from attngen.emit.expressions import Spelling, TritonEmitter
from attngen.plan import Plan
from attngen.frontend.printer import expr_to_source, python_expr

_SIZES = {"B": "B", "H": "H", "HKV": "HKV", "Q_LEN": "Q_LEN", "KV_LEN": "KV_LEN", "D": "HEAD_DIM"}
_UNIFORM = {"b": "off_b", "h": "off_h", "hkv": "off_hkv"}
# Forward and dQ tiles are (query, key); the dK/dV kernel works on transposed (key, query) tiles.
ROW_MAJOR = Spelling(
    names={**_SIZES, **_UNIFORM, "q": "offs_m[:, None]", "k": "offs_n[None, :]", "score": "s"},
    dims={"q": frozenset("m"), "k": frozenset("n"), "score": frozenset("mn")},
    full_shape="[BLOCK_M, BLOCK_N]")
TRANSPOSED = Spelling(
    names={**_SIZES, **_UNIFORM, "q": "offs_m[None, :]", "k": "offs_n[:, None]", "score": "s"},
    dims={"q": frozenset("m"), "k": frozenset("n"), "score": frozenset("mn")},
    full_shape="[BLOCK_N, BLOCK_M]")
BOUNDS = Spelling(names={**_SIZES, **_UNIFORM}, dims={}, full_shape="[]")


@lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.PackageLoader("attngen", "emit/families/portable"),
                              undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                              autoescape=False)


def _length_reason(facts: Analysis) -> str:
    if facts.length_culprit is None:
        return "positions are int32 in the kernels"
    return f"beyond it '{expr_to_source(facts.length_culprit)}' overflows int64"


def _emitter(facts: Analysis, spelling: Spelling, prefix: str) -> TritonEmitter:
    return TritonEmitter(spelling, facts.params, {i.name: i for i in facts.spec.inputs}, prefix, facts.ranges)


def _score_hook(spec: ir.Spec, em: TritonEmitter) -> str:
    """Defines s2, the modified score in base-2 units, from the raw dot product qk."""
    if spec.score is None or spec.score == ir.Score():
        return "s2 = qk * qk_scale  # no score expression: fold the scale into the base-2 factor"
    start = len(em.lines)
    result = em.emit_full(spec.score)
    return "\n".join(["s = qk * sm_scale", *em.lines[start:], f"s2 = {result} * LOG2E"])


def _mask_hook(facts: Analysis, spelling: Spelling, q_bound: str, k_bound: str) -> str:
    """Defines `allowed`: the spec's mask and the tile's bounds checks."""
    bounds = f"({q_bound}) & ({k_bound})"
    if facts.spec.mask is None:
        return f"allowed = {bounds}"
    em = _emitter(facts, spelling, "mk")
    mask = em.emit(facts.spec.mask)
    return "\n".join([*em.lines, f"allowed = ({mask}) & {bounds}"])


def _dscore_hook(facts: Analysis, em: TritonEmitter, var: str) -> str:
    """Turns the gradient w.r.t. the modified score into the gradient w.r.t. the raw score."""
    if facts.score_derivative is None:
        return f"# d score'/d score = 1: {var} is already the gradient of the raw score"
    start = len(em.lines)
    d = em.emit(facts.score_derivative)
    return "\n".join([*em.lines[start:], f"{var} = {var} * {d}"])


def _learnable_hook(facts: Analysis, em: TritonEmitter) -> str:
    """Scatters ds * d score'/d input into each learnable input's fp32 gradient."""
    lines = []
    for n, (load, derivative) in enumerate(facts.learnable_derivatives):
        start = len(em.lines)
        d = em.emit(derivative)
        indices = [em.emit(i) for i in load.index]
        dims = frozenset().union(*(em.dims_of(i) for i in indices)) if indices else frozenset()
        offset = " + ".join(f"({i}) * stride_{load.input}_{j}" for j, i in enumerate(indices)) or "0"
        bounds = " & ".join(f"({i} >= 0) & ({i} < size_{load.input}_{j})" for j, i in enumerate(indices))
        contribution = f"g{n}"
        lines += em.lines[start:]
        lines.append(f"{contribution} = ds * {d}")
        lines.append("if MASKED:")
        lines.append(f"    {contribution} = tl.where(allowed, {contribution}, 0.0)")
        # Reduce along the axes the index does not vary on: one atomic per distinct address.
        if dims == frozenset("mn"):
            lines += _scatter_tile(f"{load.input}_grad", offset, bounds, contribution, n)
            continue
        if dims == frozenset("m"):
            value = f"tl.sum({contribution}, 1)[:, None]"
        elif dims == frozenset("n"):
            value = f"tl.sum({contribution}, 0)[None, :]"
        else:
            value = f"tl.sum(tl.sum({contribution}, 1), 0)"
        mask = f", mask={bounds}" if bounds else ""
        # Relaxed: only the sum after the kernel matters, so no ordering fence per element (the
        # default, acq_rel, orders every atomic against the program's other memory operations).
        lines.append(f"tl.atomic_add({load.input}_grad + {offset}, {value}{mask}, sem=\"relaxed\")")
    return "\n".join(lines) if lines else "# no learnable inputs"


def _scatter_tile(ptr: str, offset: str, bounds: str, value: str, n: int) -> list[str]:
    """Atomically adds tile `value` at `ptr + offset` (a tile of addresses) where `bounds` holds.

    An index that varies over the tile may still take few values on it: a clamped relative position
    puts most tiles wholly at the clamp (one address) and the tiles on the band's edge partly so.
    Atomics on one address serialize in L2, which made a T5-style bias's backward 17x slower than
    FlexAttention's. So the tile's smallest and largest addresses get their sums in one atomic each,
    and only the addresses strictly between them go out per element (if there are any).
    """
    a, ok, lo, hi, mid = (f"{x}{n}" for x in ("gaddr", "gok", "glo", "ghi", "gmid"))
    return [
        f"{a} = {offset}",
        f"{ok} = {bounds}",
        f"{lo} = tl.min(tl.min(tl.where({ok}, {a}, 2147483647), 1), 0)",
        f"{hi} = tl.max(tl.max(tl.where({ok}, {a}, -1), 1), 0)",
        f"tl.atomic_add({ptr} + {lo}, tl.sum(tl.sum(tl.where({ok} & ({a} == {lo}), {value}, 0.0), 1), 0),",
        f"              mask={lo} <= {hi}, sem=\"relaxed\")",
        f"tl.atomic_add({ptr} + {hi}, tl.sum(tl.sum(tl.where({ok} & ({a} == {hi}), {value}, 0.0), 1), 0),",
        f"              mask={lo} < {hi}, sem=\"relaxed\")",
        f"{mid} = {ok} & ({a} != {lo}) & ({a} != {hi})",
        f"if tl.max(tl.max({mid}.to(tl.int32), 1), 0) > 0:",
        f"    tl.atomic_add({ptr} + {a}, {value}, mask={mid}, sem=\"relaxed\")",
    ]


def _bounds_hook(facts: Analysis, loop: str) -> str:
    """Defines the element bounds of the loop over `loop` ('k' or 'q') for one tile of the other.

    Bounds are scalars per tile, so they are computed in int64; the analysis made sure that cannot
    wrap either (`k < prefix[b]` with an i64 prefix bounds keys by prefix - 1)."""
    visit, full = facts.loop_bounds[loop].visit, facts.loop_bounds[loop].full
    em = _emitter(facts, BOUNDS, "bd")
    other = "q" if loop == "k" else "k"
    tile_vars = {f"{other}0": f"{other}_first", f"{other}1": f"{other}_last"}
    name = "kv" if loop == "k" else "q"
    length = "KV_LEN" if loop == "k" else "Q_LEN"

    def side(bound, default: str, upper: bool) -> str:
        if bound is None:
            return default
        code = em.bound(bound, tile_vars)
        return f"_index_bound({code} + 1, {length})" if upper else f"_index_bound({code}, {length})"

    if visit is None:
        assignments = [f"{name}_lo = 0", f"{name}_hi = 0"]
    else:
        assignments = [f"{name}_lo = {side(visit.lo, '0', False)}",
                       f"{name}_hi = {side(visit.hi, length, True)}"]
    if full is None:
        assignments += [f"{name}_full_lo = 0", f"{name}_full_hi = 0"]
    else:
        assignments += [f"{name}_full_lo = {side(full.lo, '0', False)}",
                        f"{name}_full_hi = {side(full.hi, length, True)}"]
    return "\n".join([*em.lines, *assignments])


def _bounds_checks(spelling: Spelling) -> tuple[str, str]:
    """The in-sequence checks of a tile's queries and keys, in the spelling's orientation."""
    if spelling is ROW_MAJOR:
        return "offs_m[:, None] < Q_LEN", "offs_n[None, :] < KV_LEN"
    return "offs_m[None, :] < Q_LEN", "offs_n[:, None] < KV_LEN"


def _kernel_hooks(facts: Analysis, spelling: Spelling, loop: str, ds_var: str) -> dict[str, str]:
    em = _emitter(facts, spelling, "sc")
    score = _score_hook(facts.spec, em)
    q_bound, k_bound = _bounds_checks(spelling)
    hooks = {"score": score, "mask": _mask_hook(facts, spelling, q_bound, k_bound), "allowed": "allowed",
             "bounds": _bounds_hook(facts, loop)}
    if ds_var == "ds":
        hooks["learnable"] = _learnable_hook(facts, em)
    if ds_var:
        hooks["dscore"] = _dscore_hook(facts, em, ds_var)
    return hooks


def _table_hooks(facts: Analysis, spelling: Spelling, loop: str) -> dict[str, str]:
    """Hooks of a tile-table kernel: rows are tiles of the other index, the loop runs over `loop`."""
    q_bound, k_bound = _bounds_checks(spelling)
    name = "kv" if loop == "k" else "q"
    return {"bounds": _bounds_hook(facts, loop), "mask": _mask_hook(facts, spelling, q_bound, k_bound),
            "lo": f"{name}_lo", "hi": f"{name}_hi", "rows_ok": q_bound if loop == "k" else k_bound}


def _table_params(prefix: str, table: bool) -> str:
    """A tile table's kernel parameters (counts, indices, batch and head strides, row length)."""
    if not table:
        return ""
    return "".join(f"{prefix}{name}, " for name in ("TblNum", "TblIdx", "tbl_sb", "tbl_sh", "tbl_cols"))


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


def render(facts: Analysis, plan: Plan, source: str) -> str:
    """The source text of the kernel module for the analysed spec under `plan`; `source` is shown in
    its header."""
    spec = facts.spec
    inputs = spec.inputs
    input_params = "".join(
        f"{i.name}_ptr, " + "".join(f"stride_{i.name}_{d}, " for d in range(len(i.dims)))
        + "".join(f"size_{i.name}_{d}, " for d in range(len(i.dims)))
        for i in inputs)
    learnable = spec.learnable_inputs
    # `NAME_grad` never equals another input's `NAME_ptr`: `grad_x` beside a learnable `x` is fine.
    grad_params = "".join(f"{i.name}_grad, " for i in learnable)
    inputs_table = "{" + ", ".join(
        f"{i.name!r}: ({i.dtype!r}, {_python_tuple(i.dims)}, {i.learnable})" for i in inputs) + "}"
    plan_table = "{\n" + "".join(
        f"    ({e.head_dim_pad}, {e.head_dim_v_pad}, {e.dtype!r}): ("
        + ", ".join(_python_tuple((t.block_m, t.block_n, t.num_warps, t.num_stages))
                    for t in (e.fwd, e.bwd_dkdv, e.bwd_dq)) + "),\n"
        for e in plan.entries) + "}"
    scale = python_expr(spec.scale, facts.params) if spec.scale is not None else "1.0 / math.sqrt(D)"
    table = facts.tile_table
    mask_vars = {n.name for n in ir.walk(spec.mask) if isinstance(n, ir.Var)} if spec.mask is not None else set()
    context = dict(
        name=spec.name, version=__version__, fingerprint=spec.fingerprint(),
        source_comment=comment_lines(source.strip()), plan_comment=comment_lines(plan.summary()),
        masked_width_floor=plan.masked_width_floor,
        one_launch_backward=plan.one_launch_backward, launch_reason=plan.launch_reason,
        inputs=inputs, any_learnable=bool(learnable), inputs_table=inputs_table, plan_table=plan_table,
        scale_expr=scale, input_params=input_params, input_args=input_params,
        grad_params=grad_params, grad_args=grad_params,
        fwd=_kernel_hooks(facts, ROW_MAJOR, "k", ""),
        dq=_kernel_hooks(facts, ROW_MAJOR, "k", "ds"),
        dkdv=_kernel_hooks(facts, TRANSPOSED, "q", "dsT"),
        table=table, table_params=_table_params("", table), kv_table_params=_table_params("kv_", table),
        q_table_params=_table_params("q_", table),
        table_reads=_python_tuple(facts.table_reads),
        table_steps=repr(dict(facts.block_steps)),
        table_per_b="b" in mask_vars, table_per_h=bool(mask_vars & {"h", "hkv"}),
        table_by_query=_table_hooks(facts, ROW_MAJOR, "k") if table else None,
        table_by_key=_table_hooks(facts, TRANSPOSED, "q") if table else None,
        max_length=facts.length_limit, max_length_reason=_length_reason(facts),
        max_batch_heads=integers.MAX_BATCH_HEADS,
    )
    return _with_digest(_environment().get_template("module.py.jinja").render(**context))


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
