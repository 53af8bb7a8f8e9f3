"""Tile tables, host side: which table each kernel follows, building them at call time, and the TileTables a caller keeps."""

import torch

from .checks import _autocast
from .launch import _launch
from .plans import _plan_site
from .shared import _cdiv, _next_power_of_2, _pad


class TileTables:
    """The tile tables of one call's mask inputs, from tile_tables(q, k, v, **inputs), for
    attn(q, k, v, tile_tables=..., **inputs): the kernels follow them instead of building their own.
    They hold only which tiles the mask allows, computed from the inputs' values at build time:
    build them again whenever those values change, or calls give answers for the old mask."""

    def __init__(self, owner, sizes, device, built_for, keys, tables):
        self.owner = owner  # the Attention that built them: only its calls may follow them
        self.sizes = sizes  # (B, H, HKV, Q_LEN, KV_LEN)
        self.device = device
        self.built_for = built_for  # q's dtype and the head dims, which decide the tiles
        self.keys = keys  # kernel -> _table_key
        self.tables = tables  # kernel (_table_kernels) -> (counts, indices)

    def __repr__(self):
        return f"TileTables({self.owner.facts.name}, sizes={self.sizes}, {self.built_for}, device={self.device})"


def _pairs(flat):
    """Tables passed flat through an operator, (counts, indices) again."""
    return [tuple(flat[i:i + 2]) for i in range(0, len(flat), 2)]


def _built_for(q, v):
    return f"q dtype {q.dtype}, D={q.shape[-1]}, DV={v.shape[-1]}"


