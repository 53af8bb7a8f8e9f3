"""The spec's code inside the kernel skeletons: hooks that each declare the names they read and define, in each kernel's spelling."""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass

from attngen import families as registry
from attngen import ir
from attngen.analysis import Analysis
from attngen.emit.expressions import Spelling, TritonEmitter, address, indented
from attngen.analysis.fold import fold
from attngen.analysis.gathers import NO_OFFSET
from attngen.emit.families import emit_side
from attngen.emit.signatures import POSITIONS, TILE_RANGE, kernel_signatures
from attngen.frontend.printer import expr_to_source

_SIZES = {"B": "B", "H": "H", "HKV": "HKV", "Q_LEN": "Q_LEN", "KV_LEN": "KV_LEN", "D": "HEAD_DIM"}
_UNIFORM = {"b": "off_b", "h": "off_h", "hkv": "off_hkv"}
# Forward and dQ tiles are (query, key); the dK/dV kernel works on transposed (key, query) tiles.
ROW_MAJOR = Spelling(
    names={**_SIZES, **_UNIFORM, "q": "offs_m[:, None]", "k": "offs_n[None, :]", "score": "s"},
    dims={"q": frozenset("m"), "k": frozenset("n"), "score": frozenset("mn")},
    zeros="tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)", sizes=NO_OFFSET)
TRANSPOSED = Spelling(
    names={**_SIZES, **_UNIFORM, "q": "offs_m[None, :]", "k": "offs_n[:, None]", "score": "s"},
    dims={"q": frozenset("m"), "k": frozenset("n"), "score": frozenset("mn")},
    zeros="tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)", rows="n", sizes=NO_OFFSET)
# The forward kernels also serve cache calls, whose query i sits at position pos_m = q_off + i
# (q_off = q_offset[b], 0 otherwise); the backward kernels never see an offset.
FORWARD_ROWS = Spelling(
    names={**ROW_MAJOR.names, "q": "pos_m[:, None]", "Q_OFFSET": "q_off"},
    dims=ROW_MAJOR.dims,
    zeros="tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)")
BOUNDS = Spelling(names={**_SIZES, **_UNIFORM}, dims={}, zeros="0.0", sizes=NO_OFFSET)
# The forward kernels' bounds, for rows of a cache call too.
FORWARD_BOUNDS = Spelling(names={**_SIZES, **_UNIFORM, "Q_OFFSET": "q_off"}, dims={}, zeros="0.0")
# What a hook over a tile's elements may read, besides module constants, helpers and its kernel's
# parameters (sizes, the inputs' pointers, strides and sizes): the tile's indices and its program's
# batch and heads.
ELEMENT_NAMES = ("offs_m", "offs_n", *POSITIONS)
FORWARD_ELEMENT_NAMES = ("offs_m", "pos_m", "offs_n", *POSITIONS)


@dataclass(frozen=True)
class Hook:
    """Code of the spec spliced into a kernel skeleton, FlexAttention-style: it reads `inputs` (names
    the skeleton defines before the splice point; module constants, helpers and the kernel's
    parameters aside) and defines `outputs` for the skeleton, and `shared` temporaries that a later
    hook of the same kernel may read (the score's, for its derivative). `source` is the spec line
    it implements, shown above the code."""
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    code: str
    source: str = ""
    shared: tuple[str, ...] = ()

    def __str__(self) -> str:
        if not self.source:
            return self.code
        # Printed from the IR (validated names, literals): one line, no text of the spec's own.
        return f"# {self.source}\n{self.code}"


def undeclared_reads(hook: Hook, known: set[str]) -> set[str]:
    """The names `hook` reads before defining them that it did not declare and `known` (the module's
    and the kernel's names) does not hold: empty for a hook that keeps its contract."""
    return _flow(ast.parse(hook.code).body, set(hook.inputs) | known)[0]


def _flow(statements: list[ast.stmt], defined: set[str]) -> tuple[set[str], set[str]]:
    """(names read before any definition, names defined after) of `statements`; an `if` defines
    what both its branches do (a constexpr `if` keeps one of them)."""
    missing = set()
    for statement in statements:
        if isinstance(statement, ast.If):
            missing |= _names(statement.test, ast.Load) - defined
            body_missing, body_defined = _flow(statement.body, set(defined))
            else_missing, else_defined = _flow(statement.orelse, set(defined))
            missing |= body_missing | else_missing
            defined = body_defined & else_defined
        else:
            missing |= _names(statement, ast.Load) - defined
            defined = defined | _names(statement, ast.Store)
    return missing, defined


