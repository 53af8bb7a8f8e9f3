"""The portable family's emit side: the hooks of its forward, dK/dV and dQ kernels (the spec's score, mask,
tile ranges, derivatives and learnable inputs' gradients in the row-major and transposed spellings) and
their signatures."""

from __future__ import annotations

from dataclasses import replace

from attngen.analysis import Analysis
from attngen.emit.expressions import Spelling
from attngen.emit.hooks import (FORWARD_ROWS, ROW_MAJOR, TRANSPOSED, Hook, _dscore_hook, _emitter, _learnable_hook,
                                _mask_hook, _score_hook, _tile_range_hook)
from attngen.emit.signatures import (CACHE, CACHE_FLAGS, DROPOUT, DROPOUT_STATE, FP8_SCALES, HEAD_DIMS, PACKED, PAGE_TABLE, PAGING,
                                     POSITIONS, ROW_TERMS, SIZES, TABLE, TILE_LOOP, Signature, SpecParams, _strides,
                                     handover, signature, spec_params, table_params, unpacking)
from attngen.families.portable import device

# Its kernels are the Attention's own (runtime.facts.Kernels, in the module's declaration): nothing to hand
# over by keyword. Its device library (device.py) offers the forward's program; its other device helpers
# are the shared ones (runtime/helpers.py).
DECLARATION = None
DEVICE_HELPERS = ("_fwd_program",)
_INNER_CONSTANTS = (*HEAD_DIMS, "BLOCK_M", "BLOCK_N", "MASKED", "COUNT_VISITS", "DOT_PRECISION")
_PROGRAM_CONSTANTS = (*HEAD_DIMS, "BLOCK_M", "BLOCK_N", "COUNT_VISITS", "DOT_PRECISION")

# The portable kernels' tile corners, for the score's point loads: the row block's first query position or
# key (q_first, k_first: parameters of the inner loops) and the loop's tile start (start_n, start_m). Their
# masks keep the plain spellings, which the tile-table kernels share.
PORTABLE_CORNERS = {
    "k": dict(corners=("q_first", "q_first + BLOCK_M - 1", "start_n", "start_n + BLOCK_N - 1"),
              corner_names=("q_first", "start_n")),
    "q": dict(corners=("start_m", "start_m + BLOCK_M - 1", "k_first", "k_first + BLOCK_N - 1"),
              corner_names=("start_m", "k_first"))}


def _kernel_hooks(facts: Analysis, spelling: Spelling, loop: str, ds_var: str) -> dict[str, Hook]:
    em = _emitter(facts, replace(spelling, **PORTABLE_CORNERS[loop]), "sc")
    score = _score_hook(facts.spec, em)
    offset = "q_off" if spelling is FORWARD_ROWS else ""
    hooks = {"score": score, "mask": _mask_hook(facts, spelling), "tile_range": _tile_range_hook(facts, loop, offset)}
    if ds_var == "ds":
        hooks["learnable"] = _learnable_hook(facts, em, score)
    if ds_var:
        hooks["dscore"] = _dscore_hook(facts, em, score, ds_var)
    return hooks


def _forward_program(facts: Analysis) -> dict:
    """How its forward kernel hands the spec's parameters and functions to the device library's _fwd_program:
    the spec's inputs, tile table and sink as tuples (unpacked only by the module's _fwd_tile_range and
    _fwd_inner), those functions as the constexprs SPEC_RANGE and SPEC_INNER (bound by an annotated
    assignment: Triton makes a function constexpr only so), and None for the LSE a sigmoid spec lacks."""
    p = spec_params(facts.spec, facts.tile_table)
    functions = {"SPEC_RANGE": "_fwd_tile_range", "SPEC_INNER": "_fwd_inner"}
    return {
        "unpack_inputs": unpacking("inputs", p.inputs, 4), "unpack_table": unpacking("table", p.table, 4),
        "pack": handover({"inputs": p.inputs, "table": p.table, "sink_args": p.sink}, functions, "tl.constexpr"),
        "program_values": dict(SIGMOID=not p.softmax, SINK=bool(p.sink), **({} if p.softmax else {"Lse": None})),
    }


def context(facts: Analysis) -> dict:
    """What its templates (kernels.py.jinja and the files it includes) fill in for this spec."""
    return dict(
        fwd=_kernel_hooks(facts, FORWARD_ROWS, "k", "") | _forward_program(facts),
        dq=_kernel_hooks(facts, ROW_MAJOR, "k", "ds"),
        dkdv=_kernel_hooks(facts, TRANSPOSED, "q", "dsT"),
        # _bwd_kernel's two tables, passed to the programs' unprefixed table parameters.
        kv_table=dict(zip(TABLE, table_params("kv_"))) if facts.tile_table else {},
        q_table=dict(zip(TABLE, table_params("q_"))) if facts.tile_table else {},
    )


