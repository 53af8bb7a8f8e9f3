"""The kernels' parameter lists, declared once in Python and rendered as each @triton.jit function's `def` and its calls."""

from __future__ import annotations

from dataclasses import dataclass

from attngen import ir

LINE_WIDTH = 112


@dataclass(frozen=True)
class Signature:
    """One @triton.jit function: its name and parameters in order (`constexprs` among them are
    tl.constexpr). A call passes every parameter by the caller's variable of the same name unless
    told otherwise, as FlexAttention's templates do with gen_argdefs: a parameter is added in one
    place and every call site follows."""
    name: str
    params: tuple[str, ...]
    constexprs: frozenset[str] = frozenset()

    def definition(self) -> str:
        """The `def` line(s), wrapped with the parameters aligned after the parenthesis."""
        spelled = [f"{p}: tl.constexpr" if p in self.constexprs else p for p in self.params]
        return _wrapped(f"def {self.name}(", spelled, "):", 0)

    def call(self, column: int, **values) -> str:
        """A call starting at `column`, passing `values[p]` for the parameters named there (code as
        str, or a Python bool or int) and each other parameter's own name. Its lines after the first
        are indented relative to the call (the template indents them to `column`)."""
        return _wrapped(f"{self.name}(", self._values(values), ")", column)

    def arguments(self, column: int, **values) -> str:
        """The arguments of a call, as `call` passes them, in a tuple (gl.warp_specialize takes each
        partition's function and its arguments apart)."""
        return _wrapped("(", self._values(values), ")", column)

    def _values(self, values: dict) -> list[str]:
        unknown = set(values) - set(self.params)
        assert not unknown, f"{self.name} has no parameter(s) {sorted(unknown)}"
        return [_code(values.get(p, p)) for p in self.params]


def _code(value) -> str:
    return value if isinstance(value, str) else repr(value)


def _wrapped(opening: str, items: list[str], closing: str, column: int) -> str:
    """`opening` + the items separated by commas + `closing`, as lines of at most LINE_WIDTH columns
    (the first starts at `column`), breaking only between items."""
    width = LINE_WIDTH - column - len(opening)
    lines, line = [], ""
    for n, item in enumerate(items):
        text = item + (closing if n == len(items) - 1 else ",")
        if line and len(line) + 1 + len(text) > width:
            lines.append(line)
            line = text
        else:
            line = f"{line} {text}" if line else text
    lines.append(line)
    return ("\n" + " " * len(opening)).join([opening + lines[0], *lines[1:]])


def _strides(tensor: str, rows: str) -> tuple[str, ...]:
    """A (batch, head, row, column) tensor's strides, named as in the Triton tutorial (stride_qz ...)."""
    return tuple(f"stride_{tensor}{axis}" for axis in ("z", "h", rows, "k"))


