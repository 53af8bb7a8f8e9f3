"""The Hopper family's emit side: the Gluon spellings of the spec's score and mask on the wgmma
accumulators, the hooks and signatures of its forward and backward kernels, and its declaration."""

from __future__ import annotations

from attngen import ir
from attngen.analysis import Analysis
from attngen.emit.expressions import Spelling
from attngen.emit.hooks import (FORWARD_ROWS, TRANSPOSED, Hook, _dscore_hook, _emitter, _is_constant, _learnable_hook,
                                _mask_hook, _reads, _score_hook, _tile_range_hook)
from attngen.emit.signatures import (DROPOUT, DROPOUT_STATE, FP8_SCALES, HEAD_DIMS, PACKED, POSITIONS, ROW_TERMS, SEQUENCE, SIZES,
                                     TILE_RANGE, Signature, SpecParams, _strides, handover, signature, spec_params,
                                     unpacking)
from attngen.analysis.gathers import NO_OFFSET
from attngen.families.hopper import device

# What the module hands to the family's runtime (families/hopper/runtime.py), by keyword.
DECLARATION = ("forward_kernel=_hopper_fwd_kernel, backward_kernel=_hopper_bwd_kernel, "
               "dq_finish_kernel=_hopper_dq_finish, plain_score=HOPPER_PLAIN_SCORE")
# What its kernels import from its device library (device.py), which no spec changes: the pipelines and the
# helpers a module's functions call.
DEVICE_HELPERS = ("_hopper_fwd_pipeline", "_hopper_bwd_pipeline", "_hopper_sigmoid2", "_hopper_tile_start",
                  "_hopper_box", "_hopper_reduce_add", "_hopper_dq_finish", "_hopper_step_lse")
# What the spec's element hooks may read in the forward's consumers, besides the tile's indices.
_HOOK_ARGS = ("sm_scale", "qk_scale", *POSITIONS, *SIZES)

# The Hopper family's forward (Gluon) runs the forward's hooks on a consumer warpgroup's S accumulator:
# tl's elementwise code runs unchanged on Gluon tensors, only a new tile needs a layout (s_layout). Its
# scores call tanh.approx.f32 (one MUFU op; the family takes 16-bit inputs only, where its 1e-5 relative
# error is far below their rounding); its masks keep the exact tanh, whose decisions must not move.
HOPPER_MASK = Spelling(names=FORWARD_ROWS.names, dims=FORWARD_ROWS.dims,
                       zeros="gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)", sizes=NO_OFFSET)
# Their score hooks know the tile's corners (the consumer's first row off_m, the key tile's start_n), for
# point loads.
HOPPER_SCORE = Spelling(names=FORWARD_ROWS.names, dims=FORWARD_ROWS.dims, zeros=HOPPER_MASK.zeros,
                        tanh="_tanh_approx",
                        corners=("off_m", "off_m + BLOCK_M - 1", "start_n", "start_n + BLOCK_N - 1"),
                        corner_names=("off_m", "start_n"), sizes=NO_OFFSET)
# Its backward works on transposed (key, query) tiles, as the portable dK/dV kernel does, and recomputes
# the scores with the forward's tanh, so P is the one the forward's LSE normalised.
HOPPER_BWD_MASK = Spelling(names=TRANSPOSED.names, dims=TRANSPOSED.dims,
                           zeros="gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)", rows="n", sizes=NO_OFFSET)
HOPPER_BWD_SCORE = Spelling(names=TRANSPOSED.names, dims=TRANSPOSED.dims, zeros=HOPPER_BWD_MASK.zeros,
                            tanh="_tanh_approx", rows="n",
                            corners=("start_m", "start_m + BLOCK_M - 1",
                                     "start_n * BLOCK_N", "start_n * BLOCK_N + BLOCK_N - 1"),
                            corner_names=("start_m", "start_n"), sizes=NO_OFFSET)


# A forward step with more than this many lines of score and mask code runs in one loop (ONE_LOOP) unless its
# score gathers an input at q and k: two loops hold three copies of the step in each consumer (the peeled first
# step, the masked and the unmasked loop), far past the SM's instruction caches for a long step. Forward on an
# H100, B2 H16 N8192 D64, one loop against two (tools/time_catalog.py, two rounds): natten_morton (87 lines)
# 0.94x the time, random specs of 28, 18 and 15 lines 0.95x, 0.90x and 0.84x; of 13 and 12 lines 1.01-1.02x and
# 1.07x; learned_rel_bias (25 lines, a gather whose addresses spill) 1.11x. Shorter steps vary both ways (causal
# 1.00x, sliding_window 0.96x, a chunk mask of 7 lines 0.84x): not taken.
HOPPER_ONE_LOOP_LINES = 13


