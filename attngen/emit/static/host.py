"""The host side of every generated module: argument checks, tile tables, launches, autograd and the
torch.compile operators, reading the spec's facts from the names the module's preamble defines."""

import contextlib
import weakref

import torch

from attngen.emit.static.helpers import LOG2E
from attngen.emit.static.launch import _launch
from attngen.plan.shared import (INTERPRETING, _DTYPES, _INPUT_DTYPES, _cdiv, _empty_in_layout,
                                       _next_power_of_2, _pad, _tile_widths)

# ---- inlined into every generated module from here on ----

# --- host side: argument checks, launches, autograd -------------------------------------------
def _widths(D, DV):
    """Tile widths of the head dims (HEAD_DIM_PAD, HEAD_DIM_V_PAD), as Plan.widths gives them."""
    return _tile_widths(D, DV, MASKED_WIDTH_FLOOR)


def _fail(message):
    if torch.compiler.is_compiling():
        _raise_while_tracing(f"{SPEC_NAME}: {message}")
    raise ValueError(f"{SPEC_NAME}: {message}")


# A `raise` in code dynamo traces is, under fullgraph=True, dynamo's own "Observed exception", with
# the message only in its __cause__. A function dynamo calls instead of tracing (one marked
# assume_constant_result) raises past it, and dynamo hands an error that is also its UserError to the
# caller unwrapped (it adds the user code's lines to the message). So the caller of a compiled
# function gets the eager ValueError, with or without fullgraph, and the successful path is unchanged.
def _raise_while_tracing(message):
    from torch._dynamo.exc import UserError, UserErrorType  # loaded already: dynamo is tracing

    error = type("ValueError", (UserError, ValueError), {})  # UserError first: its __init__; named as the eager error
    raise error(UserErrorType.INVALID_INPUT, message)


# What torch.compiler.assume_constant_result sets, without importing dynamo (seconds) in every process.
_raise_while_tracing._dynamo_marked_constant = True


def _check(q, k, v, inputs):
    """The sizes (B, H, HKV, Q_LEN, KV_LEN, D, DV) of a call with k and v (B, HKV, KV_LEN, D/DV),
    after checking the tensors and the inputs."""
    _check_tensors(q, k, v)
    B, H, Q_LEN, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        _fail(f"k and v must have batch size {B} like q, got {k.shape[0]} and {v.shape[0]}")
    HKV, KV_LEN = k.shape[1], k.shape[2]
    if v.shape[1] != HKV or v.shape[2] != KV_LEN:
        _fail(f"v must have {HKV} heads and length {KV_LEN} like k, got shape {tuple(v.shape)}")
    _check_sizes(B, H, HKV, Q_LEN, KV_LEN, D, v.shape[3], inputs, q.device)
    return B, H, HKV, Q_LEN, KV_LEN, D, v.shape[3]


# --- call plans: what a call's facts decide, worked out once per set of facts ---------------------
# A short call's host time is Python: the checks, the families' per-call rules, the launches' argument
# facts. All of them read only what _call_facts collects of the call's tensors, so a call whose facts
# recur reuses the first one's decisions: it passed the same checks, goes to the same family, and the
# launch sites it binds (_plan_site) take arguments of the same facts.
class _CallPlan:
    """The decisions of calls with one set of facts: their sizes (B, H, HKV, Q_LEN, KV_LEN, D, DV) after
    the checks passed, the forward's (family, launch) and the backward's (family, name, launch), the
    launches bound by site, and the plans of their backwards by the facts of dO and dLSE
    (_backward_plan)."""

    __slots__ = ("sizes", "family", "backward_family", "launches", "backwards")

    def __init__(self, sizes, family, backward_family):
        self.sizes, self.family, self.backward_family = sizes, family, backward_family
        self.launches, self.backwards = {}, {}


_CALL_PLANS = {}
_CALL_PLAN_KEYS = 256  # then they are dropped and start over, as _LAUNCHES's keys are


def _call_facts(q, k, v, inputs):
    """Everything the checks, the per-call rules and the bound launch sites read of a call's tensors:
    the inputs' names, the current device, and each tensor's dtype, device, shape, strides and 16-byte
    alignment; None when one of them is not a plain dense tensor or parameter (a subclass may answer
    these differently from call to call: such calls are checked in full every time)."""
    tensors = (q, k, v, *inputs.values())
    for t in tensors:
        if t.__class__ is not torch.Tensor and t.__class__ is not torch.nn.Parameter:
            return None
        if t.layout != torch.strided or t.is_nested:  # no strides to key on: _check refuses them
            return None
    return (tuple(inputs), torch.cuda.current_device() if q.is_cuda else None,
            *[(t.dtype, t.device, t.shape, t.stride(), t.data_ptr() % 16 == 0) for t in tensors])


def _call_plan(q, k, v, inputs):
    """The _CallPlan of a call of these tensors: a new one after _check passes, unless a call with the
    same facts made one already."""
    facts = _call_facts(q, k, v, inputs)
    plan = _CALL_PLANS.get(facts) if facts is not None else None
    if plan is None:
        sizes = _check(q, k, v, inputs)
        # Both families once per facts, whether the call then runs a backward (or is a cache call) or not.
        plan = _CallPlan(sizes, _forward_family(q, k, v, sizes[2], sizes[4], False), _backward_family(q, k, v))
        if facts is not None:
            if len(_CALL_PLANS) >= _CALL_PLAN_KEYS:
                _CALL_PLANS.clear()
            _CALL_PLANS[facts] = plan
    return plan


def _backward_plan(plan, do, dlse):
    """The plan of a backward of a call of `plan` with this dO and dLSE: their facts (dtype, strides,
    16-byte alignment; their shapes are out's and LSE's) decide the backward launches' arguments beside
    the call's. None without a plan, or for a tensor subclass."""
    if plan is None:
        return None
    upstream = (do, dlse) if dlse is not None else (do,)
    if any(t.__class__ is not torch.Tensor for t in upstream):
        return None
    facts = tuple((t.dtype, t.stride(), t.data_ptr() % 16 == 0) for t in upstream)
    backward = plan.backwards.get(facts)
    if backward is None:
        if len(plan.backwards) >= 16:
            plan.backwards.clear()
        backward = plan.backwards[facts] = _CallPlan(plan.sizes, plan.family, plan.backward_family)
    return backward


def _plan_site(plan, *site):
    """_launch's `bind` for a launch site of a call with this plan (None: none, the launch binds by its facts).
    `site` tells apart the launches of one kernel in a call: it names the site and anything of the call
    besides the plan's facts that its arguments depend on."""
    return None if plan is None else (plan.launches, site)


def _autocast(q, k, v):
    """q, k and v as torch.autocast hands them to scaled_dot_product_attention, which it runs in the
    lower precision on CUDA and the CPU: float tensors cast to the autocast dtype, while autocast is on for
    q's device. The custom operators have no autocast rule, so the cast is Python here, traced under
    torch.compile; .to() is differentiable, so gradients come back in the caller's dtypes."""
    if not isinstance(q, torch.Tensor) or not torch.is_autocast_enabled(q.device.type):
        return q, k, v
    dtype = torch.get_autocast_dtype(q.device.type)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype in _DTYPES else t for t in (q, k, v))