SIZES = ("B", "H", "HKV", "Q_LEN", "KV_LEN")
POSITIONS = ("off_b", "off_h", "off_hkv")
HEAD_DIMS = ("HEAD_DIM", "HEAD_DIM_V", "HEAD_DIM_PAD", "HEAD_DIM_V_PAD")
TILE_LOOP = ("tiles", "j_lo", "j_hi", "gap_at", "gap", "visits")
TABLE = ("TblNum", "TblIdx", "tbl_sb", "tbl_sh", "tbl_cols")
# A cache call's per-row lengths and query offsets ((B,) int32), read when their flag is set.
CACHE = ("KvLen", "QOffset")
CACHE_FLAGS = ("HAS_KV_LEN", "HAS_Q_OFFSET")
# A paged cache's page table ((B, MAX_PAGES) int32), its row stride and the pool's page count; PAGED and
# the page size are constexprs (K and V then hold pages (NUM_PAGES, PAGE_SIZE, HKV, D)).
PAGE_TABLE = ("PageTable", "stride_pt", "NUM_PAGES")
PAGING = ("PAGED", "PAGE_SIZE")
# A packed call's cumulative sequence lengths ((B + 1,) int32) and its number of query tokens (LSE's row
# length), read when VARLEN is set; Q_LEN and KV_LEN then arrive as the longest sequence's lengths.
PACKED = ("CuSeqlensQ", "CuSeqlensK", "TOTAL_Q")
# Where a Hopper program's sequence lies in its TMA descriptors: the descriptors' batch index and the
# sequence's first query and key rows (off_b, 0 and 0 in an unpacked call; 0 and cu_seqlens[b] in a
# packed one, whose descriptors see (1, heads, TOTAL, D) views).
SEQUENCE = ("tma_b", "q_start", "k_start")
# A spec with a `sink:` gives its forward kernels the sink of every query row, fp32, as (B, H, Q_LEN) rows
# in any strides (an expanded `sinks[h]` has 0 for the batch and the rows: attngen.runtime.sinks); a packed
# call's (H, TOTAL_Q) rows come with batch stride 0, its rows counted from each sequence's first token. A
# spec without one has no such parameters.
SINK = ("Sink", "stride_sb", "stride_sh", "stride_sm")
# The Hopper backward's deterministic dQ (DETERMINISTIC): its int64 fixed-point sum (q's layout, its
# batch, head and row strides) and each row's scale exponent (rows of dq_rows a head, as its row terms).
DQ_FIXED = ("DqFixed", "stride_dqz", "stride_dqh", "stride_dqm", "DqExp", "dq_rows")
# Which key tiles a forward program visits (the tile-range hook defines them): with mask code, numbers
# [masked_lo, masked_hi) skipping `gap` tiles from number `gap_at` on, then without, [full_lo, full_hi);
# with a tile table (FOLLOW_TABLE) the numbers index the lists at masked_tiles and full_tiles.
TILE_RANGE = ("masked_tiles", "masked_lo", "masked_hi", "gap_at", "gap", "full_tiles", "full_lo", "full_hi")
# What the spec's element hooks may read in the Hopper forward's consumers, besides the tile's indices.
_HOOK_ARGS = ("sm_scale", "qk_scale", *POSITIONS, *SIZES)
_INNER_CONSTANTS = (*HEAD_DIMS, "BLOCK_M", "BLOCK_N", "MASKED", "COUNT_VISITS", "DOT_PRECISION")
_PROGRAM_CONSTANTS = (*HEAD_DIMS, "BLOCK_M", "BLOCK_N", "COUNT_VISITS", "DOT_PRECISION")


def input_params(spec: ir.Spec) -> tuple[str, ...]:
    """Per input: its pointer, one stride and one size per dim."""
    return tuple(name for i in spec.inputs for name in (
        f"{i.name}_ptr", *(f"stride_{i.name}_{d}" for d in range(len(i.dims))),
        *(f"size_{i.name}_{d}" for d in range(len(i.dims)))))


def grad_params(spec: ir.Spec) -> tuple[str, ...]:
    # `NAME_grad` never equals another input's `NAME_ptr`: `grad_x` beside a learnable `x` is fine.
    return tuple(f"{i.name}_grad" for i in spec.learnable_inputs)


def table_params(prefix: str = "") -> tuple[str, ...]:
    """A tile table's parameters: counts, indices, batch and head strides, row length."""
    return tuple(prefix + name for name in TABLE)