def signatures(p: SpecParams) -> dict[str, Signature]:
    """Its kernels' signatures, for a spec's parameters."""
    sig, inputs, grads, table, sink, tile_table = signature, p.inputs, p.grads, p.table, p.sink, p.tile_table
    lse, rows = ROW_TERMS[:1] if p.softmax else (), ROW_TERMS if p.softmax else ()
    # The same, as the inner loops hold them, and where a head's rows begin in LSE and delta.
    row_values, row_offset = (("lse", "delta"), ("row",)) if p.softmax else ((), ())
    return {
        # FOLLOW_TABLE: the forward follows the call's tile table; off in cache calls (whose positions a
        # table does not describe) and in every call of a spec without tables.
        # The spec's parts of the forward (device.py's _fwd_program runs them): its inner loop over key tiles,
        # where its score and mask run, and its tile range; the spec's inputs and table reach them as tuples.
        "fwd_inner": sig("_fwd_inner", (
            "acc", "l_i", "m_i", "q", "K_head", "V_head", "stride_kz", "stride_kn", "stride_kk", "stride_vz",
            "stride_vn", "stride_vk", *TILE_LOOP, "offs_m", "pos_m", "q_off", "q_first", "offs_d", "offs_dv",
            "sm_scale", "qk_scale", *POSITIONS, *SIZES, "inputs", "pages", "NUM_PAGES", *DROPOUT_STATE),
            (*_INNER_CONSTANTS, "FOLLOW_TABLE", *PAGING, "DROPOUT")),
        "fwd_range": sig("_fwd_tile_range", ("start_m", *POSITIONS, *SIZES, "q_off", "inputs", "table"),
                         ("BLOCK_M", "BLOCK_N", "FOLLOW_TABLE")),
        "fwd_program": Signature.of(device._fwd_program),
        "fwd_kernel": sig("_fwd_kernel", (
            "Q", "K", "V", "Out", *lse, *sink, "sm_scale", "qk_scale", *DROPOUT, *FP8_SCALES, *_strides("q", "m"),
            *_strides("k", "n"), *_strides("v", "n"), *_strides("o", "m"), *inputs, *table, *SIZES, "Visits", *CACHE, *PAGE_TABLE,
            *PACKED),
            (*HEAD_DIMS, "BLOCK_M", "BLOCK_N", "COUNT_VISITS", "DOT_PRECISION", "FOLLOW_TABLE", *CACHE_FLAGS,
             *PAGING, "VARLEN", "DROPOUT", "FP8")),
        "dkdv_inner": sig("_bwd_dkdv_inner", (
            "dk", "dv", "k", "v", "Q_head", "DO_head", *rows, *row_offset, "stride_qm", "stride_qk",
            "stride_dom", "stride_dok", *TILE_LOOP, "offs_n", "k_first", "offs_d", "offs_dv", "sm_scale",
            "qk_scale", *POSITIONS, *SIZES, *inputs, *DROPOUT_STATE), (*_INNER_CONSTANTS, "FOLLOW_TABLE", "DROPOUT")),
        "dkdv_program": sig("_bwd_dkdv_program", (
            "start_n", "off_bhkv", "Q", "K", "V", "DO", *rows, "DK", "DV", "sm_scale", "qk_scale", *DROPOUT,
            *_strides("q", "m"), *_strides("k", "n"), *_strides("v", "n"), *_strides("do", "m"),
            *_strides("dk", "n"), *_strides("dv", "n"), *inputs, *table, *SIZES, "Visits", *PACKED),
            (*_PROGRAM_CONSTANTS, "FOLLOW_TABLE", "VARLEN", "DROPOUT")),
        "dq_inner": sig("_bwd_dq_inner", (
            "dq", "q", "do", *row_values, "K_head", "V_head", "stride_kn", "stride_kk", "stride_vn",
            "stride_vk", *TILE_LOOP, "offs_m", "q_first", "offs_d", "offs_dv", "sm_scale", "qk_scale",
            *POSITIONS, *SIZES, *inputs, *grads, *DROPOUT_STATE),
            (*_INNER_CONSTANTS, "FOLLOW_TABLE", *p.deterministic, "DROPOUT")),
        "dq_program": sig("_bwd_dq_program", (
            "start_m", "off_bh", "Q", "K", "V", "DO", *rows, "DQ", "sm_scale", "qk_scale", *DROPOUT,
            *_strides("q", "m"), *_strides("k", "n"), *_strides("v", "n"), *_strides("do", "m"),
            *_strides("dq", "m"), *inputs, *grads, *table, *SIZES, "Visits", *PACKED),
            (*_PROGRAM_CONSTANTS, "FOLLOW_TABLE", "VARLEN", *p.deterministic, "DROPOUT")),
        "bwd_kernel": sig("_bwd_kernel", (
            "Q", "K", "V", "DO", *rows, "DQ", "DK", "DV", "sm_scale", "qk_scale", *DROPOUT,
            *_strides("q", "m"), *_strides("k", "n"), *_strides("v", "n"), *_strides("do", "m"),
            *_strides("dq", "m"), *_strides("dk", "n"), *_strides("dv", "n"), *inputs, *grads,
            *(table_params("kv_") + table_params("q_") if tile_table else ()), *SIZES, "VisitsKV", "VisitsQ",
            *PACKED),
            (*HEAD_DIMS, "BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "PARTS", "COUNT_VISITS", "DOT_PRECISION",
             "FOLLOW_TABLE", "VARLEN", *p.deterministic, "DROPOUT")),
    }