def _check_tensors(q, k, v):
    """q, k and v: 4-D tensors of one float dtype on one device, unit stride along the head dim."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided or t.is_nested:
            _fail(f"{name} must be a dense tensor, got a {'nested' if t.is_nested else t.layout} one")
        if t.dim() != 4:
            _fail(f"{name} must have 4 dims (B, heads, length, head_dim), got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            _fail(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
        if t.device != q.device:
            _fail(f"{name} must be on {q.device} like q, got {t.device}")
        if t.stride(-1) != 1:
            _fail(f"{name} must be contiguous in its last dim (head_dim), got strides {t.stride()}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        _fail(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.device.type != "cuda" and not INTERPRETING:
        _fail(f"q must be on a CUDA device, got {q.device} (set TRITON_INTERPRET=1 to run on the CPU)")
    if k.shape[-1] != q.shape[-1]:
        _fail(f"k must have head_dim {q.shape[-1]} like q, got shape {tuple(k.shape)}")


def _check_sizes(B, H, HKV, Q_LEN, KV_LEN, D, DV, inputs, device):
    """The call's sizes against the module's limits, then the inputs against the spec's declarations."""
    if HKV == 0 or H % HKV != 0:
        _fail(f"the query heads ({H}) must be a multiple of the key/value heads ({HKV})")
    if not (1 <= D <= 256 and 1 <= DV <= 256):
        _fail(f"head dims must be between 1 and 256, got D={D}, DV={DV}")
    if min(B, H, Q_LEN, KV_LEN) < 1:
        _fail(f"B, H, Q_LEN and KV_LEN must be at least 1, got {B}, {H}, {Q_LEN}, {KV_LEN}")
    if max(Q_LEN, KV_LEN) > MAX_LENGTH:
        _fail(f"Q_LEN and KV_LEN must be at most {MAX_LENGTH} ({MAX_LENGTH_REASON}), got {Q_LEN} and {KV_LEN}")
    if B * H > MAX_BATCH_HEADS:
        _fail(f"B * H must be at most {MAX_BATCH_HEADS} (the launch grid's limit), got {B} * {H}")
    sizes = {"B": B, "H": H, "HKV": HKV, "Q_LEN": Q_LEN, "KV_LEN": KV_LEN}
    missing = [n for n in INPUTS if n not in inputs]
    if missing:
        _fail("missing input(s): " + ", ".join(f"{n}: {_declared(n)}" for n in missing))
    unknown = [n for n in inputs if n not in INPUTS]
    if unknown:
        _fail(f"unknown input(s) {', '.join(map(repr, unknown))}; the spec declares "
              + (", ".join(INPUTS) or "none"))
    for name, (dtype, dims, learnable) in INPUTS.items():
        t = inputs[name]
        if not isinstance(t, torch.Tensor):
            _fail(f"input '{name}' must be a torch.Tensor {_declared(name)}, got {type(t).__name__}")
        if t.layout != torch.strided or t.is_nested:
            _fail(f"input '{name}' must be a dense tensor {_declared(name)}, got a "
                  f"{'nested' if t.is_nested else t.layout} one")
        if t.dtype != _INPUT_DTYPES[dtype]:
            _fail(f"input '{name}' must have dtype {_INPUT_DTYPES[dtype]} ({_declared(name)}), got {t.dtype}")
        if t.device != device:
            _fail(f"input '{name}' must be on {device} like q, got {t.device}")
        expected = [sizes.get(d, d) for d in dims]
        if t.dim() != len(dims) or any(e != "*" and e != n for e, n in zip(expected, t.shape)):
            want = "(" + ", ".join(str(e) if e != "*" else "*" for e in expected) + ")"
            _fail(f"input '{name}' must have shape {want} ({_declared(name)}), got {tuple(t.shape)}")


def _declared(name):
    dtype, dims, learnable = INPUTS[name]
    return f"{dtype}[{', '.join(map(str, dims))}]" + (" learnable" if learnable else "")


def _input_args(tensors):
    # Per input: pointer, then one stride and one size per dim (bool is read as bytes).
    args = []
    for name, t in zip(INPUTS, tensors):
        args.append(t.view(torch.uint8) if t.dtype == torch.bool else t)
        args.extend(t.stride())
        args.extend(t.shape)
    return args


def _tiles(q, v, kernel):
    # The head dims pick the tiles and the kernels' constexprs: under torch.compile with dynamic
    # shapes int() makes them static (a guard), as they are for the kernels.
    return PLAN[(*_widths(int(q.shape[-1]), int(v.shape[-1])), _DTYPES[q.dtype])][kernel]


# Per device: its SM count (the decode family's splits, the Hopper forward's persistent grid).
_SM_COUNTS = {}


def _sm_count(device):
    # Triton's interpreter on the CPU: a few "SMs", so tests split the keys.
    if device.type != "cuda":
        return 4
    if device not in _SM_COUNTS:
        _SM_COUNTS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNTS[device]


def _family_tiles(q, v, family):
    """A kernel family's (BLOCK_M, BLOCK_N, num_warps, num_stages, buffers) for these head dims and dtype
    (FAMILY_TILES; int() as in _tiles)."""
    return FAMILY_TILES[(*_widths(int(q.shape[-1]), int(v.shape[-1])), _DTYPES[q.dtype])][family]


def _dot_precision(dtype):
    # fp32 inputs get true fp32 products (tf32 would not be fp32 attention); so do bf16 inputs in
    # Triton's interpreter, whose bf16 tl.dot is wrong (_dot upcasts them; the products are exact).
    if dtype == torch.float32 or (dtype == torch.bfloat16 and INTERPRETING):
        return "ieee"
    return "tf32"


# --- tile tables: built at call time from the inputs the mask reads --------------------------------
# Built on every call by default (two small kernels per table): a table cached against the input
# tensors would go stale on writes that their version counter does not see (`.data`, numpy or
# DLPack views) and could not key inference tensors at all. A caller whose mask inputs stay fixed
# builds them once with tile_tables() and passes them in; rebuilding them is the caller's job.
TABLE_STATS = {"built": 0}  # instrumentation: tables built, so tests can tell passed tables are reused


class TileTables:
    """The tile tables of one call's mask inputs, from tile_tables(q, k, v, **inputs), for
    attn(q, k, v, tile_tables=..., **inputs): the kernels follow them instead of building their own.
    They hold only which tiles the mask allows, computed from the inputs' values at build time:
    build them again whenever those values change, or calls give answers for the old mask."""

    def __init__(self, sizes, device, built_for, keys, tables):
        self.sizes = sizes  # (B, H, HKV, Q_LEN, KV_LEN)
        self.device = device
        self.built_for = built_for  # q's dtype and the head dims, which decide the tiles
        self.keys = keys  # kernel -> _table_key
        self.tables = tables  # kernel (_table_kernels) -> (counts, indices)

    def __repr__(self):
        return f"TileTables({SPEC_NAME}, sizes={self.sizes}, {self.built_for}, device={self.device})"


def _table_key(q, v, kernel):
    """Which table kernel 0 (the portable forward), 1 (dK/dV), 2 (dQ), a family's forward (by its
    name, one of TABLE_FAMILIES) or a family's backward (by its name in BACKWARD_FAMILIES) follows:
    (rows are query tiles, BLOCK_M, BLOCK_N); kernels with equal keys share a table. A family's
    backward walks query tiles for each key tile, as dK/dV does."""
    if isinstance(kernel, str):
        return (kernel not in _backward_names(), *_family_tiles(q, v, kernel)[:2])
    return (kernel != 1, *_tiles(q, v, kernel)[:2])


def _table_kernels(backward):
    """The kernels whose tables travel with a call, in this order: the forwards' (the portable one's,
    then those of TABLE_FAMILIES), then, with `backward`, dK/dV's, dQ's and those of BACKWARD_FAMILIES."""
    return [0, *TABLE_FAMILIES, *([1, 2, *_backward_names()] if backward else [])]


def _backward_names():
    return [name for _, name, _, _ in BACKWARD_FAMILIES]


def _pairs(flat):
    """Tables passed flat through an operator, (counts, indices) again."""
    return [tuple(flat[i:i + 2]) for i in range(0, len(flat), 2)]


def _table_shape(by_query, block_m, block_n, sizes):
    """(batch groups, head groups, rows per group, columns) of the tile table of tiles (block_m,
    block_n); by_query: rows are query tiles (forward, dQ), else key tiles (dK/dV)."""
    B, H, HKV, Q_LEN, KV_LEN = sizes
    n_q, n_k = _cdiv(Q_LEN, block_m), _cdiv(KV_LEN, block_n)
    n_rows, n_cols = (n_q, n_k) if by_query else (n_k, n_q)
    return (B if TABLE_PER_B else 1), (H if TABLE_PER_H else 1), n_rows, n_cols


def _empty_table(key, sizes, device):
    """Uninitialised (counts, indices) tensors of the tile table `key`: per row, two counts (tiles
    visited with and without mask code) and the column indices."""
    g_b, g_h, n_rows, n_cols = _table_shape(*key, sizes)
    rows = g_b * g_h * n_rows
    return (torch.empty((rows * 2,), dtype=torch.int32, device=device),
            torch.empty((rows * n_cols,), dtype=torch.int32, device=device))


def _table_args(key, table, sizes, placeholder=None):
    """A kernel's tile-table arguments: counts, indices, batch stride, head stride, row length. A
    forward call without its table (a cache call: FOLLOW_TABLE off) passes `placeholder`, never read."""
    if not TILE_TABLE:
        return []
    if not table:
        return [placeholder, placeholder, 0, 0, 0]
    g_b, g_h, n_rows, n_cols = _table_shape(*key, sizes)
    return [*table, (g_h * n_rows if TABLE_PER_B else 0), (n_rows if TABLE_PER_H else 0), n_cols]


def _resolve(kernels, q, v, known, build):
    """Each of `kernels`' tile table (counts, indices): known[kernel] (the user's, or one this call
    built), else a known table of a kernel with the same tiles, else build(key), which is then known."""
    result = []
    for kernel in kernels:
        if kernel not in known:
            key = _table_key(q, v, kernel)
            same = [table for other, table in known.items() if _table_key(q, v, other) == key]
            known[kernel] = same[0] if same else build(key)
        result.append(known[kernel])
    return result