def defined_names(hook: Hook) -> set[str]:
    return _names(ast.parse(hook.code), ast.Store)


def _names(tree: ast.AST, context: type[ast.expr_context] = ast.expr_context) -> set[str]:
    """The names `tree` reads (ast.Load), assigns (ast.Store) or, by default, uses either way."""
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, context)}


def _emitter(facts: Analysis, spelling: Spelling, prefix: str) -> TritonEmitter:
    return TritonEmitter(spelling, facts.params, {i.name: i for i in facts.spec.inputs}, prefix, facts.ranges)


def _element_names(spelling: Spelling) -> tuple[str, ...]:
    if spelling.element_names is not None:
        names = spelling.element_names
    else:
        names = FORWARD_ELEMENT_NAMES if spelling.names["q"] == FORWARD_ROWS.names["q"] else ELEMENT_NAMES
    # The position of query 0, where a cache call may move it (`causal_bottom_right` reads it).
    offset = ("q_off",) if "Q_OFFSET" in spelling.names and "Q_OFFSET" not in spelling.sizes else ()
    return (*names, *offset, *spelling.corner_names)


def _score_hook(spec: ir.Spec, em: TritonEmitter) -> Hook:
    """s2, the modified score in base-2 units, from the raw dot product qk."""
    inputs = ("qk", "sm_scale", "qk_scale", *_element_names(em.spelling))
    if spec.score is None or spec.score == ir.Score():
        return Hook("score", inputs, ("s2",),
                    "s2 = qk * qk_scale  # no score expression: fold the scale into the base-2 factor")
    start = len(em.lines)
    result = em.emit_full(spec.score)
    # What each statement leaves defined (a branch's own temporaries stay inside it).
    temporaries = [name for line in em.lines[start:] for name in sorted(_flow(ast.parse(line).body, set())[1])]
    return Hook("score", inputs, ("s2",), "\n".join(["s = qk * sm_scale", *em.lines[start:], f"s2 = {result} * LOG2E"]),
                source=f"score: {expr_to_source(spec.score)}", shared=("s", *temporaries))


def _mask_hook(facts: Analysis, spelling: Spelling) -> Hook:
    """`allowed`: the spec's mask and the tile's bounds checks."""
    q_bound, k_bound = _bounds_checks(spelling)
    bounds = f"({q_bound}) & ({k_bound})"
    names = _element_names(spelling)
    if facts.spec.mask is None:
        return Hook("mask", names, ("allowed",), f"allowed = {bounds}")
    em = _emitter(facts, spelling, "mk")
    mask = em.emit(facts.spec.mask)
    return Hook("mask", names, ("allowed",), "\n".join([*em.lines, f"allowed = ({mask}) & {bounds}"]),
                source=f"mask: {expr_to_source(facts.spec.mask)}")


def _score_is_shifted(facts: Analysis) -> bool:
    """Whether d score'/d score is 1 everywhere: no score expression, or one that adds to the score (a
    bias, ALiBi): the gradient of the modified score is then the raw score's."""
    return facts.score_derivative is None or fold(facts.score_derivative, facts.params) == ir.Const(
        type="float", value=1.0)


def _is_constant(e: ir.Expr, facts: Analysis) -> bool:
    """Whether `e` folds to a finite constant: times 0 (P and dS where the mask is off) it gives 0."""
    folded = fold(e, facts.params)
    return isinstance(folded, ir.Const) and math.isfinite(folded.value)


def _dscore_hook(facts: Analysis, em: TritonEmitter, score: Hook, var: str) -> Hook:
    """Turns `var`, the gradient w.r.t. the modified score, into the gradient w.r.t. the raw score."""
    inputs = (var, *score.shared, *_element_names(em.spelling))
    if _score_is_shifted(facts):
        return Hook("dscore", inputs, (), f"# d score'/d score = 1: {var} is already the gradient of the raw score")
    start = len(em.lines)
    d = em.emit(facts.score_derivative)
    return Hook("dscore", inputs, (var,), "\n".join([*em.lines[start:], f"{var} = {var} * {d}"]),
                source=f"d score'/d score = {expr_to_source(facts.score_derivative)}")