def _table_sampling(step, block):
    # (STEP, POINTS) for _table_points: an index the mask does not read needs one point per tile.
    if step is None:
        step = block
    if step == 0:
        return 0, 1
    return step, max(2, _next_power_of_2(-(-block // step) + 1))


# A mask that reads inputs gets its tables built on every call by default (two small kernels per table): a
# table cached against the input tensors would go stale on writes that their version counter does not see
# (`.data`, numpy or DLPack views) and could not key inference tensors at all. A caller whose mask inputs
# stay fixed builds them once with tile_tables() and passes them in; rebuilding them is the caller's job.
# A mask that reads no input (SpecFacts.static_tables) has tables that depend only on the kernel's tiles,
# the sizes it reads and the device: each is built on first use and kept, as a BlockMask built once. At
# most STATIC_TABLES are kept, for the Attention's life (past that, tables of new keys are built per call
# and not kept): a CUDA graph that captured a call reads the kept tensors, so none may be freed under it.
# Nor is one kept from inside a graph capture, whose memory belongs to the graph, nor from the custom
# operators a compiled graph runs (they use kept tables, and keep none): under mode="reduce-overhead"
# Inductor's CUDA-graph trees run a graph's first calls with every allocation in the trees' own pool,
# whose memory they later hand out again as they see fit (torch._inductor.cudagraph_trees'
# _use_cuda_memory_pool_manager), and nothing tells a call that it runs there.
STATIC_TABLES = 64


class Tables:
    """The tile tables of an Attention (a mixin: self is the Attention; self.table_stats counts the tables
    built, so tests can tell passed tables are reused)."""

    def _table_key(self, q, v, kernel):
        """Which table kernel 0 (the portable forward), 1 (dK/dV), 2 (dQ), a family's forward (by its
        name, one of TABLE_FAMILIES) or a family's backward (by its name in BACKWARD_FAMILIES) follows:
        (rows are query tiles, BLOCK_M, BLOCK_N); kernels with equal keys share a table. A family's
        backward walks query tiles for each key tile, as dK/dV does."""
        if isinstance(kernel, str):
            return (kernel not in self._backward_names(), *self._family_tiles(q, v, kernel)[:2])
        return (kernel != 1, *self._tiles(q, v, kernel)[:2])

    def _table_kernels(self, backward):
        """The kernels whose tables travel with a call, in this order: the forwards' (the portable one's,
        then those of TABLE_FAMILIES), then, with `backward`, dK/dV's, dQ's and those of BACKWARD_FAMILIES."""
        return [0, *self.facts.table_families, *([1, 2, *self._backward_names()] if backward else [])]

    def _backward_names(self):
        return [name for _, name, _, _ in self.backward_families]

    def _table_shape(self, by_query, block_m, block_n, sizes):
        """(batch groups, head groups, rows per group, columns) of the tile table of tiles (block_m,
        block_n); by_query: rows are query tiles (forward, dQ), else key tiles (dK/dV)."""
        B, H, HKV, Q_LEN, KV_LEN = sizes
        n_q, n_k = _cdiv(Q_LEN, block_m), _cdiv(KV_LEN, block_n)
        n_rows, n_cols = (n_q, n_k) if by_query else (n_k, n_q)
        return (B if self.facts.table_per_b else 1), (H if self.facts.table_per_h else 1), n_rows, n_cols

    def _empty_table(self, key, sizes, device):
        """Uninitialised (counts, indices) tensors of the tile table `key`: per row, two counts (tiles
        visited with and without mask code) and the column indices."""
        g_b, g_h, n_rows, n_cols = self._table_shape(*key, sizes)
        rows = g_b * g_h * n_rows
        return (torch.empty((rows * 2,), dtype=torch.int32, device=device),
                torch.empty((rows * n_cols,), dtype=torch.int32, device=device))

    def _table_args(self, key, table, sizes, placeholder=None):
        """A kernel's tile-table arguments: counts, indices, batch stride, head stride, row length. A
        forward call without its table (a cache call: FOLLOW_TABLE off) passes `placeholder`, never read."""
        if not self.facts.tile_table:
            return []
        if not table:
            return [placeholder, placeholder, 0, 0, 0]
        g_b, g_h, n_rows, n_cols = self._table_shape(*key, sizes)
        return [*table, (g_h * n_rows if self.facts.table_per_b else 0), (n_rows if self.facts.table_per_h else 0), n_cols]

    def _resolve(self, kernels, q, v, known, build):
        """Each of `kernels`' tile table (counts, indices): known[kernel] (the user's, or one this call
        built), else a known table of a kernel with the same tiles, else build(key), which is then known."""
        result = []
        for kernel in kernels:
            if kernel not in known:
                key = self._table_key(q, v, kernel)
                same = [table for other, table in known.items() if self._table_key(q, v, other) == key]
                known[kernel] = same[0] if same else build(key)
            result.append(known[kernel])
        return result

    def _builder(self, sizes, device, tensors, plan=None, store=True):
        """build(key) for _resolve: runs the two table kernels (bound in `plan`, if given); without `store`
        (the custom operators'), a static table built is not kept (STATIC_TABLES says why)."""
        return lambda key: self._build_table(key, sizes, device, tensors, plan, store=store)

    def _checked_tables(self, tables, q, v, sizes):
        """The tables of a user's TileTables, after checking they were built for a call like this one."""
        if not isinstance(tables, TileTables) or tables.owner is not self:
            self._fail(f"tile_tables must come from this attention's tile_tables(q, k, v, **inputs), got {tables!r}")
        if tables.sizes != sizes:
            self._fail(f"tile_tables must be built for this call's (B, H, HKV, Q_LEN, KV_LEN) = {sizes}, "
                  f"got tables for {tables.sizes}")
        if tables.device != q.device:
            self._fail(f"tile_tables must be on {q.device} like q, got {tables.device}")
        if any(tables.keys[kernel] != self._table_key(q, v, kernel) for kernel in self._table_kernels(True)):
            self._fail(f"tile_tables must be built for this call's {_built_for(q, v)} (they decide the tiles), "
                  f"got tables for {tables.built_for}")
        return dict(tables.tables)

    def _static_key(self, key, sizes, device):
        """The key of a kept table (SpecFacts.static_tables): the tiles, the sizes the mask reads, the device."""
        named = dict(zip(("B", "H", "HKV", "Q_LEN", "KV_LEN"), sizes))
        return key, tuple(named[name] for name in self.facts.static_tables), device

    def _build_table(self, key, sizes, device, tensors, plan=None, keep=True, store=True):
        """(counts, indices) of the tile table `key` (_table_key) of these mask inputs; () when the
        kernels follow no table. `plan`: the call's _CallPlan, which binds the two launches. With `keep`, a
        static table (SpecFacts.static_tables) comes from those kept, else is built, and kept if `store`;
        without `keep`, it is built anew."""
        if not self.facts.tile_table:
            return ()
        if self.facts.static_tables is None or not keep:
            return self._classified(key, sizes, device, tensors, plan)
        static = self._static_key(key, sizes, device)
        table = self.static_tables.get(static)
        if table is None:
            table = self._classified(key, sizes, device, tensors, plan)
            capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
            if store and not capturing and len(self.static_tables) < STATIC_TABLES:
                self.static_tables[static] = table
        return table

    def _classified(self, key, sizes, device, tensors, plan=None):
        """(counts, indices) of the tile table `key`, built now by its two launches."""
        by_query, block_m, block_n = key
        B, H, HKV, Q_LEN, KV_LEN = sizes
        g_b, g_h, n_rows, n_cols = self._table_shape(*key, sizes)
        state = torch.empty((g_b * g_h * n_rows * n_cols,), dtype=torch.int8, device=device)
        num, idx = self._empty_table(key, sizes, device)
        classify = self.kernels.table_by_query_classify if by_query else self.kernels.table_by_key_classify
        q_step, q_points = _table_sampling(self.facts.table_steps["q"], block_m)
        k_step, k_points = _table_sampling(self.facts.table_steps["k"], block_n)
        (row_step, row_points), (loop_step, loop_points) = (
            ((q_step, q_points), (k_step, k_points)) if by_query else ((k_step, k_points), (q_step, q_points)))
        _launch(classify, (n_rows, n_cols, g_b * g_h), state, *self._input_args(tensors), B, H, HKV, Q_LEN, KV_LEN,
                g_h, n_rows, n_cols, BLOCK_M=block_m, BLOCK_N=block_n, ROW_STEP=row_step, ROW_POINTS=row_points,
                LOOP_STEP=loop_step, LOOP_POINTS=loop_points, num_warps=4, bind=_plan_site(plan, "classify", key))
        _launch(self.kernels.table_compact, (g_b * g_h * n_rows,), state, num, idx, n_cols, COLS=_pad(n_cols), num_warps=4,
                bind=_plan_site(plan, "compact", key))
        self.table_stats["built"] += 1
        return num, idx

    def tile_tables(self, q, k, v, **inputs):
        """The tile tables of these mask inputs' current values, to pass to attn(q, k, v,
        tile_tables=..., **inputs) in calls of the same sizes, dtype, head dims and device, so those
        calls skip building them. Build them again whenever the values the mask reads change (a table
        cannot tell), as with FlexAttention's BlockMask. A spec whose mask needs no tables gets an
        empty object, so code can pass one whatever the spec."""
        q, k, v = _autocast(q, k, v)  # the call's dtype decides the tiles
        inputs = self._reduced(inputs)
        B, H, HKV, Q_LEN, KV_LEN, _, _ = self._check(q, k, v, inputs)
        sizes = (B, H, HKV, Q_LEN, KV_LEN)
        tensors = [inputs[name].contiguous() for name in self.facts.inputs]
        known = {}
        # Under torch.compile the table operator builds them, as in a call (the kernels' launch is not traceable).
        build = self._operator_builder(q, k, tensors) if torch.compiler.is_compiling() else self._builder(sizes, q.device, tensors)
        self._resolve(self._table_kernels(True), q, v, known, build)
        keys = {kernel: self._table_key(q, v, kernel) for kernel in self._table_kernels(True)}
        return TileTables(self, sizes, q.device, _built_for(q, v), keys, known)
