"""`attngen explain`: what the compiler decided for one spec at given lengths, and what it will cost.

The report shows the IR, the plan and its reasons, each kernel's tile map (full, partial,
empty), the FLOPs done against dense attention and the predicted HBM traffic against
standard attention (the FlashAttention paper's IO analysis). For masks that read inputs it
says what is decided at run time. `plot` draws the forward tile map.
"""

from __future__ import annotations

from pathlib import Path

from attngen import ir
from attngen.analysis import spans
from attngen.errors import ArgumentError
from attngen.analysis import Analysis
from attngen.frontend.printer import expr_to_source, to_source
from attngen.plan import ELEMENT_BYTES, Plan, families, visits
from attngen.plan.families import deterministic_backward
from attngen.report.tilemap import (EMPTY, FULL, PARTIAL, TileMap, closed_form_map, describe_bytes, describe_flops,
                                    forward_costs, tile_map)

# Each map is a dense uint8 grid (one byte a tile), filled a row of tiles at a time in Python.
MAX_MAP_TILES = 1 << 26


def ir_tree(e: ir.Expr) -> str:
    """An expression as a typed s-expression: `(and:bool (ge:bool q k) ...)`."""
    if isinstance(e, ir.Const):
        return repr(e.value) if e.type != "bool" else str(e.value).lower()
    if isinstance(e, (ir.Var, ir.Size)):
        return e.name
    if isinstance(e, ir.Param):
        return f"{e.name}"
    if isinstance(e, ir.Score):
        return "score"
    if isinstance(e, ir.Load):
        return f"{e.input}[{', '.join(ir_tree(i) for i in e.index)}]:{e.type}"
    if isinstance(e, ir.Unary):
        return f"({e.op}:{e.type} {ir_tree(e.operand)})"
    if isinstance(e, ir.Binary):
        return f"({e.op}:{e.type} {ir_tree(e.left)} {ir_tree(e.right)})"
    return f"({e.fn}:{e.type} {' '.join(ir_tree(a) for a in e.args)})"


def _mask_strategy(facts: Analysis, kernel_plan: Plan) -> str:
    if facts.spec.mask is None:
        return "no mask: every tile is full, no mask code runs"
    if kernel_plan.visits == visits.CLOSED:
        reads = facts.table_reads
        if reads:
            return ("closed form: the kernels compute each tile's loop bounds arithmetically; the bounds "
                    f"read {', '.join(reads)} (one value per tile), so they are evaluated in the kernel at "
                    "run time; no tile table")
        return "closed form: the kernels compute each tile's loop bounds arithmetically; no tile table"
    how = ("generated kernels evaluate the mask on every tile (at one point per block for block layouts) and "
           "list each row's partial and full tiles")
    if kernel_plan.visits == visits.STATIC:
        return (f"static tile table: {how}, once per tiling and {', '.join(facts.table_sizes)}; the runtime "
                "keeps it, so later calls of those sizes build none")
    return (f"tile table per call: {how} at call time; built on every call, or once by attn.tile_tables() for "
            "inputs that stay fixed")


def _hull_waste(facts: Analysis, kernel_plan: Plan, sizes: dict[str, int], maps: dict[str, TileMap],
                kernels: dict[str, tuple[int, int, bool]]) -> list[str]:
    """For a mask that follows a static table: what the closed-form hull would visit at these lengths,
    against the table's tiles (the planner's reason for the table, in numbers)."""
    if kernel_plan.visits != visits.STATIC:
        return []
    lines = []
    for name, (block_m, block_n, by_query) in kernels.items():
        table, hull = maps[name], closed_form_map(facts, sizes, block_m, block_n, by_query)
        if hull is None or not table.exact:
            return []
        visited, needed = int((hull.grid != EMPTY).sum()), int((table.grid != EMPTY).sum())
        masked_full = int(((hull.grid == PARTIAL) & (table.grid == FULL)).sum())
        lines.append(f"  {name:<8} the closed-form hull would visit {visited} tiles ({visited - needed} of them empty) "
                     f"and mask {masked_full} full ones; the table visits {needed}")
    return ["closed-form hull against the table (batch 0, head 0)", *lines] if lines else []