def _builder(sizes, device, tensors, plan=None):
    """build(key) for _resolve in eager calls: runs the two table kernels (bound in `plan`, if given)."""
    return lambda key: _build_table(key, sizes, device, tensors, plan)


def _checked_tables(tables, q, v, sizes):
    """The tables of a user's TileTables, after checking they were built for a call like this one."""
    if not isinstance(tables, TileTables):
        _fail(f"tile_tables must come from this attention's tile_tables(q, k, v, **inputs), got {tables!r}")
    if tables.sizes != sizes:
        _fail(f"tile_tables must be built for this call's (B, H, HKV, Q_LEN, KV_LEN) = {sizes}, "
              f"got tables for {tables.sizes}")
    if tables.device != q.device:
        _fail(f"tile_tables must be on {q.device} like q, got {tables.device}")
    if any(tables.keys[kernel] != _table_key(q, v, kernel) for kernel in _table_kernels(True)):
        _fail(f"tile_tables must be built for this call's {_built_for(q, v)} (they decide the tiles), "
              f"got tables for {tables.built_for}")
    return dict(tables.tables)


def _built_for(q, v):
    return f"q dtype {q.dtype}, D={q.shape[-1]}, DV={v.shape[-1]}"


def _build_table(key, sizes, device, tensors, plan=None):
    """(counts, indices) of the tile table `key` (_table_key) of these mask inputs; () when the
    kernels follow no table. `plan`: the call's _CallPlan, which binds the two launches."""
    if not TILE_TABLE:
        return ()
    by_query, block_m, block_n = key
    B, H, HKV, Q_LEN, KV_LEN = sizes
    g_b, g_h, n_rows, n_cols = _table_shape(*key, sizes)
    state = torch.empty((g_b * g_h * n_rows * n_cols,), dtype=torch.int8, device=device)
    num, idx = _empty_table(key, sizes, device)
    classify = _table_by_query_classify if by_query else _table_by_key_classify
    q_step, q_points = _table_sampling(TABLE_STEPS["q"], block_m)
    k_step, k_points = _table_sampling(TABLE_STEPS["k"], block_n)
    (row_step, row_points), (loop_step, loop_points) = (
        ((q_step, q_points), (k_step, k_points)) if by_query else ((k_step, k_points), (q_step, q_points)))
    _launch(classify, (n_rows, n_cols, g_b * g_h), state, *_input_args(tensors), B, H, HKV, Q_LEN, KV_LEN,
            g_h, n_rows, n_cols, BLOCK_M=block_m, BLOCK_N=block_n, ROW_STEP=row_step, ROW_POINTS=row_points,
            LOOP_STEP=loop_step, LOOP_POINTS=loop_points, num_warps=4, bind=_plan_site(plan, "classify", key))
    _launch(_table_compact, (g_b * g_h * n_rows,), state, num, idx, n_cols, COLS=_pad(n_cols), num_warps=4,
            bind=_plan_site(plan, "compact", key))
    TABLE_STATS["built"] += 1
    return num, idx