def _code_lines(hook: Hook) -> int:
    """The lines of code of a hook, comments and blank lines left out."""
    return sum(1 for line in hook.code.splitlines() if line.strip() and not line.strip().startswith("#"))


def _hopper_hooks(facts: Analysis) -> dict[str, Hook]:
    """Hooks of the Hopper family's forward: the forward's tile range (one per CTA, whose BLOCK_M rows
    its consumer warpgroups share), and its score and mask in the Gluon spellings; `plain_score` says
    the spec has no score expression (the kernel may then scale the scores after their row max),
    `one_loop` that its step runs in one loop (HOPPER_ONE_LOOP_LINES says when)."""
    tile_range = _tile_range_hook(facts, "k", "q_off")
    score = _score_hook(facts.spec, _emitter(facts, HOPPER_SCORE, "sc"))
    mask = _mask_hook(facts, HOPPER_MASK)
    return {"score": score, "mask": mask, "tile_range": tile_range,
            "plain_score": facts.spec.score is None or facts.spec.score == ir.Score(),
            "one_loop": _code_lines(score) + _code_lines(mask) > HOPPER_ONE_LOOP_LINES and not facts.score_gathers,
            "reads_q_off": _reads(tile_range.code, "q_off")}


def _hopper_backward_hooks(facts: Analysis) -> dict:
    """Hooks of the Hopper family's backward: a CTA per key tile computes its dK and dV and its share of
    dQ and of the learnable inputs' gradients, on transposed S tiles, over the dK/dV kernel's tile
    range (for the family's own tiles). `remask`: dS needs the mask again after the score's derivative
    or for a learnable input's gradient unless each of them is a finite constant (P = 0 has zeroed dS
    where the mask is off, and a constant keeps it 0)."""
    em = _emitter(facts, HOPPER_BWD_SCORE, "sc")
    score = _score_hook(facts.spec, em)
    # Before dscore: it reads dsT unscaled. fp32 atomics always: the family serves no deterministic call.
    learnable = _learnable_hook(facts, em, score, "dsT", deterministic=False)
    derivatives = [d for _, d in facts.learnable_derivatives]
    if facts.score_derivative is not None:
        derivatives.append(facts.score_derivative)
    return {"score": score, "mask": _mask_hook(facts, HOPPER_BWD_MASK), "tile_range": _tile_range_hook(facts, "q"),
            "learnable": learnable, "dscore": _dscore_hook(facts, em, score, "dsT"),
            "remask": not all(_is_constant(d, facts) for d in derivatives)}


def _pipeline_arguments(facts: Analysis) -> dict:
    """How its kernels hand the spec's parameters and functions to the device library's pipelines: the
    spec's inputs, tile table, learnable inputs' gradients and sink as tuples (`packing`, unpacked only
    by the module's own functions: `unpacking`), its functions as the constexprs SPEC_* (bound by an
    annotated assignment: Triton makes a Gluon function constexpr only so), and None for the row terms a
    sigmoid spec lacks."""
    p = spec_params(facts.spec, facts.tile_table)
    flags = {"SIGMOID": not p.softmax}
    forward = {"SPEC_RANGE": "_hopper_fwd_tile_range", "SPEC_STEP": "_hopper_softmax_step"}
    backward = {"SPEC_RANGE": "_hopper_bwd_tile_range", "SPEC_STEPS": "_hopper_bwd_steps"}
    return {
        "unpack_inputs": unpacking("inputs", p.inputs, 4), "unpack_table": unpacking("table", p.table, 4),
        "unpack_grads": unpacking("grads", p.grads, 4),
        "pack_forward": handover({"inputs": p.inputs, "table": p.table, "sink_args": p.sink}, forward,
                                 "gl.constexpr"),
        "pack_backward": handover({"inputs": p.inputs, "grads": p.grads, "table": p.table}, backward,
                                  "gl.constexpr"),
        "forward_values": dict(SINK=bool(p.sink), ONE_LOOP="HOPPER_ONE_LOOP", **flags,
                               **({} if p.softmax else {"Lse": None})),
        "backward_values": dict(**flags, **({} if p.softmax else {"lse_desc": None, "delta_desc": None})),
    }