def _learnable_hook(facts: Analysis, em: TritonEmitter, score: Hook, var: str = "ds",
                    deterministic: str | bool = "DETERMINISTIC") -> Hook:
    """`deterministic`: what the adds pass _grad_add as its DETERMINISTIC (the kernel's constexpr of that
    name, or False in a kernel that has no deterministic mode)."""
    return Hook("learnable", (var, "allowed", "MASKED", *score.shared, *_element_names(em.spelling)), (),
                _learnable_code(facts, em, var, str(deterministic)))


def _learnable_code(facts: Analysis, em: TritonEmitter, var: str, deterministic: str) -> str:
    """Scatters `var` (the gradient of the modified score) * d score'/d input into each learnable
    input's fp32 gradient (`deterministic` as for _learnable_hook)."""
    # An index that varies along one tile axis only is summed over the other axis first.
    columns = "n" if em.spelling.rows == "m" else "m"
    sums = {em.spelling.rows: "tl.sum({}, 1)[:, None]", columns: "tl.sum({}, 0)[None, :]"}
    lines = []
    for n, (load, derivative) in enumerate(facts.learnable_derivatives):
        start = len(em.lines)
        d = em.emit(derivative)
        # A tile at one entry (a clamped relative position, most tiles): its sum, in one atomic; the
        # others scatter, their addresses computed in that branch only.
        point = em.point(load.index) if em.varies_on_tile(load.index) else None
        indices, index_lines = em.local(lambda: [em.emit(i) for i in load.index]) if point else \
            ([em.emit(i) for i in load.index], [])
        dims = frozenset().union(*(em.dims_of(i) for i in indices)) if indices else frozenset()
        offset, bounds = address(load.input, indices)
        contribution = f"g{n}"
        lines += em.lines[start:]
        lines.append(f"{contribution} = {var} * {d}")
        if not _is_constant(derivative, facts):
            # Where the mask is off, `var` is 0 (P is), but a derivative there may be inf or NaN.
            lines.append("if MASKED:")
            lines.append(f"    {contribution} = tl.where(allowed, {contribution}, 0.0)")
        # Reduce along the axes the index does not vary on: one atomic per distinct address.
        if point:
            is_point, entry = point
            entry_offset, entry_bounds = address(load.input, entry)
            lines += [f"if {is_point}:",
                      "    " + _grad_add(f"{load.input}_grad", entry_offset, f"tl.sum(tl.sum({contribution}, 1), 0)",
                                       entry_bounds, deterministic),
                      "else:", *indented(index_lines),
                      *indented(_scatter_tile(f"{load.input}_grad", offset, bounds, contribution, n, deterministic))]
            continue
        if dims == frozenset("mn"):
            lines += _scatter_tile(f"{load.input}_grad", offset, bounds, contribution, n, deterministic)
            continue
        if len(dims) == 1:
            value = sums[next(iter(dims))].format(contribution)
        else:
            value = f"tl.sum(tl.sum({contribution}, 1), 0)"
        lines.append(_grad_add(f"{load.input}_grad", offset, value, bounds, deterministic))
    return "\n".join(lines) if lines else "# no learnable inputs"


def _grad_add(ptr: str, offset: str, value: str, mask: str, deterministic: str) -> str:
    """Adds `value` into the gradient at `ptr + offset` where `mask` holds (always, if empty): an fp32 atomic,
    or exactly in deterministic mode (runtime.helpers._grad_add), as `deterministic` (code) says."""
    return f"_grad_add({ptr}, {offset}, {value}, {mask or 'None'}, {deterministic})"