def _table_sampling(step, block):
    # (STEP, POINTS) for _table_points: an index the mask does not read needs one point per tile.
    if step is None:
        step = block
    if step == 0:
        return 0, 1
    return step, max(2, _next_power_of_2(-(-block // step) + 1))


def _sizes(q, k):
    """(B, H, HKV, Q_LEN, KV_LEN) of a call."""
    return (q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2])


def _forward(q, k, v, tensors, tables, visits=None, cache=None, page_table=None, family=None, plan=None):
    """Runs the forward pass with the first family whose per-call rule admits this call
    (FORWARD_FAMILIES, in the plan's order), else the portable one; `tables` holds the tile tables
    (counts, indices) at hand by kernel (_table_kernels), and the family follows its own, if there;
    `cache` is a cache call's (kv_len, q_offset), either None; `page_table` a paged cache's;
    `family` the call's (name, launch) when the caller has it already (_forward_family); `plan` the
    call's _CallPlan, which binds the launches (never with visits, a cache or the user's tables).
    Counting visits (visit_counts) follows the portable tiles."""
    cached = cache is not None or page_table is not None
    if visits is not None:
        family = ("portable", None)
    elif family is None:
        family = _forward_family(q, k, v, *_kv_layout(k, v, page_table)[:2], cached)
    name, launch = family
    if launch is not None:
        return launch(q, k, v, tensors, tables.get(name, ()), cache, page_table, plan=plan)
    return _portable_forward(q, k, v, tensors, tables.get(0, ()), visits, cache, page_table, plan=plan)


def _forward_family(q, k, v, HKV, KV_LEN, cached, after=None, packed=False):
    """(name, launch) of the first family of FORWARD_FAMILIES (those after the family named `after`,
    if given) whose per-call rule admits a call of these tensors over HKV heads of KV_LEN keys
    (`cached`: a cache call; k holds pages if paged; `packed`: a packed call's (1, heads, TOTAL, D)
    views, which only PACKED_FAMILIES take); ("portable", None) when none does."""
    names = [name for name, _, _ in FORWARD_FAMILIES]
    families = FORWARD_FAMILIES[names.index(after) + 1:] if after is not None else FORWARD_FAMILIES
    return next(((name, launch) for name, serves, launch in families
                 if (not packed or name in PACKED_FAMILIES) and serves(q, k, v, HKV, KV_LEN, cached)),
                ("portable", None))


def _forward_with_tables(q, k, v, tensors, known, build, plan=None):
    """A training or inference call's forward (no cache), with the tile table of the family that runs
    it: known[kernel] (the user's) or build(key), which is then known. The family is chosen once: it
    decides which table to build and which kernel follows it; a call's _CallPlan has it, and binds the
    launches."""
    family = plan.family if plan is not None else _forward_family(q, k, v, k.shape[1], k.shape[2], False)
    kernels = _forward_tables(family[0])
    return _forward(q, k, v, tensors, dict(zip(kernels, _resolve(kernels, q, v, known, build))), family=family,
                    plan=plan)


def _forward_tables(name):
    """The kernels whose tile tables a forward call run by the family `name` needs built: the portable
    forward's, or a family's own if it follows tables (TABLE_FAMILIES; the others decide such masks
    element by element); none if the mask needs no tables."""
    if not TILE_TABLE:
        return []
    return [0] if name == "portable" else [name] if name in TABLE_FAMILIES else []


def _kv_layout(k, v, page_table, placeholder=None):
    """How a forward kernel reads the keys and values: (HKV, KV_LEN, k's and v's strides, the
    PageTable, stride_pt and NUM_PAGES arguments, the PAGED and PAGE_SIZE constexprs). A contiguous
    cache's strides are (batch, head, key, dim); a paged one's (page, head, slot, dim), and its
    KV_LEN is MAX_PAGES * PAGE_SIZE. `placeholder` stands in for an absent page table (never read)."""
    if page_table is None:
        return (k.shape[1], k.shape[2], k.stride(), v.stride(), (placeholder, 0, 1),
                dict(PAGED=False, PAGE_SIZE=1))
    paged_strides = lambda t: (t.stride(0), t.stride(2), t.stride(1), t.stride(3))  # noqa: E731
    return (k.shape[2], page_table.shape[1] * k.shape[1], paged_strides(k), paged_strides(v),
            (page_table, page_table.stride(0), k.shape[0]), dict(PAGED=True, PAGE_SIZE=k.shape[1]))


def _cache_launch(cache, placeholder):
    """A forward kernel's cache arguments: (KvLen, QOffset) tensors (`placeholder` where absent,
    never read) and their HAS_KV_LEN / HAS_Q_OFFSET flags."""
    kv_len, q_offset = cache if cache is not None else (None, None)
    args = [kv_len if kv_len is not None else placeholder, q_offset if q_offset is not None else placeholder]
    return args, dict(HAS_KV_LEN=kv_len is not None, HAS_Q_OFFSET=q_offset is not None)


def _packed_launch(packed, placeholder):
    """A portable kernel's packed-call arguments: (CuSeqlensQ, CuSeqlensK, TOTAL_Q) and its VARLEN flag;
    `packed` is a packed call's (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, TOTAL_Q), or None
    (then `placeholder` stands in for the offsets, never read)."""
    if packed is None:
        return [placeholder, placeholder, 0], dict(VARLEN=False)
    return [packed[0], packed[1], packed[4]], dict(VARLEN=True)


def _batch_strides(t, packed):
    """t's strides as a kernel takes them: (batch, head, row, column), the batch stride 0 in a packed call,
    whose (1, heads, TOTAL, D) view a program enters at its sequence's first token instead."""
    return (0, *t.stride()[1:]) if packed is not None else t.stride()


def _call_sizes(q, k, packed):
    """(B, H, HKV, Q_LEN, KV_LEN) as the portable kernels take them: a packed call's B is its number of
    sequences and its lengths the longest sequence's (the grid's)."""
    if packed is None:
        return _sizes(q, k)
    return (packed[0].shape[0] - 1, q.shape[1], k.shape[1], packed[2], packed[3])


def _portable_forward(q, k, v, tensors, table, visits=None, cache=None, page_table=None, plan=None, packed=None):
    """Runs the portable forward kernel; `table` is its tile table (counts, indices), () without one;
    `cache`, `page_table` and `plan` as for _forward; `packed` a packed call's (cu_seqlens_q, cu_seqlens_k,
    max_seqlen_q, max_seqlen_k, TOTAL_Q), whose q, k and v are (1, heads, TOTAL, D) views (_packed_view);
    its LSE is (1, H, TOTAL_Q)."""
    _, H, Q_ROWS, D = q.shape
    DV = v.shape[3]
    sm_scale = softmax_scale(D)
    out = _empty_in_layout(q, DV)
    lse = torch.empty((q.shape[0], H, Q_ROWS), dtype=torch.float32, device=q.device)
    HKV, KV_LEN, k_strides, v_strides, page_args, paging = _kv_layout(k, v, page_table, lse)
    B, Q_LEN = q.shape[0], Q_ROWS
    if packed is not None:
        B, _, _, Q_LEN, KV_LEN = _call_sizes(q, k, packed)
        k_strides, v_strides = _batch_strides(k, packed), _batch_strides(v, packed)
    block_m, block_n, warps, stages = _tiles(q, v, 0)
    d_pad, dv_pad = _widths(D, DV)
    grid = (_cdiv(Q_LEN, block_m), B * H)
    cache_args, cache_flags = _cache_launch(cache, lse)
    packed_args, packed_flags = _packed_launch(packed, lse)
    table_args = _table_args(_table_key(q, v, 0), table, _sizes(q, k), placeholder=lse)
    _launch(
        _fwd_kernel, grid, q, k, v, out, lse, sm_scale, sm_scale * LOG2E.value,
        *_batch_strides(q, packed), *k_strides, *v_strides, *_batch_strides(out, packed),
        *_input_args(tensors), *table_args,
        B, H, HKV, Q_LEN, KV_LEN, visits if visits is not None else lse, *cache_args, *page_args, *packed_args,
        HEAD_DIM=D, HEAD_DIM_V=DV, HEAD_DIM_PAD=d_pad, HEAD_DIM_V_PAD=dv_pad,
        BLOCK_M=block_m, BLOCK_N=block_n, COUNT_VISITS=visits is not None, FOLLOW_TABLE=bool(table),
        DOT_PRECISION=_dot_precision(q.dtype), num_warps=warps, num_stages=stages, **cache_flags, **paging,
        **packed_flags, bind=_plan_site(plan, "forward", bool(table)))
    return out, lse


_SIDE_STREAMS = {}


def _side_stream(device):
    if device.type != "cuda":
        return None
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


def _backward_with_tables(q, k, v, out, lse, do, dlse, tensors, known, build, plan=None):
    """The backward pass by the first family of BACKWARD_FAMILIES whose rule admits the call, else the
    portable one, with the tile tables it follows: known[kernel] (the user's, or the forward's where the
    tiles agree) or build(key). `plan`: the call's _CallPlan, which has the family and binds the
    launches. Returns dq, dk, dv and one gradient per input (None for inputs that are not learnable)."""
    _, name, launch = plan.backward_family if plan is not None else _backward_family(q, k, v)
    kernels = ([1, 2] if launch is None else [name]) if TILE_TABLE else []
    tables = dict(zip(kernels, _resolve(kernels, q, v, known, build)))
    plan = _backward_plan(plan, do, dlse)
    if launch is not None:
        return launch(q, k, v, out, lse, do, dlse, tensors, tables.get(name, ()), plan=plan)
    return _portable_backward(q, k, v, out, lse, do, dlse, tensors, (tables.get(1, ()), tables.get(2, ())),
                              plan=plan)


def _backward_family(q, k, v, packed=False):
    """(family, backward name, launch) of the first family of BACKWARD_FAMILIES whose rule admits a call
    of these tensors (`packed`: a packed call's views, which only PACKED_BACKWARD_FAMILIES take);
    ("portable", "portable", None) when none does."""
    return next(((family, name, launch) for family, name, serves, launch in BACKWARD_FAMILIES
                 if (not packed or family in PACKED_BACKWARD_FAMILIES) and serves(q, k, v)),
                ("portable", "portable", None))


def _row_terms(out, do, dlse, lse=None, q_rows=None, dq_sum=None, plan=None):
    """(delta, lse2): delta = rowsum(dO * O) - dLSE, the softmax backward's row term, fp32 (B, H, q_rows)
    (q_rows >= Q_LEN, default Q_LEN; 0 past Q_LEN); with `lse`, lse2 is its base-2 LSE in the same
    rows, +inf past Q_LEN and where LSE = -inf (so P = exp2(s - lse2) = 0 there), else None. dLSE comes
    in any layout (a stride-0 expansion from .sum()); the kernel reads it as a dense array. `dq_sum`, an
    fp32 (B, H, Q_LEN, D) tensor laid out densely in any dim order (_empty_in_layout), is zeroed in the
    same pass. `plan`: the backward's (_backward_plan)."""
    B, H, Q_LEN, DV = out.shape
    D = dq_sum.shape[-1] if dq_sum is not None else DV
    dlse = dlse.contiguous() if dlse is not None else None
    q_rows = q_rows or Q_LEN
    delta = torch.empty((B, H, q_rows), dtype=torch.float32, device=out.device)
    lse2 = torch.empty_like(delta) if lse is not None else None
    pre_m = 64
    _launch(
        _bwd_preprocess, (_cdiv(q_rows, pre_m), B * H), out, do, dlse if dlse is not None else delta,
        lse if lse is not None else delta, delta, lse2 if lse2 is not None else delta,
        dq_sum if dq_sum is not None else delta, *out.stride(), *do.stride(), H, Q_LEN, q_rows, HEAD_DIM_V=DV,
        HEAD_DIM_V_PAD=_pad(DV), BLOCK_M=pre_m, HAS_DLSE=dlse is not None, BASE2_LSE=lse is not None,
        HEAD_DIM=D, HEAD_DIM_PAD=_pad(D), ZERO_DQ=dq_sum is not None, bind=_plan_site(plan, "row terms"))
    return delta, lse2


def _input_grads(tensors, device):
    """An fp32 gradient of zeros per learnable input, None for the others: the kernels add into them."""
    return [torch.zeros(t.shape, dtype=torch.float32, device=device) if learnable else None
            for (name, (dtype, dims, learnable)), t in zip(INPUTS.items(), tensors)]


def _in_input_dtypes(grads, tensors):
    """The summed gradients of _input_grads, each in its input's dtype."""
    return [g.to(t.dtype) if g is not None else None for g, t in zip(grads, tensors)]


def _portable_backward(q, k, v, out, lse, do, dlse, tensors, tables, visits=None, plan=None, packed=None):
    """Runs the portable backward kernels; `tables` are the dK/dV and dQ kernels' tile tables, `plan` the
    backward's (_backward_plan; never with visits), `packed` a packed call's, as for _portable_forward.
    Returns dq, dk, dv and one gradient per input (None for inputs that are not learnable)."""
    D, DV = q.shape[3], v.shape[3]
    B, H, HKV, Q_LEN, KV_LEN = _call_sizes(q, k, packed)
    sm_scale = softmax_scale(D)
    sizes = _sizes(q, k)
    # Upstream gradients come in any layout (stride 0 from .sum(), permuted views, slices): the
    # kernels read dO through its strides but along a unit-stride head dim (and _row_terms makes dLSE
    # dense). contiguous() copies only when needed (an expansion is not contiguous).
    do = do.contiguous() if do.stride(-1) != 1 else do
    delta, _ = _row_terms(out, do, dlse, plan=plan)
    tabled = tuple(bool(table) for table in tables)  # beside the plan's facts, the launches' arguments
    dq, dk, dv = _empty_in_layout(q, D), _empty_in_layout(k, D), _empty_in_layout(v, DV)
    grads = _input_grads(tensors, q.device)
    grad_args = [g for g in grads if g is not None]
    visits = visits or {}
    bm1, bn1, warps1, stages1 = _tiles(q, v, 1)
    bm2, bn2, warps2, stages2 = _tiles(q, v, 2)
    n_kv_tiles, n_q_tiles = _cdiv(KV_LEN, bn1), _cdiv(Q_LEN, bm2) * (H // HKV)
    table_args = [_table_args(_table_key(q, v, kernel), table, sizes, placeholder=delta)
                  for kernel, table in zip((1, 2), tables)]
    packed_args, packed_flags = _packed_launch(packed, delta)
    args = (q, k, v, do, lse, delta, dq, dk, dv, sm_scale, sm_scale * LOG2E.value,
            *[stride for t in (q, k, v, do, dq, dk, dv) for stride in _batch_strides(t, packed)],
            *_input_args(tensors), *grad_args, *table_args[0], *table_args[1],
            B, H, HKV, Q_LEN, KV_LEN, visits.get("dkdv", delta), visits.get("dq", delta), *packed_args)
    d_pad, dv_pad = _widths(D, DV)
    # The two kernels follow their tables together: both are built, or neither (a packed call).
    constants = dict(HEAD_DIM=D, HEAD_DIM_V=DV, HEAD_DIM_PAD=d_pad, HEAD_DIM_V_PAD=dv_pad,
                     BLOCK_M1=bm1, BLOCK_N1=bn1, BLOCK_M2=bm2, BLOCK_N2=bn2,
                     COUNT_VISITS=bool(visits), DOT_PRECISION=_dot_precision(q.dtype),
                     FOLLOW_TABLE=all(tabled) and TILE_TABLE, **packed_flags)
    if ONE_LAUNCH_BACKWARD:
        _launch(_bwd_kernel, (n_kv_tiles + n_q_tiles, B * HKV), *args, PARTS=3, num_warps=max(warps1, warps2),
                num_stages=max(stages1, stages2), **constants, bind=_plan_site(plan, "backward", 3, tabled))
    else:
        # Two launches, on two streams on a GPU, so each half gets its own warp count and one's
        # last wave still overlaps the other's.
        side = _side_stream(q.device)
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(q.device))
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            _launch(_bwd_kernel, (n_kv_tiles, B * HKV), *args, PARTS=1, num_warps=warps1, num_stages=stages1,
                    **constants, bind=_plan_site(plan, "backward", 1, tabled))
        _launch(_bwd_kernel, (n_q_tiles, B * HKV), *args, PARTS=2, num_warps=warps2, num_stages=stages2, **constants,
                bind=_plan_site(plan, "backward", 2, tabled))
        if side is not None:
            torch.cuda.current_stream(q.device).wait_stream(side)
            if not torch.cuda.is_current_stream_capturing():  # a CUDA graph's pool is its own
                for t in (q, k, v, do, lse, delta, dk, dv, *tensors):
                    t.record_stream(side)  # the allocator must not hand their memory out before dK/dV ends
    return dq, dk, dv, _in_input_dtypes(grads, tensors)


def _no_double_backward():
    if torch.is_grad_enabled():
        # Under create_graph=True the kernels' gradients would come back without a graph, so a
        # loss built from them (a gradient penalty) would silently miss its own gradient.
        _fail("double backward (backward with create_graph=True, as a gradient penalty needs) is not "
              "supported: the kernels' gradients are not differentiable; compute such losses with "
              "the float64 reference, attngen.reference.evaluate")


class _Attention(torch.autograd.Function):
    """Eager calls: the kernels behind one autograd node, reached without the dispatcher."""

    @staticmethod
    def forward(ctx, q, k, v, known, plan, *tensors):
        ctx.set_materialize_grads(False)  # an unused LSE gets no gradient pass of its own
        ctx.plan = plan
        ctx.build = _builder(_sizes(q, k), q.device, tensors, plan)
        out, lse = _forward_with_tables(q, k, v, tensors, known, ctx.build, plan)
        ctx.save_for_backward(q, k, v, out, lse, *tensors)
        ctx.known = known  # the user's tables, or the forward's, which serves dQ when their tiles agree
        return out, lse

    @staticmethod
    def backward(ctx, do, dlse):
        _no_double_backward()
        q, k, v, out, lse, *tensors = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(out)
        dq, dk, dv, input_grads = _backward_with_tables(q, k, v, out, lse, do, dlse, tensors, ctx.known, ctx.build,
                                                        ctx.plan)
        return (dq, dk, dv, None, None, *input_grads)


# --- torch.compile: the kernels as custom operators ------------------------------------------------
# Under torch.compile the kernels run as opaque custom operators (torch.library.custom_op: table,
# forward, backward, the forward of cache calls, which has no backward, and a packed call's forward and
# backward, which its eager calls run too) with fake
# implementations that give shapes, and an autograd formula that calls the backward operator, so a compiled model has no graph break and dynamic lengths need
# no recompile. The host code is the same Python as in eager; eager calls skip the dispatcher,
# which costs more per call than the autograd.Function above (a forward of B1 H8 N128 D64 on an H200:
# 100.7 against 97.9 us of host time, benchmarks/compile_check.py).
# The names carry a digest of this module's text: an identical module imported again in this
# process (same digest) reuses the operators, any other module gets its own.
MODULE_DIGEST = ""


# A backward operator returns the learnable inputs' gradients alone (an operator's list output holds
# tensors, not None), in the order of INPUTS.
def _learnable_grads_like(tensors):
    """The fakes' learnable-input gradients: one shaped like each learnable input."""
    return [t.new_empty(t.shape) for (_, (_, _, learnable)), t in zip(INPUTS.items(), tensors) if learnable]


def _per_input(grads):
    """A backward operator's learnable gradients spread over INPUTS: None for an input that is not learnable."""
    grads = iter(grads)
    return [next(grads) if learnable else None for (_, (_, _, learnable)) in INPUTS.items()]


def _define_operators(table_name, forward_name, backward_name, cache_name, packed_name, packed_backward_name):
    @torch.library.custom_op(f"attngen::{table_name}", mutates_args=())
    def table_op(q: torch.Tensor, k: torch.Tensor, tensors: list[torch.Tensor], by_query: bool,
                 block_m: int, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _build_table((by_query, block_m, block_n), _sizes(q, k), q.device, tensors)

    @table_op.register_fake
    def _(q, k, tensors, by_query, block_m, block_n):
        return _empty_table((by_query, block_m, block_n), _sizes(q, k), q.device)

    @torch.library.custom_op(f"attngen::{forward_name}", mutates_args=())
    def forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tensors: list[torch.Tensor],
                   tables: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        # The user's tables, if any, else the table of the family that runs, built here (at run time,
        # where the family is known without guarding the compiled graph on the shapes).
        known = dict(zip(_table_kernels(True), _pairs(tables)))
        return _forward_with_tables(q, k, v, tensors, known, _builder(_sizes(q, k), q.device, tensors))

    # The fakes allocate by the rule every family's launch follows (_empty_in_layout), so the strides
    # torch.compile plans with are the ones the kernels write.
    @forward_op.register_fake
    def _(q, k, v, tensors, tables):
        B, H, Q_LEN, _ = q.shape
        return _empty_in_layout(q, v.shape[3]), q.new_empty((B, H, Q_LEN), dtype=torch.float32)

    @torch.library.custom_op(f"attngen::{backward_name}", mutates_args=())
    def backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                    do: torch.Tensor, dlse: torch.Tensor, tensors: list[torch.Tensor], tables: list[torch.Tensor]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        # The user's tables, if any, else those of the family that runs, built here (as the forward does).
        known = dict(zip(_table_kernels(True), _pairs(tables)))
        dq, dk, dv, input_grads = _backward_with_tables(q, k, v, out, lse, do, dlse, tensors, known,
                                                        _builder(_sizes(q, k), q.device, tensors))
        return dq, dk, dv, [g for g in input_grads if g is not None]

    @backward_op.register_fake
    def _(q, k, v, out, lse, do, dlse, tensors, tables):
        return (_empty_in_layout(q, q.shape[3]), _empty_in_layout(k, k.shape[3]), _empty_in_layout(v, v.shape[3]),
                _learnable_grads_like(tensors))

    def setup_context(ctx, inputs, output):
        q, k, v, tensors, tables = inputs
        ctx.save_for_backward(q, k, v, *output, *tensors, *tables)
        ctx.counts = len(tensors), len(tables)

    def backward(ctx, do, dlse):
        _no_double_backward()
        q, k, v, out, lse, *rest = ctx.saved_tensors
        n_tensors, n_tables = ctx.counts
        tensors, flat = rest[:n_tensors], rest[n_tensors:]
        dq, dk, dv, grads = backward_op(q, k, v, out, lse, do, dlse, list(tensors), list(flat))
        return dq, dk, dv, _per_input(grads), [None] * n_tables

    forward_op.register_autograd(backward, setup_context=setup_context)

    @torch.library.custom_op(f"attngen::{cache_name}", mutates_args=())
    def cache_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tensors: list[torch.Tensor],
                 kv_len: list[torch.Tensor], q_offset: torch.Tensor, pages: list[torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        # kv_len, pages: [] or [one tensor] (lists: optional tensors in the operator's schema)
        return _cache_forward(q, k, v, tensors, kv_len[0] if kv_len else None, q_offset, pages)

    @cache_op.register_fake
    def _(q, k, v, tensors, kv_len, q_offset, pages):
        B, H, Q_LEN, _ = q.shape
        return _empty_in_layout(q, v.shape[-1]), q.new_empty((B, H, Q_LEN), dtype=torch.float32)

    # Packed calls, eager or compiled, run these two: q, k, v, O and the gradients are (TOTAL, heads, D),
    # LSE (H, TOTAL_Q); max_seqlen_q/k size the grid.
    @torch.library.custom_op(f"attngen::{packed_name}", mutates_args=())
    def packed_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tensors: list[torch.Tensor],
                  cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        packed = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q.shape[0])
        q, k, v = map(_packed_view, (q, k, v))
        _, launch = _forward_family(q, k, v, k.shape[1], k.shape[2], False, packed=True)
        if launch is not None:
            out, lse = launch(q, k, v, tensors, (), packed=packed)
        else:
            out, lse = _portable_forward(q, k, v, tensors, (), packed=packed)
        return _unpacked(out), lse[0]

    @packed_op.register_fake
    def _(q, k, v, tensors, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        return (_unpacked(_empty_in_layout(_packed_view(q), v.shape[-1])),
                q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32))

    @torch.library.custom_op(f"attngen::{packed_backward_name}", mutates_args=())
    def packed_backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                           do: torch.Tensor, dlse: torch.Tensor, tensors: list[torch.Tensor],
                           cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                           max_seqlen_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        packed = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q.shape[0])
        q, k, v, out, do = map(_packed_view, (q, k, v, out, do))
        _, _, launch = _backward_family(q, k, v, packed=True)
        if launch is not None:
            dq, dk, dv, input_grads = launch(q, k, v, out, lse[None], do, dlse[None], tensors, (), packed=packed)
        else:
            dq, dk, dv, input_grads = _portable_backward(q, k, v, out, lse[None], do, dlse[None], tensors, ((), ()),
                                                         packed=packed)
        return _unpacked(dq), _unpacked(dk), _unpacked(dv), [g for g in input_grads if g is not None]

    @packed_backward_op.register_fake
    def _(q, k, v, out, lse, do, dlse, tensors, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        return (*(_unpacked(_empty_in_layout(_packed_view(t), t.shape[-1])) for t in (q, k, v)),
                _learnable_grads_like(tensors))

    def packed_setup_context(ctx, inputs, output):
        q, k, v, tensors, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k = inputs
        ctx.save_for_backward(q, k, v, *output, cu_seqlens_q, cu_seqlens_k, *tensors)
        ctx.max_seqlens = max_seqlen_q, max_seqlen_k

    def packed_backward(ctx, do, dlse):
        _no_double_backward()
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *tensors = ctx.saved_tensors
        dq, dk, dv, grads = packed_backward_op(q, k, v, out, lse, do, dlse, list(tensors), cu_seqlens_q,
                                               cu_seqlens_k, *ctx.max_seqlens)
        return dq, dk, dv, _per_input(grads), None, None, None, None

    packed_op.register_autograd(packed_backward, setup_context=packed_setup_context)


def _operators():
    """The (table, forward, backward, cache forward, packed forward, packed backward) custom operators of
    this module's kernels."""
    names = [f"{SPEC_NAME}_{MODULE_DIGEST}_{part}"
             for part in ("table", "forward", "backward", "cache", "packed", "packed_backward")]
    if not all(hasattr(torch.ops.attngen, name) for name in names):
        _define_operators(*names)
    return tuple(getattr(torch.ops.attngen, name).default for name in names)


OPERATORS = _operators()


def _operator_builder(q, k, tensors):
    """build(key) for _resolve under torch.compile: the table operator."""
    return lambda key: tuple(OPERATORS[0](q, k, list(tensors), *key)) if TILE_TABLE else ()


def _compiled_attention(q, k, v, tensors, known):
    # The user's tables travel whole (the backward follows them too); else none: the forward operator
    # picks the family at run time and builds its table (asking which here would guard the graph on the
    # shapes, a recompile where dynamic lengths cross a family's rule), and the backward builds its own.
    tables = _resolve(_table_kernels(True), q, v, known, _operator_builder(q, k, tensors)) if known else []
    return OPERATORS[1](q, k, v, tensors, [t for table in tables for t in table])


def attn(q, k, v, *, kv_len=None, q_offset=None, page_table=None, cu_seqlens_q=None, cu_seqlens_k=None,
         max_seqlen_q=None, max_seqlen_k=None, return_lse=False, tile_tables=None, **inputs):
    """This module's attention: softmax over the allowed keys of the modified scores, times V.

    Returns out (B, H, Q_LEN, DV) in q's dtype, and with return_lse=True also the natural-log
    LSE (B, H, Q_LEN) in float32 (-inf for a query row with no allowed key). Differentiable
    in q, k, v and the learnable inputs, if any (once: no double backward).
    A cache call: k and v hold a cache of MAX_KV keys per row (B, HKV, MAX_KV, D/DV); kv_len
    ((B,) int32) is each row's number of valid keys, q_offset ((B,) int32) the position of its
    first query (by default kv_len - Q_LEN: the queries are the newest tokens; 0 without kv_len).
    The mask and score see those positions as q and kv_len[b] as KV_LEN. Forward only.
    A paged cache: k and v are pages (NUM_PAGES, PAGE_SIZE, HKV, D/DV), PAGE_SIZE a multiple of 16;
    page_table ((B, MAX_PAGES) int32) maps row b's logical page p to a physical one; kv_len is
    required (at most MAX_PAGES * PAGE_SIZE).
    A packed call (FlashAttention's varlen layout): q (TOTAL_Q, H, D), k and v (TOTAL_K, HKV, D/DV);
    sequence b is tokens cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of q (and likewise of k and v by
    cu_seqlens_k: (B + 1,) int32, from 0 to TOTAL); max_seqlen_q/k (Python ints, at least every sequence's
    length) size the grid. Positions restart at 0 in every sequence, b is its index and Q_LEN/KV_LEN its
    lengths; an input dim declared Q_LEN or KV_LEN is max_seqlen_q or max_seqlen_k long. Returns out
    (TOTAL_Q, H, DV) and LSE (H, TOTAL_Q); differentiable; runs without tile tables.
    tile_tables: from tile_tables(q, k, v, **inputs), to reuse the tables of a mask that reads
    inputs across calls (built for these inputs' current values; by default each call builds its own).
    Works under torch.compile (fullgraph, dynamic shapes, CUDA graphs) through OPERATORS. Under
    torch.autocast, float q, k and v are cast to its dtype first, as for scaled_dot_product_attention.
    """
    q, k, v = _autocast(q, k, v)
    packed = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if _is_packed(*packed):
        if kv_len is not None or q_offset is not None or page_table is not None:
            _fail("kv_len, q_offset and page_table must be None in a packed call (cu_seqlens_q=...): "
                  "packed calls are training and prefill calls, positions restarting at 0 in every sequence")
        if tile_tables is not None:
            _fail("tile_tables must be None in a packed call (cu_seqlens_q=...): tables are built for a batch of "
                  "equal lengths, and packed calls run without them")
        out, lse = _packed_attention(q, k, v, inputs, *packed)
        return (out, lse) if return_lse else out
    if page_table is not None:
        out, lse = _cache_attention(q, k, v, inputs, kv_len, q_offset, tile_tables, page_table)
        return (out, lse) if return_lse else out
    if torch.compiler.is_compiling():  # the operators' eager code plans nothing either
        plan, sizes = None, _check(q, k, v, inputs)
    else:
        plan = _call_plan(q, k, v, inputs)
        sizes = plan.sizes
    B, H, HKV, Q_LEN, KV_LEN, _, _ = sizes
    if kv_len is not None or q_offset is not None:
        out, lse = _cache_attention(q, k, v, inputs, kv_len, q_offset, tile_tables)
        return (out, lse) if return_lse else out
    _check_learnable(inputs)
    known = {} if tile_tables is None else _checked_tables(tile_tables, q, v, (B, H, HKV, Q_LEN, KV_LEN))
    if known:
        plan = None  # the user's tables are tensors the plan's facts do not cover: launches bind by their facts
    tensors = [inputs[name].contiguous() for name in INPUTS]
    if torch.compiler.is_compiling():
        out, lse = _compiled_attention(q, k, v, tensors, known)
    elif torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *tensors)):
        out, lse = _Attention.apply(q, k, v, known, plan, *tensors)
    else:  # nothing to differentiate: no autograd node (a tenth of a short call's host time)
        out, lse = _forward_with_tables(q, k, v, tensors, known, _builder(_sizes(q, k), q.device, tensors, plan),
                                        plan)
    return (out, lse) if return_lse else out


def _check_learnable(inputs):
    if torch.is_grad_enabled():
        for name, (_, _, learnable) in INPUTS.items():
            if inputs[name].requires_grad and not learnable:
                _fail(f"input '{name}' requires grad, but the spec does not declare it learnable, so it would "
                      f"get no gradient: declare it `input {name}: {_declared(name)} learnable`, or pass it "
                      f"detached")


# --- packed calls: sequences of any lengths in FlashAttention's varlen layout ------------------------
def _is_packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """Whether a call's keywords make it a packed call: any of the four (the others are then checked
    present by _check_packed, rather than silently ignored)."""
    return any(x is not None for x in (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))


def _packed_view(t):
    """A packed (TOTAL, heads, D) tensor as the (1, heads, TOTAL, D) view the portable kernels read."""
    return t.unsqueeze(0).transpose(1, 2)


def _unpacked(t):
    """_packed_view's inverse: (1, heads, TOTAL, D) back to (TOTAL, heads, D)."""
    return t.squeeze(0).transpose(0, 1)


def _packed_attention(q, k, v, inputs, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """A packed call (attn's cu_seqlens_q/k, max_seqlen_q/k): checked, then the packed operator, whose
    autograd runs the packed backward."""
    _check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, inputs)
    _check_learnable(inputs)
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    # Checking the values reads them on the host (one sync per call): skipped while a CUDA graph is
    # captured or under torch.compile, and for offsets already checked (_checked_before).
    if not torch.compiler.is_compiling() and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        facts = (q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
        if not _checked_before(cu_seqlens_q, cu_seqlens_k, facts):
            _check_packed_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
            _remember_checked(cu_seqlens_q, cu_seqlens_k, facts)
    tensors = [inputs[name].contiguous() for name in INPUTS]
    return OPERATORS[4](q, k, v, tensors, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)


# The offsets whose values passed _check_packed_values, with the facts they were checked against: a model
# passes one batch's cu_seqlens to every layer, and the sync of the check would leave the GPU idle while
# the host prepares each layer's launches. An entry holds the tensors weakly (so their memory, while they
# live, is theirs: a new tensor at the same address is not mistaken for them) with their version
# counters (an in-place write, through any view, bumps it). Inference tensors have no version counter:
# they are checked every call.
_CHECKED_OFFSETS = []
_CHECKED_OFFSETS_KEPT = 8


def _checked_before(cu_seqlens_q, cu_seqlens_k, facts):
    if cu_seqlens_q.is_inference() or cu_seqlens_k.is_inference():
        return False
    for ref_q, version_q, ref_k, version_k, checked_facts in _CHECKED_OFFSETS:
        if (ref_q() is cu_seqlens_q and ref_k() is cu_seqlens_k and version_q == cu_seqlens_q._version
                and version_k == cu_seqlens_k._version and checked_facts == facts):
            return True
    return False


def _remember_checked(cu_seqlens_q, cu_seqlens_k, facts):
    if cu_seqlens_q.is_inference() or cu_seqlens_k.is_inference():
        return
    if len(_CHECKED_OFFSETS) >= _CHECKED_OFFSETS_KEPT:
        del _CHECKED_OFFSETS[0]
    _CHECKED_OFFSETS.append((weakref.ref(cu_seqlens_q), cu_seqlens_q._version, weakref.ref(cu_seqlens_k),
                             cu_seqlens_k._version, facts))


def _check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, inputs):
    """A packed call's tensors, offsets' tensors and sizes; returns (B, H, HKV, max_seqlen_q, max_seqlen_k,
    D, DV), B its number of sequences."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided or t.is_nested:
            _fail(f"{name} must be a dense tensor, got a {'nested' if t.is_nested else t.layout} one")
        if t.dim() != 3:
            _fail(f"{name} must have 3 dims (TOTAL, heads, head_dim) in a packed call (cu_seqlens_q=...), "
                  f"got shape {tuple(t.shape)}")
    _check_tensors(*map(_packed_view, (q, k, v)))
    TOTAL_K, HKV = k.shape[0], k.shape[1]
    if v.shape[0] != TOTAL_K or v.shape[1] != HKV:
        _fail(f"v must have {TOTAL_K} tokens of {HKV} heads like k, got shape {tuple(v.shape)}")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not (isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.dim() == 1 and t.shape[0] >= 2
                and t.device == q.device):
            _fail(f"{name} must be a 1-D int32 tensor of B + 1 >= 2 offsets on {q.device}, got "
                  + (f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__))
    if cu_seqlens_k.shape[0] != cu_seqlens_q.shape[0]:
        _fail(f"cu_seqlens_k must have {cu_seqlens_q.shape[0]} offsets like cu_seqlens_q (one sequence each), "
              f"got {cu_seqlens_k.shape[0]}")
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not isinstance(n, (int, torch.SymInt)) or isinstance(n, bool):
            _fail(f"{name} must be a Python int (the longest sequence's length), got {type(n).__name__}")
        if not 1 <= n <= MAX_LENGTH:
            _fail(f"{name} must lie in [1, {MAX_LENGTH}] ({MAX_LENGTH_REASON}), got {n}")
    B = cu_seqlens_q.shape[0] - 1
    _check_sizes(B, q.shape[1], HKV, max_seqlen_q, max_seqlen_k, q.shape[2], v.shape[2], inputs, q.device)
    return B, q.shape[1], HKV, max_seqlen_q, max_seqlen_k, q.shape[2], v.shape[2]


def _check_packed_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """A packed call's offsets: each from 0 to its tensor's TOTAL, non-decreasing, no sequence longer than
    its max_seqlen; every flag computed on the device, read in one sync."""
    checks = (("q", cu_seqlens_q, q.shape[0], max_seqlen_q), ("k", cu_seqlens_k, k.shape[0], max_seqlen_k))
    flags = []
    for _, cu, total, longest in checks:
        lengths = cu[1:] - cu[:-1]
        flags += [(cu[0] != 0) | (cu[-1] != total) | (lengths < 0).any(), (lengths > longest).any()]
    bad = torch.stack(flags).tolist()
    for n, (name, cu, total, longest) in enumerate(checks):
        if bad[2 * n]:
            shown = cu.tolist()
            shown = shown if len(shown) <= 8 else [*shown[:4], "...", *shown[-3:]]
            _fail(f"cu_seqlens_{name} must rise from 0 to TOTAL = {total} ({name}.shape[0]) without decreasing, "
                  f"got {shown}")
        if bad[2 * n + 1]:
            _fail(f"max_seqlen_{name} must be at least every sequence's length, got {longest} for a sequence of "
                  f"{int((cu[1:] - cu[:-1]).max())}")


def _check_paged(q, k, v, page_table, kv_len, inputs):
    """A paged call's tensors and sizes; returns MAX_KV, the longest row its page table can hold."""
    _check_tensors(q, k, v)
    B, H, Q_LEN, D = q.shape
    NUM_PAGES, PAGE_SIZE, HKV = k.shape[0], k.shape[1], k.shape[2]
    if tuple(v.shape[:3]) != (NUM_PAGES, PAGE_SIZE, HKV):
        _fail(f"v must hold pages (NUM_PAGES, PAGE_SIZE, HKV, DV) = ({NUM_PAGES}, {PAGE_SIZE}, {HKV}, DV) like k, "
              f"got shape {tuple(v.shape)}")
    if PAGE_SIZE % 16 != 0:
        _fail(f"the page size (k.shape[1]) must be a multiple of 16, got {PAGE_SIZE}")
    if not (isinstance(page_table, torch.Tensor) and page_table.dtype == torch.int32 and page_table.dim() == 2
            and page_table.shape[0] == B and page_table.device == q.device):
        _fail(f"page_table must be an int32 tensor of shape ({B}, MAX_PAGES) on {q.device}, got "
              + (f"{page_table.dtype} {tuple(page_table.shape)} on {page_table.device}"
                 if isinstance(page_table, torch.Tensor) else type(page_table).__name__))
    if kv_len is None:
        _fail("a paged cache needs kv_len, each row's number of valid keys")
    MAX_KV = page_table.shape[1] * PAGE_SIZE
    _check_sizes(B, H, HKV, Q_LEN, MAX_KV, D, v.shape[3], inputs, q.device)
    return MAX_KV


def _cache_attention(q, k, v, inputs, kv_len, q_offset, tile_tables, page_table=None):
    """A cache call (attn's kv_len, q_offset, page_table): checked, then the forward kernels alone."""
    B, Q_LEN = q.shape[0], q.shape[2]
    if page_table is not None:
        MAX_KV = _check_paged(q, k, v, page_table, kv_len, inputs)
    else:
        MAX_KV = k.shape[2]
    for name, t in (("kv_len", kv_len), ("q_offset", q_offset)):
        if t is not None and not (isinstance(t, torch.Tensor) and t.dtype == torch.int32 and tuple(t.shape) == (B,)
                                  and t.device == q.device):
            _fail(f"{name} must be an int32 tensor of shape ({B},) on {q.device}, got "
                  + (f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__))
    if tile_tables is not None:
        _fail("tile_tables must be None in a call with kv_len, q_offset or page_table: tables are built for "
              "query positions 0 .. Q_LEN-1, and cache calls run without them")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *inputs.values())):
        _fail("a call with kv_len or q_offset has no backward pass: call it under torch.no_grad(), or with "
              "tensors that do not require grad")
    defaulted = q_offset is None
    if defaulted:
        q_offset = kv_len - Q_LEN
    if kv_len is not None:
        kv_len = kv_len.contiguous()
    q_offset = q_offset.contiguous()
    # Checking the values reads them on the host (one sync per call): skipped while a CUDA graph is
    # captured or under torch.compile, where the kernels still clamp lengths and page numbers to
    # the cache (memory stays safe).
    if not torch.compiler.is_compiling() and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        _check_cache_values(q, kv_len, q_offset, defaulted, MAX_KV, page_table, k.shape[0])
    tensors = [inputs[name].contiguous() for name in INPUTS]
    pages = [page_table.contiguous()] if page_table is not None else []
    if torch.compiler.is_compiling():
        return OPERATORS[3](q, k, v, tensors, [kv_len] if kv_len is not None else [], q_offset, pages)
    return _cache_forward(q, k, v, tensors, kv_len, q_offset, pages)