def kernel_signatures(spec: ir.Spec, tile_table: bool) -> dict[str, Signature]:
    """Every kernel and inner loop of every family, for this spec's inputs and tile table."""
    inputs, grads = input_params(spec), grad_params(spec)
    table = table_params() if tile_table else ()
    sink = SINK if spec.sink is not None else ()
    # DETERMINISTIC: the learnable inputs' gradients are summed exactly (runtime.helpers._grad_add), so
    # every order of their adds gives the same bits; only kernels that add them take it.
    deterministic = ("DETERMINISTIC",) if grads else ()

    def sig(name: str, params: tuple[str, ...], constants: tuple[str, ...] = ()) -> Signature:
        return Signature(name, params + constants, frozenset(constants))

    return {
        # FOLLOW_TABLE: the forward follows the call's tile table; off in cache calls (whose positions a
        # table does not describe) and in every call of a spec without tables.
        "fwd_inner": sig("_fwd_inner", (
            "acc", "l_i", "m_i", "q", "K_head", "V_head", "stride_kz", "stride_kn", "stride_kk", "stride_vz",
            "stride_vn", "stride_vk", *TILE_LOOP, "offs_m", "pos_m", "q_off", "q_first", "offs_d", "offs_dv",
            "sm_scale", "qk_scale", *POSITIONS, *SIZES, *inputs, "pages", "NUM_PAGES"),
            (*_INNER_CONSTANTS, "FOLLOW_TABLE", *PAGING)),
        "fwd_kernel": sig("_fwd_kernel", (
            "Q", "K", "V", "Out", "Lse", *sink, "sm_scale", "qk_scale", *_strides("q", "m"),
            *_strides("k", "n"), *_strides("v", "n"), *_strides("o", "m"), *inputs, *table, *SIZES, "Visits", *CACHE, *PAGE_TABLE,
            *PACKED),
            (*HEAD_DIMS, "BLOCK_M", "BLOCK_N", "COUNT_VISITS", "DOT_PRECISION", "FOLLOW_TABLE", *CACHE_FLAGS,
             *PAGING, "VARLEN")),
        "dkdv_inner": sig("_bwd_dkdv_inner", (
            "dk", "dv", "k", "v", "Q_head", "DO_head", "Lse", "Delta", "row", "stride_qm", "stride_qk",
            "stride_dom", "stride_dok", *TILE_LOOP, "offs_n", "k_first", "offs_d", "offs_dv", "sm_scale",
            "qk_scale", *POSITIONS, *SIZES, *inputs), (*_INNER_CONSTANTS, "FOLLOW_TABLE")),
        "dkdv_program": sig("_bwd_dkdv_program", (
            "start_n", "off_bhkv", "Q", "K", "V", "DO", "Lse", "Delta", "DK", "DV", "sm_scale", "qk_scale",
            *_strides("q", "m"), *_strides("k", "n"), *_strides("v", "n"), *_strides("do", "m"),
            *_strides("dk", "n"), *_strides("dv", "n"), *inputs, *table, *SIZES, "Visits", *PACKED),
            (*_PROGRAM_CONSTANTS, "FOLLOW_TABLE", "VARLEN")),
        "dq_inner": sig("_bwd_dq_inner", (
            "dq", "q", "do", "lse", "delta", "K_head", "V_head", "stride_kn", "stride_kk", "stride_vn",
            "stride_vk", *TILE_LOOP, "offs_m", "q_first", "offs_d", "offs_dv", "sm_scale", "qk_scale",
            *POSITIONS, *SIZES, *inputs, *grads), (*_INNER_CONSTANTS, "FOLLOW_TABLE", *deterministic)),
        "dq_program": sig("_bwd_dq_program", (
            "start_m", "off_bh", "Q", "K", "V", "DO", "Lse", "Delta", "DQ", "sm_scale", "qk_scale",
            *_strides("q", "m"), *_strides("k", "n"), *_strides("v", "n"), *_strides("do", "m"),
            *_strides("dq", "m"), *inputs, *grads, *table, *SIZES, "Visits", *PACKED),
            (*_PROGRAM_CONSTANTS, "FOLLOW_TABLE", "VARLEN", *deterministic)),
        "bwd_kernel": sig("_bwd_kernel", (
            "Q", "K", "V", "DO", "Lse", "Delta", "DQ", "DK", "DV", "sm_scale", "qk_scale",
            *_strides("q", "m"), *_strides("k", "n"), *_strides("v", "n"), *_strides("do", "m"),
            *_strides("dq", "m"), *_strides("dk", "n"), *_strides("dv", "n"), *inputs, *grads,
            *(table_params("kv_") + table_params("q_") if tile_table else ()), *SIZES, "VisitsKV", "VisitsQ",
            *PACKED),
            (*HEAD_DIMS, "BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "PARTS", "COUNT_VISITS", "DOT_PRECISION",
             "FOLLOW_TABLE", "VARLEN", *deterministic)),
        "decode_fwd": sig("_decode_fwd_kernel", (
            "Q", "K", "V", "OutPart", "LsePart", "sm_scale", "qk_scale", *_strides("q", "m"), *_strides("k", "n"),
            *_strides("v", "n"), *inputs, *SIZES, "SPLITS", *CACHE, *PAGE_TABLE),
            (*HEAD_DIMS, "BLOCK_M", "BLOCK_N", "DOT_PRECISION", *CACHE_FLAGS, *PAGING)),
        # The Hopper family's Gluon forward: the kernel, its TMA producer warp, its consumer warpgroups, their
        # loop over key tiles and the softmax step, where the spec's score and mask hooks run.
        "hopper_fwd": sig("_hopper_fwd_kernel", (
            "q_desc", "k_desc", "v_desc", "o_desc", "Out", *_strides("o", "m")[:3], "Lse", *sink, "work_counter",
            "sm_scale", "qk_scale", *inputs, *table, *SIZES, *PACKED),
            (*HEAD_DIMS, "BLOCK_M", "BLOCK_N", "STAGES", "Q_BUFFERS", "PINGPONG", "FOLLOW_TABLE", "DEFER_SCALE",
             "VARLEN")),
        # A persistent CTA takes work items (a query tile of one batch x head) from work_counter;
        # _hopper_fwd_work says which tile and key tiles item `work` is.
        "hopper_work": sig("_hopper_fwd_work", ("work", "n_m", *inputs, *table, *SIZES, "CuSeqlensQ", "CuSeqlensK"),
                           ("BLOCK_M", "BLOCK_N", "FOLLOW_TABLE", "VARLEN")),
        "hopper_producer": sig("_hopper_producer", (
            "q_desc", "k_desc", "v_desc", "q_bufs", "k_bufs", "v_bufs", "q_ready", "q_empty", "k_ready", "k_empty",
            "v_ready", "v_empty", "work_ids", "work_counter", "n_work", "n_m", *inputs, *table, *SIZES,
            "CuSeqlensQ", "CuSeqlensK"),
            ("BLOCK_M", "BLOCK_N", "STAGES", "Q_BUFFERS", "NUM_CONSUMERS", "FOLLOW_TABLE", "VARLEN")),
        "hopper_consumer": sig("_hopper_consumer", (
            "q_bufs", "k_bufs", "v_bufs", "q_ready", "q_empty", "k_ready", "k_empty", "v_ready", "v_empty", "sched",
            "o_desc", "Out", *_strides("o", "m")[:3], "Lse", *sink, "work_ids", "n_work", "n_m", "sm_scale", "qk_scale",
            *inputs, *table, *SIZES, *PACKED),
            (*HEAD_DIMS, "BLOCK_M", "BLOCK_N", "STAGES", "Q_BUFFERS", "FOLLOW_TABLE", "DEFER_SCALE", "WG",
             "NUM_CONSUMERS", "VARLEN")),
        "hopper_loop": sig("_hopper_consumer_loop", (
            "o", "p", "m_i", "l_i", "i_lo", "i_hi", "ring", "turn", "q_smem", "k_bufs", "v_bufs", "k_ready",
            "k_empty", "v_ready", "v_empty", "sched", "off_m", "offs_m", "pos_m", "s_zero", *TILE_RANGE, *_HOOK_ARGS,
            *inputs),
            (*HEAD_DIMS, "BLOCK_M", "BLOCK_N", "STAGES", "MASKED", "FOLLOW_TABLE", "DEFER_SCALE", "dtype", "s_layout",
             "o_layout", "p_layout", "WG", "NUM_CONSUMERS")),
        "hopper_step": sig("_hopper_softmax_step", (
            "qk", "m_i", "l_i", "start_n", "off_m", "offs_m", "pos_m", *_HOOK_ARGS, *inputs),
            (*HEAD_DIMS, "BLOCK_M", "BLOCK_N", "MASKED", "DEFER_SCALE", "s_layout")),
        # The Hopper family's Gluon backward: the kernel (a CTA per key tile of one batch x kv head), its TMA
        # producer warp, its consumer warpgroups, their steps over query tiles (where the spec's hooks run)
        # and the tile range of one query head of the group.
        "hopper_bwd": sig("_hopper_bwd_kernel", (
            "q_desc", "k_desc", "v_desc", "do_desc", "lse_desc", "delta_desc", "dq_desc", "DK", "DV",
            *_strides("dk", "n")[:3], *_strides("dv", "n")[:3], *DQ_FIXED, "sm_scale", "qk_scale", *inputs, *grads,
            *table, *SIZES, *PACKED),
            (*HEAD_DIMS, "BLOCK_M", "BLOCK_N", "STAGES", "FOLLOW_TABLE", "SPLIT_D", "VARLEN", "DETERMINISTIC")),
        "hopper_bwd_range": sig("_hopper_bwd_tile_range", ("start_n", *POSITIONS, *SIZES, *inputs, *table),
                                ("BLOCK_M", "BLOCK_N", "FOLLOW_TABLE")),
        "hopper_bwd_producer": sig("_hopper_bwd_producer", (
            "q_desc", "k_desc", "v_desc", "do_desc", "lse_desc", "delta_desc", "q_bufs", "do_bufs", "lse_bufs",
            "delta_bufs", "k_smem", "v_smem", "kv_bar", "ready", "empty", "start_n", "off_b", "off_hkv", *SIZES,
            "CuSeqlensQ", "CuSeqlensK", *inputs, *table),
            ("BLOCK_M", "BLOCK_N", "STAGES", "FOLLOW_TABLE", "VARLEN")),
        "hopper_bwd_consumer": sig("_hopper_bwd_consumer", (
            "q_bufs", "do_bufs", "lse_bufs", "delta_bufs", "k_smem", "v_smem", "ds_smem", "dq_smem", "kv_bar",
            "ready", "empty", "dq_desc", "DK", "DV", *_strides("dk", "n")[:3], *_strides("dv", "n")[:3], *DQ_FIXED,
            "start_n", "off_b", "off_hkv", "sm_scale", "qk_scale", *SIZES, "CuSeqlensQ", "CuSeqlensK",
            *inputs, *grads, *table), (*HEAD_DIMS, "BLOCK_M", "BLOCK_N", "STAGES", "FOLLOW_TABLE", "SPLIT_D",
                                       "VARLEN", "DETERMINISTIC")),
        "hopper_bwd_steps": sig("_hopper_bwd_steps", (
            "t", "i_lo", "i_hi", "dk", "dv", "q_bufs", "do_bufs", "lse_bufs", "delta_bufs", "k_smem", "v_smem",
            "ds_smem", "dq_smem", "ready", "empty", "dq_desc", *DQ_FIXED, "start_n", "n_masked", *TILE_RANGE,
            "sm_scale", "qk_scale", *POSITIONS, *SIZES, *SEQUENCE, "row_start", *inputs, *grads),
            (*HEAD_DIMS, "BLOCK_M", "BLOCK_N", "STAGES", "MASKED", "FOLLOW_TABLE", "SPLIT_D", "VARLEN", "DETERMINISTIC",
             "dk_layout", "dv_layout")),
        # The merge every spec shares: a spec's sink, if it has one, enters here (HAS_SINK), as one more part.
        "decode_combine": sig("_decode_combine", ("OutPart", "LsePart", "Out", *_strides("o", "m")[:3], "Lse",
                                                  *SINK, "H", "Q_LEN", "n_rows", "SPLITS"),
                              ("HEAD_DIM_V", "HEAD_DIM_V_PAD", "BLOCK_R", "HAS_SINK")),
        **{f"table_{rows}": sig(f"_table_{rows}_classify", ("State", *inputs, *SIZES, "G_H", "n_rows", "n_cols"),
                                ("BLOCK_M", "BLOCK_N", "ROW_STEP", "ROW_POINTS", "LOOP_STEP", "LOOP_POINTS"))
           for rows in ("by_query", "by_key")},
    }