def _scatter_tile(ptr: str, offset: str, bounds: str, value: str, n: int, deterministic: str) -> list[str]:
    """Adds tile `value` at `ptr + offset` (a tile of addresses) where `bounds` holds (_grad_add).

    An index that varies over the tile may still take few values on it: a clamped relative position
    puts most tiles wholly at the clamp (one address) and the tiles on the band's edge partly so.
    Atomics on one address serialize in L2, which made a T5-style bias's backward 17x slower than
    FlexAttention's. So one reduction takes the tile's smallest and largest addresses and its sum (a
    tile-wide reduction crosses warps through shared memory: one crossing for the three): a tile at one
    address adds its sum there; otherwise the smallest and largest addresses get their sums in one
    atomic each (one more reduction), and only the addresses strictly between them go out per element.
    """
    a, ok, lo, hi, total, at_lo, at_hi, mid = (f"{x}{n}" for x in ("gaddr", "gok", "glo", "ghi", "gsum", "gatlo",
                                                                 "gathi", "gmid"))
    return [
        f"{a} = {offset}",
        f"{ok} = {bounds}",
        f"{lo}, {hi}, {total} = tl.reduce((tl.where({ok}, {a}, 2147483647), tl.where({ok}, {a}, -1),",
        f"                                 tl.where({ok}, {value}, 0.0)), 1, _min_max_sum)",
        f"{lo}, {hi}, {total} = tl.reduce(({lo}, {hi}, {total}), 0, _min_max_sum)",
        f"if {lo} >= {hi}:",
        "    " + _grad_add(ptr, lo, total, f"{lo} == {hi}", deterministic),
        "else:",
        f"    {at_lo}, {at_hi} = tl.reduce((tl.where({ok} & ({a} == {lo}), {value}, 0.0),",
        f"                                   tl.where({ok} & ({a} == {hi}), {value}, 0.0)), 1, _sum_pair)",
        f"    {at_lo}, {at_hi} = tl.reduce(({at_lo}, {at_hi}), 0, _sum_pair)",
        "    " + _grad_add(ptr, lo, at_lo, "", deterministic),
        "    " + _grad_add(ptr, hi, at_hi, "", deterministic),
        f"    {mid} = {ok} & ({a} != {lo}) & ({a} != {hi})",
        f"    if tl.max(tl.max({mid}.to(tl.int32), 1), 0) > 0:",
        "        " + _grad_add(ptr, a, value, mid, deterministic),
    ]


def _bounds_hook(facts: Analysis, loop: str, with_full: bool = True, spelling: Spelling = BOUNDS) -> Hook:
    """The element bounds of the loop over `loop` ('k' or 'q') for one tile of the other index.

    Bounds are scalars per tile, so they are computed in int64; the analysis made sure that cannot
    wrap either (`k < prefix[b]` with an i64 prefix bounds keys by prefix - 1). `with_full`: also the
    bounds of the fully allowed elements (the table classifier needs only the visited ones).
    `spelling`: FORWARD_BOUNDS in the forward kernels, whose query 0 sits at position q_off."""
    visit, full = facts.loop_bounds[loop].visit, facts.loop_bounds[loop].full
    em = _emitter(facts, spelling, "bd")
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
    if with_full and full is None:
        assignments += [f"{name}_full_lo = 0", f"{name}_full_hi = 0"]
    elif with_full:
        assignments += [f"{name}_full_lo = {side(full.lo, '0', False)}",
                        f"{name}_full_hi = {side(full.hi, length, True)}"]
    parts = ("lo", "hi", "full_lo", "full_hi") if with_full else ("lo", "hi")
    offset = ("q_off",) if spelling is FORWARD_BOUNDS else ()
    return Hook("bounds", (*tile_vars.values(), *POSITIONS, *offset), tuple(f"{name}_{part}" for part in parts),
                "\n".join([*em.lines, *assignments]))


def _tile_range_hook(facts: Analysis, loop: str, offset: str = "") -> Hook:
    """Which tiles of `loop` one program visits with mask code and which without (TILE_RANGE):
    the rows of its tile table, or its closed-form bounds cut into tiles."""
    tile = "start_m" if loop == "k" else "start_n"
    table = [
        "# This tile's partial tiles (listed from the left of its row) and full ones (from the right).",
        f"trow = off_b.to(tl.int64) * tbl_sb + off_h * tbl_sh + {tile}",
        "masked_tiles = TblIdx + trow * tbl_cols",
        "masked_lo, masked_hi, gap_at, gap = 0, tl.load(TblNum + 2 * trow), 0, 0",
        "n_full = tl.load(TblNum + 2 * trow + 1)",
        "full_tiles, full_lo, full_hi = masked_tiles + tbl_cols - n_full, 0, n_full",
    ]
    closed = _closed_tile_range(facts, loop, offset)
    if not facts.tile_table:
        return closed
    # Calls whose rows a table built for rows 0 .. Q_LEN - 1 of every batch row does not describe (the
    # forward's cache calls, every kernel's packed calls) follow none (FOLLOW_TABLE off): they visit the
    # closed-form hull of the mask, every tile with mask code, which is exact, only without skipping the
    # tiles inside the hull.
    code = ["if FOLLOW_TABLE:", *("    " + line for line in table),
            "else:", *("    " + line for line in closed.code.splitlines())]
    return Hook("tile_range", closed.inputs, TILE_RANGE, "\n".join(code))