def _check_cache_values(q, kv_len, q_offset, defaulted, MAX_KV, page_table, NUM_PAGES):
    """A cache call's values: every flag computed on the device, read in one sync; the message,
    only on failure, reads the offending range."""
    Q_LEN = q.shape[2]
    flags = [(q_offset < 0).any(), (q_offset > MAX_LENGTH - Q_LEN).any()]
    if kv_len is not None:
        flags += [(kv_len < 0).any(), (kv_len > MAX_KV).any()]
    if page_table is not None:
        page_size = MAX_KV // page_table.shape[1]
        used = torch.arange(page_table.shape[1], device=q.device) * page_size < kv_len[:, None]
        flags.append((used & ((page_table < 0) | (page_table >= NUM_PAGES))).any())
    bad = torch.stack(flags).tolist()
    if bad[0] or bad[1]:
        offset = "q_offset (by default kv_len - Q_LEN)" if defaulted else "q_offset"
        _fail(f"query positions q_offset + 0 .. q_offset + {Q_LEN - 1} must lie in [0, {MAX_LENGTH}): "
              f"{offset} ranges over [{int(q_offset.min())}, {int(q_offset.max())}] for Q_LEN={Q_LEN}")
    if kv_len is not None and (bad[2] or bad[3]):
        length = "MAX_PAGES * PAGE_SIZE" if page_table is not None else "k.shape[2]"
        _fail(f"kv_len must lie in [0, {MAX_KV}] (the cache's length, {length}), got values in "
              f"[{int(kv_len.min())}, {int(kv_len.max())}]")
    if page_table is not None and bad[4]:
        named = page_table[used]
        _fail(f"page_table must name pages in [0, {NUM_PAGES}) (k.shape[0]) for every page a row uses, got "
              f"values in [{int(named.min())}, {int(named.max())}]")


