"""The kernels' parameter lists, declared once in Python and rendered as each @triton.jit function's `def` and its calls."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from attngen import families as registry
from attngen import ir
from attngen.emit.families import emit_side

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

    @classmethod
    def of(cls, function) -> "Signature":
        """The signature of a @triton.jit (or @gluon.jit) function of attngen's own (a family's device
        library), read from its Python definition (Triton's interpreter wraps it differently): a module's
        kernels call it by this."""
        params = inspect.signature(function.fn).parameters.values()
        return cls(function.__name__, tuple(p.name for p in params),
                   frozenset(p.name for p in params if _is_constexpr(p.annotation)))

    def _values(self, values: dict) -> list[str]:
        unknown = set(values) - set(self.params)
        assert not unknown, f"{self.name} has no parameter(s) {sorted(unknown)}"
        return [_code(values.get(p, p)) for p in self.params]


def _is_constexpr(annotation) -> bool:
    # tl.constexpr and gl.constexpr, as objects or (postponed annotations) as text.
    return getattr(annotation, "__name__", None) == "constexpr" or (
        isinstance(annotation, str) and annotation.split(".")[-1] == "constexpr")


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


def packing(name: str, items: tuple[str, ...], column: int) -> str:
    """Lines starting at `column`, after a line break, that bind `name` to the tuple of the parameters
    `items` (the empty tuple without any): how a kernel hands one kind of the spec's parameters to a device
    library's function, which passes them on unopened."""
    spelled = [*items[:-1], items[-1] + ("," if len(items) == 1 else "")] if items else []
    return _at_column(_wrapped(f"{name} = (", spelled, ")", column) if items else f"{name} = ()", column)


def unpacking(name: str, items: tuple[str, ...], column: int) -> str:
    """The inverse of `packing`, in the module's function that reads them: lines starting at `column`, after
    a line break, that bind each of `items` from the tuple `name`; nothing without any."""
    if not items:
        return ""
    spelled = [*items[:-1], items[-1] + ("," if len(items) == 1 else "")]
    return _at_column(_wrapped("(", spelled, f") = {name}", column), column)


def handover(tuples: dict[str, tuple[str, ...]], functions: dict[str, str], constexpr: str) -> str:
    """The lines, at column 4 of a kernel's body, by which it hands what its spec decides to a device library's
    function: each kind of the spec's parameters as a tuple (`packing`), each of the module's functions bound
    to a constexpr (an annotated assignment, `constexpr` spelled as the kernel's dialect spells it: Triton makes
    a function constexpr only so)."""
    return "".join([*(packing(name, items, 4) for name, items in tuples.items()),
                    *(f"\n    {name}: {constexpr} = {function}" for name, function in functions.items())])


def _at_column(text: str, column: int) -> str:
    return "".join(f"\n{' ' * column}{line}" for line in text.split("\n"))


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
# A softmax spec's forward kernels write each row's LSE, and its backward kernels read it and the row term
# delta = rowsum(dO * O); a sigmoid spec has neither (each key's weight is its own sigmoid(score'), and
# dS = P * (1 - P) * dP), so its kernels have no such parameters.
ROW_TERMS = ("Lse", "Delta")
# Dropout (DROPOUT, a call's dropout_p > 0): the call's Philox words (Rng, int64 [seed, offset]) and p, which
# each kernel that forms P reads, and the state its programs derive from them once (runtime.helpers'
# _dropout_state) for the loops that regenerate the keep-mask.
DROPOUT = ("Rng", "dropout_p")
DROPOUT_STATE = ("dropout_seed", "dropout_offset", "dropout_threshold", "dropout_scale")
# FP8 (FP8, a call of float8_e4m3fn q, k and v): per (batch, key/value head) descale factors of q, k and v
# ((B, HKV) fp32, one pair of strides for the three), which the portable and Hopper forwards fold into the
# scale and O.
FP8_SCALES = ("QDescale", "KDescale", "VDescale", "stride_db", "stride_dh")
# Which key tiles a forward program visits (the tile-range hook defines them): with mask code, numbers
# [masked_lo, masked_hi) skipping `gap` tiles from number `gap_at` on, then without, [full_lo, full_hi);
# with a tile table (FOLLOW_TABLE) the numbers index the lists at masked_tiles and full_tiles.
TILE_RANGE = ("masked_tiles", "masked_lo", "masked_hi", "gap_at", "gap", "full_tiles", "full_lo", "full_hi")


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


@dataclass(frozen=True)
class SpecParams:
    """The parameters a spec adds to its kernels: per input its pointer, strides and sizes (`inputs`), the
    learnable ones' gradients (`grads`), a tile table's (`table`, empty without one) and the sink's rows
    (`sink`, empty without a sink); `softmax`: whether its kernels have the row terms (ROW_TERMS);
    `deterministic`: the DETERMINISTIC constexpr of the kernels that add the learnable inputs' gradients, which
    then sum them exactly (runtime.helpers._grad_add, the same bits in every order), empty without them."""
    inputs: tuple[str, ...]
    grads: tuple[str, ...]
    table: tuple[str, ...]
    sink: tuple[str, ...]
    tile_table: bool
    softmax: bool
    deterministic: tuple[str, ...]


def spec_params(spec: ir.Spec, tile_table: bool) -> SpecParams:
    grads = grad_params(spec)
    return SpecParams(input_params(spec), grads, table_params() if tile_table else (),
                      SINK if spec.sink is not None else (), tile_table, not spec.sigmoid,
                      ("DETERMINISTIC",) if grads else ())


def signature(name: str, params: tuple[str, ...], constants: tuple[str, ...] = ()) -> Signature:
    """A Signature whose parameters are `params` and then the constexprs `constants`."""
    return Signature(name, params + constants, frozenset(constants))


def kernel_signatures(spec: ir.Spec, tile_table: bool, families: tuple[str, ...] = registry.FAMILIES
                      ) -> dict[str, Signature]:
    """Every kernel and inner loop of `families` (each declares its own: its folder's emit.py) and the tile
    tables' kernels, for this spec's inputs and tile table."""
    p = spec_params(spec, tile_table)
    signatures = {f"table_{rows}": signature(f"_table_{rows}_classify", ("State", *p.inputs, *SIZES, "G_H", "n_rows", "n_cols"),
                                             ("BLOCK_M", "BLOCK_N", "ROW_STEP", "ROW_POINTS", "LOOP_STEP", "LOOP_POINTS"))
                  for rows in ("by_query", "by_key")}
    for name in families:
        signatures.update(emit_side(name).signatures(p))
    return signatures
