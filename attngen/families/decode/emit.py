"""The decode family's emit side: its tiles' spelling (rows mixing the query heads of one key/value head),
the hooks and signatures of its split-KV kernel and of the merge of its splits, and its declaration."""

from __future__ import annotations

from attngen.analysis import Analysis
from attngen.emit.expressions import Spelling
from attngen.emit.hooks import (FORWARD_BOUNDS, FORWARD_ROWS, ROW_MAJOR, Hook, _bounds_hook, _emitter, _mask_hook,
                                _read_ends, _reads, _score_hook)
from attngen.emit.signatures import (CACHE, CACHE_FLAGS, HEAD_DIMS, PAGE_TABLE, PAGING, SINK, SIZES, Signature,
                                     SpecParams, _strides, signature)
from attngen.families.decode.family import DECODE_MAX_ROWS

# What the module hands to the family's runtime (families/decode/runtime.py), by keyword.
DECLARATION = "forward_kernel=_decode_fwd_kernel, max_rows=DECODE_MAX_ROWS"
# The device helpers its kernels import from its runtime side: none (the merge of the splits, a kernel no spec
# changes, is its runtime's own).
DEVICE_HELPERS: tuple[str, ...] = ()

# The decode family's tiles pack the query heads of one key/value head: row r is query offs_m[r]
# (at position pos_m[r]) of head row_h[r], so the head varies along the rows; row_ok says the row holds
# a query.
DECODE_ROWS = Spelling(
    names={**FORWARD_ROWS.names, "h": "row_h[:, None]"},
    dims={**ROW_MAJOR.dims, "h": frozenset("m")},
    zeros="tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)",
    element_names=("offs_m", "pos_m", "offs_n", "off_b", "row_h", "off_hkv", "row_ok"),
    bounds_checks=("row_ok[:, None]", "offs_n[None, :] < KV_LEN"))


def _decode_hooks(facts: Analysis) -> dict[str, Hook]:
    """Hooks of the decode family's forward kernel: a block of rows holds queries of all the query
    heads of one key/value head, so its key bounds are those of its first and last query
    (its family entry serves no mask whose bounds read the query head)."""
    bounds = _bounds_hook(facts, "k", spelling=FORWARD_BOUNDS)
    assert not _reads(bounds.code, "off_h"), "the decode family serves no mask whose bounds read h"
    ends = ["q_first = (block_row * BLOCK_M) // G + q_off",
            "q_last = tl.minimum((block_row * BLOCK_M + BLOCK_M - 1) // G, Q_LEN - 1) + q_off"]
    code = [*_read_ends(ends, bounds.code), bounds.code]
    key_range = Hook("key_range", ("off_b", "off_hkv", "q_off", "block_row", "G"), bounds.outputs, "\n".join(code))
    return {"score": _score_hook(facts.spec, _emitter(facts, DECODE_ROWS, "sc")),
            "mask": _mask_hook(facts, DECODE_ROWS), "key_range": key_range}


def context(facts: Analysis) -> dict:
    """What its template (kernels.py.jinja) fills in for this spec."""
    decode = _decode_hooks(facts)
    return dict(
        decode=decode,
        # Whether the decode kernel reads query positions (else it never loads q_offset).
        decode_positions=any(_reads(h.code, name) for h in decode.values() for name in ("pos_m", "q_off")),
        decode_max_rows=DECODE_MAX_ROWS,
    )


def signatures(p: SpecParams) -> dict[str, Signature]:
    """Its kernels' signatures, for a spec's parameters."""
    sig, inputs = signature, p.inputs
    lse_part = ("LsePart",) if p.softmax else ()  # the shares' LSE
    return {
        "decode_fwd": sig("_decode_fwd_kernel", (
            "Q", "K", "V", "OutPart", *lse_part, "sm_scale", "qk_scale", *_strides("q", "m"), *_strides("k", "n"),
            *_strides("v", "n"), *inputs, *SIZES, "SPLITS", *CACHE, *PAGE_TABLE),
            (*HEAD_DIMS, "BLOCK_M", "BLOCK_N", "DOT_PRECISION", *CACHE_FLAGS, *PAGING)),
        # The merge every spec shares: a spec's sink, if it has one, enters here (HAS_SINK), as one more part;
        # a sigmoid spec's parts add (ADD_PARTS).
        # A cache call's values are checked here too (CHECK).
        "decode_combine": sig("_decode_combine", ("OutPart", "LsePart", "Out", *_strides("o", "m")[:3], "Lse",
                                                  *SINK, *CACHE, *PAGE_TABLE[:2], "H", "Q_LEN", "n_rows", "SPLITS",
                                                  "MAX_KV", "MAX_OFFSET", PAGE_TABLE[2], "MAX_PAGES"),
                              ("HEAD_DIM_V", "HEAD_DIM_V_PAD", "SPLIT_BLOCK", "HAS_SINK", "ADD_PARTS", "CHECK",
                               *CACHE_FLAGS, *PAGING, "BLOCK_PAGES")),
    }