def _cache_forward(q, k, v, tensors, kv_len, q_offset, pages):
    """A checked cache call's forward (a paged one with [page_table] in `pages`), by the family
    FORWARD_FAMILIES picks, with no tile table."""
    return _forward(q, k, v, tensors, {}, cache=(kv_len, q_offset), page_table=pages[0] if pages else None)


def tile_tables(q, k, v, **inputs):
    """The tile tables of these mask inputs' current values, to pass to attn(q, k, v,
    tile_tables=..., **inputs) in calls of the same sizes, dtype, head dims and device, so those
    calls skip building them. Build them again whenever the values the mask reads change (a table
    cannot tell), as with FlexAttention's BlockMask. A spec whose mask needs no tables gets an
    empty object, so code can pass one whatever the spec."""
    q, k, v = _autocast(q, k, v)  # the call's dtype decides the tiles
    B, H, HKV, Q_LEN, KV_LEN, _, _ = _check(q, k, v, inputs)
    sizes = (B, H, HKV, Q_LEN, KV_LEN)
    tensors = [inputs[name].contiguous() for name in INPUTS]
    known = {}
    # Under torch.compile the table operator builds them, as in a call (the kernels' launch is not traceable).
    build = _operator_builder(q, k, tensors) if torch.compiler.is_compiling() else _builder(sizes, q.device, tensors)
    _resolve(_table_kernels(True), q, v, known, build)
    keys = {kernel: _table_key(q, v, kernel) for kernel in _table_kernels(True)}
    return TileTables(sizes, q.device, _built_for(q, v), keys, known)


