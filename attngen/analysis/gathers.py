"""Which of the score's loads gather an element per tile, and which the kernels read as point loads: an index bounded over a tile from its corners.

A load whose index varies along both tile axes (`bias[clamp(q - k, -8, 8)]`) reads a whole tile of
entries. Where interval arithmetic from the tile's first and last q and k bounds every index and the
bounds meet, every element reads one entry, so the kernels load it once (and add a learnable input's
gradient there in one atomic). `corner_bounded` is the rule the emitter's intervals follow
(`emit.expressions.TritonEmitter.interval` spells the bounds of exactly these expressions), and
`score_gathers` applies it to the score's loads, for `attngen explain`.
"""

from __future__ import annotations

from attngen import ir
from attngen.analysis.fold import fold, pinned
from attngen.intervals import Ranges, fits

# What a tile's corners bound: its query and key positions; every other name is one value over a tile.
TILE_INDICES = frozenset({"q", "k"})
# What a kernel that runs no cache call knows of the sizes: query i sits at position i (Q_OFFSET is 0).
NO_OFFSET = {"Q_OFFSET": 0}
# Ops whose bounds follow from their operands' by exact int arithmetic (mul and floordiv by a constant).
_CALLS = ("min", "max", "clamp", "where", "abs", "floor", "ceil", "round")


def uniform(e: ir.Expr, varying: frozenset[str]) -> bool:
    """Whether `e` is one value over a tile: it reads no score and no name in `varying`."""
    return not any(isinstance(n, ir.Score) or (isinstance(n, (ir.Var, ir.Size)) and n.name in varying)
                   for n in ir.postorder(e))


def corner_bounded(e: ir.Expr, ranges: Ranges, varying: frozenset[str] = TILE_INDICES) -> bool:
    """Whether int `e` (folded) has exact bounds over a tile by interval arithmetic from the tile's
    corners, where `varying` are the names that vary over it (q and k; h too in a kernel whose rows
    span heads): exact ops only, so when the bounds are equal every element has that value. Not for
    float math (its rounding need not be monotone), mod, products of two varying terms, or a value
    the analysis did not bound within int32 (so sums of bounds cannot wrap int64)."""
    if not ranges.is_int(e) or not fits(ranges.value(e), ir.I32_RANGE):
        return False
    if isinstance(e, ir.Const) or uniform(e, varying):
        return True
    if isinstance(e, ir.Var):
        return e.name in TILE_INDICES
    # A `where` is bounded by its branches, whatever its condition.
    children = e.args[1:] if isinstance(e, ir.Call) and e.fn == "where" else ir.children(e)
    if not children or not all(corner_bounded(c, ranges, varying) for c in children):
        return False
    if isinstance(e, ir.Unary):
        return e.op == "neg"
    if isinstance(e, ir.Binary):
        return (e.op in ("add", "sub")
                or (e.op == "mul" and (isinstance(e.left, ir.Const) or isinstance(e.right, ir.Const)))
                or (e.op == "floordiv" and isinstance(e.right, ir.Const) and e.right.value > 0))
    return isinstance(e, ir.Call) and e.fn in _CALLS


def score_gathers(spec: ir.Spec, ranges: Ranges) -> tuple[tuple[ir.Load, bool], ...]:
    """The score's distinct loads whose index, folded, reads both q and k (a gather an element), each
    with whether the forward kernels read it as point loads (every index
    `corner_bounded`). Their tiles start at query position 0 (no cache call), so Q_OFFSET is 0."""
    if spec.score is None:
        return ()
    params = spec.param_values
    found = []
    for load in dict.fromkeys(n for n in ir.postorder(spec.score) if isinstance(n, ir.Load)):
        index = [fold(pinned(i, NO_OFFSET), params) for i in load.index]
        if {n.name for i in index for n in ir.postorder(i) if isinstance(n, ir.Var)} >= TILE_INDICES:
            found.append((load, all(corner_bounded(i, ranges) for i in index)))
    return tuple(found)