def _gathers(facts: Analysis, kernel_plan: Plan) -> list[str]:
    """The score's inputs read at both q and k, and whether the kernels take one entry a tile where
    the index is constant over it (docs/language.md, "Inputs read at both q and k")."""
    if not facts.score_gathers:
        return []
    lines = ["score inputs read at both q and k (a gather an element)"]
    learnable = {i.name for i in facts.spec.learnable_inputs}
    for load, point in facts.score_gathers:
        if point:
            how = ("point loads: a tile whose index bounds meet (interval arithmetic from its corners) reads "
                   "one entry, loaded once")
            if load.input in learnable:
                how += ", and adds its gradient in one atomic"
        else:
            how = ("gathered on every tile: its index holds an op the interval bounds do not follow (%, a "
                   "product of two indices, float math, a load)")
        lines.append(f"  {expr_to_source(load)}: {how}")
    every = [f.name for f in families.FAMILIES if f.name in kernel_plan.families and f.gathers_every_tile]
    if every:
        lines.append(f"  (the {' and '.join(every)} kernels gather on every tile)")
    return lines


def report(facts: Analysis, kernel_plan: Plan, q_len: int, kv_len: int, head_dim: int, head_dim_v: int,
           dtype: str, batch: int = 1, heads: int = 1) -> tuple[str, dict[str, TileMap]]:
    """The text of the explanation of an analysed and planned spec, and the tile maps it was computed from."""
    for name, value in (("--q-len", q_len), ("--kv-len", kv_len), ("--batch", batch), ("--heads", heads)):
        if value < 1:
            raise ArgumentError(f"{name} must be at least 1, got {value}")
    spec = facts.spec
    entry = kernel_plan.lookup(head_dim, head_dim_v, dtype)
    for kernel in (entry.fwd, entry.bwd_dkdv, entry.bwd_dq):
        tiles = -(-q_len // kernel.block_m) * -(-kv_len // kernel.block_n)
        if tiles > MAX_MAP_TILES:
            raise ArgumentError(f"--q-len and --kv-len must give at most {MAX_MAP_TILES} tiles per map, got "
                                f"{q_len} x {kv_len} in {kernel.block_m}x{kernel.block_n} tiles = {tiles}")
    sizes = {"B": batch, "H": heads, "HKV": heads, "Q_LEN": q_len, "KV_LEN": kv_len, "D": head_dim}
    lines = [f"{spec.name}: Q_LEN={q_len} KV_LEN={kv_len} D={head_dim} DV={head_dim_v} {dtype}, "
             f"target {kernel_plan.target}", "", "spec, as the compiler reads it (builtins expanded)"]
    lines += [f"  {line}" for line in to_source(spec).splitlines()]
    lines += ["", "IR (typed)"]
    for item in ("mask", "score", "scale"):
        e = getattr(spec, item)
        lines.append(f"  {item}: {ir_tree(e) if e is not None else '(none)'}")
    if spec.sink is not None:  # shown only where a spec has one: the others' explanations read as before
        lines.append(f"  sink: {ir_tree(spec.sink)} (one per query row, evaluated on the host (attngen.runtime.sinks); "
                     f"the forward kernels start each row's softmax at it)")
    if spec.sigmoid:  # likewise only where a spec is not softmax attention
        lines.append("  normalize: sigmoid (each allowed key weighs sigmoid(score') on its own: no sum over the row, "
                     "no LSE, no row terms in the backward)")
    lines += ["", f"plan ({kernel_plan.target}, padded D={entry.head_dim_pad} DV={entry.head_dim_v_pad})",
              f"  kernel families: {', '.join(kernel_plan.families)} ({kernel_plan.family_reason})",
              f"  forward {entry.fwd.short()}   dK/dV {entry.bwd_dkdv.short()}   dQ {entry.bwd_dq.short()}"]
    lines += [f"  why: {r}" for r in entry.reasons]
    lines += ["  deterministic backward (attngen.build(..., deterministic=True), attn(..., deterministic=True) or "
              f"torch.use_deterministic_algorithms(True)): {deterministic_backward(facts, kernel_plan.families)}"]
    lines += [f"  why: the mask is {'narrow' if kernel_plan.narrow else 'dense'} for tiling: "
              f"{spans.NARROW_TEXT if kernel_plan.narrow else spans.DENSE_TEXT}",
              f"  why: {kernel_plan.launch_reason}"]
    lines += ["", f"mask: {_mask_strategy(facts, kernel_plan)}", f"  why: {kernel_plan.visits_reason}"]
    lines += _gathers(facts, kernel_plan)
    maps = {"forward": tile_map(facts, sizes, entry.fwd.block_m, entry.fwd.block_n, True),
            "dK/dV": tile_map(facts, sizes, entry.bwd_dkdv.block_m, entry.bwd_dkdv.block_n, False),
            "dQ": tile_map(facts, sizes, entry.bwd_dq.block_m, entry.bwd_dq.block_n, True)}
    lines.append("tile map (batch 0, head 0)")
    for name, m in maps.items():
        c = m.counts()
        total = sum(c.values())
        rows, cols = m.grid.shape
        axes = "key x query" if name == "dK/dV" else "query x key"
        lines.append(f"  {name:<8} {m.block_rows}x{m.block_cols} ({axes}) tiles, {rows} x {cols} = {total}: "
                     f"full {c['full']}, partial {c['partial']}, empty {c['empty']} "
                     f"({100 * c['empty'] / total:.1f}% skipped)")
    ways = {m.how for m in maps.values()}
    lines += [f"  from {how}" for how in sorted(ways)]
    lines += _hull_waste(facts, kernel_plan, sizes, maps, {
        "forward": (entry.fwd.block_m, entry.fwd.block_n, True),
        "dK/dV": (entry.bwd_dkdv.block_m, entry.bwd_dkdv.block_n, False),
        "dQ": (entry.bwd_dq.block_m, entry.bwd_dq.block_n, True)})
    costs = forward_costs(maps["forward"], q_len, kv_len, head_dim, head_dim_v, ELEMENT_BYTES[dtype])
    scope = "if every undecided tile is visited" if not maps["forward"].exact else "exact"
    lines += ["", f"forward work per (batch, head) ({scope})",
              f"  FLOPs: {describe_flops(costs.flops)} against {describe_flops(costs.dense_flops)} dense "
              f"({100 * costs.flops / costs.dense_flops:.1f}%)",
              f"  HBM traffic (predicted): {describe_bytes(costs.hbm_bytes)} against "
              f"{describe_bytes(costs.standard_hbm_bytes)} for standard attention, which writes and reads "
              f"the N x N scores and probabilities ({_how_much(costs.hbm_bytes, costs.standard_hbm_bytes)})"]
    return "\n".join(lines), maps


def _how_much(bytes_: float, standard: float) -> str:
    """How the kernels' traffic compares with standard attention's: short sequences with wide heads
    can move more bytes than the N x N matrices they avoid."""
    ratio = max(bytes_, standard) / min(bytes_, standard)
    if f"{ratio:.1f}" == "1.0":
        return "about the same"
    return f"{ratio:.1f}x {'less' if bytes_ < standard else 'more'}"


def plot(maps: dict[str, TileMap], title: str, path: Path) -> None:
    """Draw the tile maps (empty white, partial orange, full blue) into an image file."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import ListedColormap
        from matplotlib.patches import Patch
    except ImportError:
        raise ArgumentError("--plot needs matplotlib: pip install 'attngen[plot]'") from None
    colors = ListedColormap(["#ffffff", "#f28e2b", "#4e79a7"])  # EMPTY, PARTIAL, FULL
    fig, axes = plt.subplots(1, len(maps), figsize=(5 * len(maps), 5), squeeze=False)
    for ax, (name, m) in zip(axes[0], maps.items()):
        ax.imshow(m.grid.numpy(), cmap=colors, vmin=0, vmax=FULL, interpolation="nearest", aspect="auto")
        rows = "query" if name != "dK/dV" else "key"
        ax.set_title(f"{name}: {m.block_rows}x{m.block_cols} ({rows} x {'query' if rows == 'key' else 'key'}) tiles")
        ax.set_ylabel(f"{rows} tile")
        ax.set_xlabel("key tile" if rows == "query" else "query tile")
    fig.legend(handles=[Patch(facecolor=c, edgecolor="#999999", label=label) for c, label in
                        (("#4e79a7", "full: no mask code"), ("#f28e2b", "partial: masked"),
                         ("#ffffff", "empty: skipped"))], loc="lower center", ncol=3)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