def forward_family(q, k, v, *, kv_len=None, q_offset=None, page_table=None, cu_seqlens_q=None, cu_seqlens_k=None,
                   max_seqlen_q=None, max_seqlen_k=None, **inputs):
    """The kernel family whose forward kernel a call with these arguments runs ("portable", or a
    family of FORWARD_FAMILIES whose per-call rule admits it; `attngen explain` gives the rules).
    The rules read the call's shapes: kv_len's and q_offset's values do not change the choice.
    A packed call (cu_seqlens_q=...) runs a family of PACKED_FAMILIES that admits its (1, heads, TOTAL,
    D) views, else the portable one."""
    q, k, v = _autocast(q, k, v)
    if _is_packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        _check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, inputs)
        q, k, v = map(_packed_view, (q, k, v))
        return _forward_family(q, k, v, k.shape[1], k.shape[2], False, packed=True)[0]
    if page_table is not None:
        _check_paged(q, k, v, page_table, kv_len, inputs)
    else:
        _check(q, k, v, inputs)
    cached = kv_len is not None or q_offset is not None or page_table is not None
    return _forward_family(q, k, v, *_kv_layout(k, v, page_table)[:2], cached)[0]


def backward_family(q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                    **inputs):
    """The kernel family whose backward kernels a (training) call with these arguments runs: "portable",
    or the family of BACKWARD_FAMILIES whose per-call rule admits it (of PACKED_BACKWARD_FAMILIES for a
    packed call)."""
    q, k, v = _autocast(q, k, v)
    if _is_packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        _check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, inputs)
        return _backward_family(*map(_packed_view, (q, k, v)), packed=True)[0]
    _check(q, k, v, inputs)
    return _backward_family(q, k, v)[0]