def _closed_tile_range(facts: Analysis, loop: str, offset: str) -> Hook:
    """_tile_range_hook from the closed-form bounds: the hull of the allowed tiles, cut into tiles."""
    tile, block, other_block, length = (("start_m", "BLOCK_N", "BLOCK_M", "Q_LEN") if loop == "k"
                                        else ("start_n", "BLOCK_M", "BLOCK_N", "KV_LEN"))
    other = "q" if loop == "k" else "k"
    bounds = _bounds_hook(facts, loop, spelling=FORWARD_BOUNDS if offset else BOUNDS)
    lo, hi, full_lo, full_hi = bounds.outputs
    # The tile's first and last position, where the bounds read them (a full mask's do not): its
    # first and last index, plus the queries' offset in the forward kernel (`offset`).
    shift = f" + {offset}" if offset else ""
    ends = [f"{other}_first = {tile} * {other_block}{shift}",
            f"{other}_last = tl.minimum({tile} * {other_block} + {other_block}, {length}) - 1{shift}"]
    code = [
        *_read_ends(ends, bounds.code),
        bounds.code,
        f"t0, t1, t2, t3 = _tile_ranges({lo}, {hi}, {full_lo}, {full_hi}, {block})",
        "# One masked loop over the partial tiles before and after the fully allowed stretch (one loop",
        "# costs one pipeline fill, not two), then the stretch itself; no table to read tiles from.",
        "masked_tiles, masked_lo, masked_hi, gap_at, gap = 0, t0, t1 + (t3 - t2), t1, t2 - t1",
        "full_tiles, full_lo, full_hi = 0, t1, t2",
    ]
    return Hook("tile_range", (tile, *POSITIONS, *([offset] if offset else [])), TILE_RANGE, "\n".join(code))


def _bounds_checks(spelling: Spelling) -> tuple[str, str]:
    """The in-sequence checks of a tile's queries and keys, in the spelling's orientation."""
    if spelling.bounds_checks is not None:
        return spelling.bounds_checks
    if spelling.rows == "m":
        return "offs_m[:, None] < Q_LEN", "offs_n[None, :] < KV_LEN"
    return "offs_m[None, :] < Q_LEN", "offs_n[:, None] < KV_LEN"


def _table_hooks(facts: Analysis, spelling: Spelling, loop: str) -> dict[str, Hook]:
    """Hooks of a tile-table kernel: rows are tiles of the other index, the loop runs over `loop`."""
    bounds, mask = _bounds_hook(facts, loop, with_full=False), _mask_hook(facts, spelling)
    return {"positions": _positions_hook(bounds.code + "\n" + mask.code), "bounds": bounds, "mask": mask}


def _positions_hook(code: str) -> Hook:
    """The batch and heads of a table program's group `g`, those of them `code` reads."""
    read = [p for p in POSITIONS if _reads(code, p)]
    if "off_hkv" in read and "off_h" not in read:
        read.insert(1, "off_h")  # off_hkv is derived from off_h
    lines = {"off_b": "off_b = g // G_H", "off_h": "off_h = g % G_H", "off_hkv": "off_hkv = off_h // (H // HKV)"}
    return Hook("positions", ("g",), tuple(read), "\n".join(lines[p] for p in POSITIONS if p in read)
                or "# the mask reads neither the batch nor the head")


def _read_ends(ends: list[str], code: str) -> list[str]:
    """Of the assignments `ends` (a tile's first and last position), those whose name `code` reads."""
    return [line for line in ends if _reads(code, line.split(" = ", 1)[0])]


def _reads(code: str, name: str) -> bool:
    return name in _names(ast.parse(code))




def kernel_context(facts: Analysis, families: tuple[str, ...] = registry.FAMILIES[-1:]) -> dict:
    """What the templates of `families` (each family's folder) and the shared ones fill in for this spec:
    every kernel's signature, the tile tables' hooks and each family's own context (its emit.py)."""
    context = dict(
        sig=kernel_signatures(facts.spec, facts.tile_table, families),
        table=facts.tile_table,
        table_by_query=_table_hooks(facts, ROW_MAJOR, "k") if facts.tile_table else None,
        table_by_key=_table_hooks(facts, TRANSPOSED, "q") if facts.tile_table else None,
    )
    for name in families:
        context.update(emit_side(name).context(facts))
    return context