def context(facts: Analysis) -> dict:
    """What its template (kernels.py.jinja) fills in for this spec: its forward's and its backward's hooks,
    and how its kernels call the pipelines."""
    return dict(hopper=_hopper_hooks(facts) | _pipeline_arguments(facts), hopper_bwd=_hopper_backward_hooks(facts))


def signatures(p: SpecParams) -> dict[str, Signature]:
    """Its kernels' signatures, for a spec's parameters."""
    sig, inputs, grads, table, sink = signature, p.inputs, p.grads, p.table, p.sink
    lse = ROW_TERMS[:1] if p.softmax else ()
    # The backward's row terms, as TMA descriptors.
    row_descriptors = ("lse_desc", "delta_desc") if p.softmax else ()
    return {
        # The Hopper family's Gluon forward: the kernel, its TMA producer warp, its consumer warpgroups, their
        # loop over key tiles and the softmax step, where the spec's score and mask hooks run.
        "hopper_fwd": sig("_hopper_fwd_kernel", (
            "q_desc", "k_desc", "v_desc", "o_desc", "Out", *_strides("o", "m")[:3], *lse, *sink, "work_counter",
            "sm_scale", "qk_scale", *DROPOUT, *FP8_SCALES, *inputs, *table, *SIZES, *PACKED),
            (*HEAD_DIMS, "BLOCK_M", "BLOCK_N", "STAGES", "Q_BUFFERS", "CONSUMERS", "FOLLOW_TABLE", "DEFER_SCALE",
             "VARLEN", "DROPOUT", "FP8")),
        # The spec's parts of it: the key tiles a work item visits, and the softmax step on an S tile, where
        # the spec's score and mask hooks run (the pipeline's SPEC_RANGE and SPEC_STEP). The spec's inputs
        # and tile table reach them as the tuples `inputs` and `table`.
        "hopper_range": sig("_hopper_fwd_tile_range", ("start_m", *POSITIONS, *SIZES, "inputs", "table"),
                            ("BLOCK_M", "BLOCK_N", "FOLLOW_TABLE")),
        "hopper_step": sig("_hopper_softmax_step", (
            "qk", "m_i", "l_i", "start_n", "off_m", "offs_m", "pos_m", *_HOOK_ARGS, "inputs", *DROPOUT_STATE,
            "mask_step"),
            (*HEAD_DIMS, "BLOCK_M", "BLOCK_N", "MASKED", "DEFER_SCALE", "s_layout", "DROPOUT")),
        "hopper_fwd_pipeline": Signature.of(device._hopper_fwd_pipeline),
        # The Hopper family's Gluon backward: the kernel (a CTA per key tile of one batch x kv head), the tile
        # range of one query head of the group and the consumer's steps over query tiles (where the spec's
        # hooks run): the pipeline's SPEC_RANGE and SPEC_STEPS.
        "hopper_bwd": sig("_hopper_bwd_kernel", (
            "q_desc", "k_desc", "v_desc", "do_desc", *row_descriptors, "dq_desc", "DK", "DV",
            *_strides("dk", "n")[:3], *_strides("dv", "n")[:3], "sm_scale", "qk_scale", *DROPOUT, *inputs, *grads,
            *table, *SIZES, *PACKED),
            (*HEAD_DIMS, "BLOCK_M", "BLOCK_N", "STAGES", "FOLLOW_TABLE", "SPLIT_D", "VARLEN", "DROPOUT", "FOLD_ROWS",
             "FOLD_LSE")),
        "hopper_bwd_range": sig("_hopper_bwd_tile_range", ("start_n", *POSITIONS, *SIZES, "inputs", "table"),
                                ("BLOCK_M", "BLOCK_N", "FOLLOW_TABLE")),
        "hopper_bwd_steps": sig("_hopper_bwd_steps", (
            "t", "i_lo", "i_hi", "dk", "dv", "q_bufs", "do_bufs", "lse_bufs", "delta_bufs", "k_smem", "v_smem",
            "ds_smem", "dq_smem", "ready", "empty", "dq_desc", "start_n", "n_masked", *TILE_RANGE, "sm_scale",
            "qk_scale", *POSITIONS, *SIZES, *SEQUENCE, "inputs", "grads", *DROPOUT_STATE),
            (*HEAD_DIMS, "BLOCK_M", "BLOCK_N", "STAGES", "MASKED", "FOLLOW_TABLE", "SPLIT_D", "VARLEN", "dk_layout",
             "dv_layout", "DROPOUT", "FOLD_ROWS", "FOLD_LSE")),
        "hopper_bwd_pipeline": Signature.of(device._hopper_bwd_pipeline),
    }