def visit_counts(q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, **inputs):
    """Instrumentation: which tiles each kernel visits, from one forward and backward pass run with
    counters. Returns {"fwd": (B, H, query tiles, key tiles), "dq": the same for dQ's tiles,
    "dkdv": (B, H, key tiles, query tiles)} int32 tensors, one entry per tile: 0 skipped,
    1 visited with mask code, 16 visited without; any other value would be a repeated visit.
    A packed call's: B is its number of sequences, its tiles those of max_seqlen_q/k, counted from each
    sequence's first token."""
    q, k, v = _autocast(q, k, v)
    packed = None
    if _is_packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        _check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, inputs)
        _check_packed_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        packed = (cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), max_seqlen_q, max_seqlen_k, q.shape[0])
        q, k, v = map(_packed_view, (q, k, v))
    else:
        _check(q, k, v, inputs)
    tensors = [inputs[name].contiguous() for name in INPUTS]
    B, H, _, Q_LEN, KV_LEN = _call_sizes(q, k, packed)

    def counters(kernel, by_query):
        block_m, block_n = _tiles(q, v, kernel)[:2]
        n_q, n_k = _cdiv(Q_LEN, block_m), _cdiv(KV_LEN, block_n)
        shape = (B, H, n_q, n_k) if by_query else (B, H, n_k, n_q)
        return torch.zeros(shape, dtype=torch.int32, device=q.device)

    counts = {"fwd": counters(0, True), "dkdv": counters(1, False), "dq": counters(2, True)}
    tables = _resolve(range(3), q, v, {}, _builder(_sizes(q, k), q.device, tensors)) if packed is None else [()] * 3
    with torch.no_grad():
        out, lse = _portable_forward(q, k, v, tensors, tables[0], visits=counts["fwd"], packed=packed)
        _portable_backward(q, k, v, out, lse, torch.ones_like(out), None, tensors, tables[1:],
                           visits={"dkdv": counts["dkdv"], "dq": counts["dq"]}, packed=packed)
    return counts
