"""Frontend: spec text to IR (parser and lowering), param overrides, fingerprints, JSON, and positioned errors."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

import attngen
from attngen.api import parse_spec, with_params
from attngen.errors import ArgumentError, SpecError
from attngen.frontend.parser import MAX_SOURCE_CHARS
from attngen.frontend.printer import host_scale, to_source
from attngen.ir import Binary, Call, Const, InputDecl, Load, Param, ParamDecl, Score, Size, Spec, Unary, Var, children

SPECS = sorted((Path(__file__).parent.parent / "specs").glob("*.attn"))

Q, K = Var(name="q"), Var(name="k")


def i(value: int) -> Const:
    return Const(type="int", value=value)


def f(value: float) -> Const:
    return Const(type="float", value=value)


def b(op: str, left, right, type: str = "int") -> Binary:
    return Binary(type=type, op=op, left=left, right=right)


def body(text: str) -> Spec:
    return parse_spec("attention t\n" + text)


# --- specs that parse ----------------------------------------------------------------------------

def test_the_catalog_is_there():
    assert len(SPECS) >= 10


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_every_catalog_spec_parses(path):
    spec = parse_spec(path.read_text(), str(path))
    assert spec.name == path.stem
    assert spec.mask is not None or spec.score is not None or path.stem == "full"
    if spec.mask is not None:
        assert spec.mask.type == "bool"
    if spec.score is not None:
        assert spec.score.type == "float"


DSL_EXAMPLES = {
    "alibi_causal": """\
# alibi_causal.attn: ALiBi linear biases (Press et al.) under a causal mask
attention alibi_causal

input slopes: f32[H]              # one slope per query head, given at call time

mask:  causal
score: score + slopes[h] * (k - q)
""",
    "sliding_window": """\
attention sliding_window
param window = 1024
mask: causal and q - k < window
""",
    "document_causal": """\
attention document_causal          # packed sequences: attend within one's own document
input doc: i32[KV_LEN]             # document id of every position, non-decreasing
mask: doc[q] == doc[k] and causal
""",
    "gemma2_local": """\
attention gemma2_local
param window = 4096
mask: causal and q - k < window
score: softcap(score, 50.0)
""",
    "prefix_lm": """\
attention prefix_lm                # bidirectional over each sequence's prefix, causal after it
input prefix: i32[B]
mask: k < prefix[b] or causal
""",
    "learned_rel_bias": """\
attention learned_rel_bias         # a trainable bias per head and clipped distance
input table: f32[H, 257] learnable
score: score + table[h, clamp(q - k, -128, 128) + 128]
""",
    "block_sparse": """\
attention block_sparse             # a per-head block layout (BigBird / strided patterns)
input layout: bool[H, *, *]
mask: layout[h, q // 128, k // 128]
""",
}


@pytest.mark.parametrize("name", list(DSL_EXAMPLES))
def test_dsl_examples_parse(name):
    spec = parse_spec(DSL_EXAMPLES[name], f"{name}.attn")
    assert spec.name == name


def test_dsl_examples_lower_to_the_expected_ir():
    alibi = parse_spec(DSL_EXAMPLES["alibi_causal"])
    assert alibi.inputs == (InputDecl(name="slopes", dtype="f32", dims=("H",)),)
    assert alibi.mask == b("ge", Q, K, "bool")
    slope = Load(type="float", input="slopes", index=(Var(name="h"),))
    assert alibi.score == b("add", Score(), b("mul", slope, b("sub", K, Q), "float"), "float")

    sliding = parse_spec(DSL_EXAMPLES["sliding_window"])
    assert sliding.params == (ParamDecl(name="window", type="int", value=1024),)
    assert sliding.mask == b("and", b("ge", Q, K, "bool"),
                             b("lt", b("sub", Q, K), Param(type="int", name="window"), "bool"), "bool")

    rel = parse_spec(DSL_EXAMPLES["learned_rel_bias"])
    (table,) = rel.inputs
    assert table.learnable and table.dims == ("H", 257)
    clamp = Call(type="int", fn="clamp", args=(b("sub", Q, K), Unary(type="int", op="neg", operand=i(128)), i(128)))
    assert rel.score.right == Load(type="float", input="table", index=(Var(name="h"), b("add", clamp, i(128))))

    sparse = parse_spec(DSL_EXAMPLES["block_sparse"])
    assert sparse.inputs[0].dims == ("H", "*", "*")
    assert sparse.mask == Load(type="bool", input="layout",
                               index=(Var(name="h"), b("floordiv", Q, i(128)), b("floordiv", K, i(128))))


def test_causal_bottom_right_shifts_the_row_by_the_length_difference():
    # The row, q - Q_OFFSET: a cache call has placed row 0 at position q_offset[b] already.
    row = b("sub", Q, Size(name="Q_OFFSET"))
    shift = b("sub", Size(name="KV_LEN"), Size(name="Q_LEN"))
    assert body("mask: causal_bottom_right\n").mask == b("ge", b("add", row, shift), K, "bool")
    with pytest.raises(attngen.SpecError, match="unknown name 'Q_OFFSET'"):
        body("mask: q - Q_OFFSET >= k\n")
    with pytest.raises(attngen.SpecError, match="'Q_OFFSET' is a reserved name"):
        body("param Q_OFFSET = 1\nmask: causal_bottom_right\n")


def test_comments_blank_lines_and_items_in_any_order():
    spec = parse_spec("""
# leading comment

attention t   # trailing comment on the header
# a comment line between items

score: score * w    # uses a param declared below

   # an indented comment
param w = 2
mask: causal

""")
    assert spec.name == "t"
    assert spec.score == b("mul", Score(), Param(type="int", name="w"), "float")
    assert spec.mask == b("ge", Q, K, "bool")


def test_an_expression_continues_over_lines_inside_brackets():
    spec = body("""\
param window = 8
mask: (causal and
       q - k < window)   # a comment inside the brackets
score: min(score,
           # a comment line inside the call
           2.0)
""")
    assert spec.mask == body("param window = 8\nmask: causal and q - k < window\n").mask
    assert spec.score == Call(type="float", fn="min", args=(Score(), f(2.0)))


def test_chained_comparison_is_a_conjunction():
    d = b("sub", Q, K)
    assert body("mask: 0 <= q - k < 8\n").mask == b("and", b("le", i(0), d, "bool"), b("lt", d, i(8), "bool"), "bool")


@pytest.mark.parametrize("text, expected", [
    ("-score ** 2", Unary(type="float", op="neg", operand=b("pow", Score(), i(2), "float"))),
    ("-score * 2", b("mul", Unary(type="float", op="neg", operand=Score()), i(2), "float")),
    ("+score ** 2", b("pow", Score(), i(2), "float")),
    ("- - score", Unary(type="float", op="neg", operand=Unary(type="float", op="neg", operand=Score()))),
    ("score ** -2", b("pow", Score(), Unary(type="int", op="neg", operand=i(2)), "float")),
    ("2 ** 3 ** 2 * score", b("mul", b("pow", i(2), b("pow", i(3), i(2)), "float"), Score(), "float")),
    ("score - 1 - 2", b("sub", b("sub", Score(), i(1), "float"), i(2), "float")),
    ("score + 2 * 3", b("add", Score(), b("mul", i(2), i(3)), "float")),
])
def test_operator_precedence(text, expected):
    assert body(f"score: {text}\n").score == expected


def test_logical_precedence():
    lt, gt, eq = b("lt", Q, K, "bool"), b("gt", Q, K, "bool"), b("eq", Q, K, "bool")
    assert body("mask: q < k or q > k and q == k\n").mask == b("or", lt, b("and", gt, eq, "bool"), "bool")
    assert body("mask: not q < k and q > k\n").mask == b("and", Unary(type="bool", op="not", operand=lt), gt, "bool")


def test_types_and_promotion():
    assert body("score: q - k\n").score.type == "int"
    assert body("score: (q - k) / 2\n").score.type == "float"
    assert body("score: (q - k) // 2\n").score.type == "int"
    assert body("score: (q - k) ** 2\n").score.type == "int"
    assert body("score: (q - k) ** -1\n").score.type == "float"
    assert body("score: max(q, 1.5)\n").score.type == "float"
    assert body("score: floor(score)\n").score.type == "int"
    assert body("mask: where(q > k, true, k < 3)\n").mask.type == "bool"
    assert body("score: where(q > k, score, -inf)\n").score.args[2] == Unary(type="float", op="neg", operand=f(math.inf))


@pytest.mark.parametrize("text, value, type", [
    ("-3", -3, "int"), ("-2.5", -2.5, "float"), ("- 7", -7, "int"), ("1e3", 1000.0, "float"),
    ("0.5", 0.5, "float"), (".5", 0.5, "float"), ("4.", 4.0, "float"), ("12", 12, "int"),
])
def test_param_values(text, value, type):
    (param,) = body(f"param p = {text}\n").params
    assert param == ParamDecl(name="p", type=type, value=value)
    assert isinstance(param.value, int if type == "int" else float)


def test_scalar_input_is_used_bare():
    spec = body("input x: f32[]\nscore: score * x\n")
    assert spec.inputs == (InputDecl(name="x", dtype="f32", dims=()),)
    assert spec.score == b("mul", Score(), Load(type="float", input="x", index=()), "float")


def test_input_declarations():
    spec = body("input a: bf16[B, H, HKV, Q_LEN, KV_LEN] learnable\ninput m: bool[*, 3]\ninput n: i64[4]\n")
    assert spec.inputs == (
        InputDecl(name="a", dtype="bf16", dims=("B", "H", "HKV", "Q_LEN", "KV_LEN"), learnable=True),
        InputDecl(name="m", dtype="bool", dims=("*", 3)),
        InputDecl(name="n", dtype="i64", dims=(4,)),
    )
    assert [d.name for d in spec.learnable_inputs] == ["a"]


def test_scale_may_use_d_and_params():
    spec = body("param t = 2.0\nscale: 1 / (t * sqrt(D))\n")
    assert spec.scale.type == "float"


def test_line_continuation_and_crlf():
    spec = parse_spec("attention t\r\nparam w = 4\r\nmask: causal and \\\n  q - k < w\r\n")
    assert spec.mask == body("param w = 4\nmask: causal and q - k < w\n").mask


# --- params, fingerprints, JSON ------------------------------------------------------------------

def test_with_params_overrides_like_dash_d():
    spec = parse_spec(DSL_EXAMPLES["gemma2_local"])
    assert with_params(spec, None) is spec and with_params(spec, {}) is spec
    wider = with_params(spec, {"window": 512})
    assert wider.param("window") == ParamDecl(name="window", type="int", value=512)
    assert spec.param("window").value == 4096  # the original is untouched
    assert with_params(wider, {"window": 4096.0}).param("window").value == 4096  # an integral float is an int
    assert isinstance(with_params(wider, {"window": 4096.0}).param("window").value, int)
    capped = with_params(body("param cap = 50.0\n"), {"cap": 30})
    assert capped.param("cap") == ParamDecl(name="cap", type="float", value=30.0)


@pytest.mark.parametrize("overrides, fragment", [
    ({"windw": 3}, "unknown param 'windw'"),
    ({"window": 1.5}, "'window' is an int param and must be an integer, got 1.5"),
    ({"window": "8"}, "'window' must be a number, got '8'"),
    ({"window": True}, "'window' must be a number, got True"),
])
def test_bad_param_overrides_name_the_param(overrides, fragment):
    spec = parse_spec(DSL_EXAMPLES["sliding_window"])
    with pytest.raises(ArgumentError) as err:
        with_params(spec, overrides)
    assert fragment in str(err.value)
    assert "window" in str(err.value)  # the declared params are listed for an unknown one, too


def test_fingerprint_is_stable_and_tracks_meaning():
    text = DSL_EXAMPLES["gemma2_local"]
    a, b_ = parse_spec(text), parse_spec(text)
    assert a.fingerprint() == b_.fingerprint()
    assert len(a.fingerprint()) == 16
    # Comments, layout and file name are not meaning.
    relaid = parse_spec("# same spec\nattention gemma2_local\nscore: softcap(score,50.0)\n"
                        "param window=4096\nmask:causal and q-k<window  # note\n", "other.attn")
    assert relaid.fingerprint() == a.fingerprint()
    assert with_params(a, {"window": 512}).fingerprint() != a.fingerprint()
    assert with_params(a, {"window": 4096}).fingerprint() == a.fingerprint()
    assert parse_spec(text.replace("50.0", "30.0")).fingerprint() != a.fingerprint()


@pytest.mark.parametrize("text", [p.read_text() for p in SPECS] + list(DSL_EXAMPLES.values()) + [
    "attention t\nparam w = -3\ninput x: f32[]\nscore: where(q >= k, score * x, -inf)\nmask: 0 <= q - k < w\n",
])
def test_json_round_trip(text):
    spec = parse_spec(text)
    assert Spec.model_validate_json(spec.model_dump_json()) == spec


def test_json_round_trip_keeps_inf():
    spec = body("score: where(q >= k, score, -inf)\n")
    back = Spec.model_validate_json(spec.model_dump_json())
    assert back == spec and back.fingerprint() == spec.fingerprint()
    assert back.score.args[2].operand.value == math.inf


def test_spec_is_frozen():
    spec = body("mask: causal\n")
    with pytest.raises(Exception):
        spec.name = "other"


# --- errors --------------------------------------------------------------------------------------
# (id, source, line, column, offending text, message fragment). The offending text is what the
# error must point at: it is checked against the source at line:col and against the caret line.
# An empty offending text means "just past the end of the line".

BAD_SPECS = [
    ("unknown_name_did_you_mean", "attention sliding\nparam window = 1024\nmask: causal and q - k < windw\n",
     3, 26, "windw", "unknown name 'windw' (did you mean 'window'?)"),
    ("unknown_name_no_hint", "attention t\nmask: q < zzzzzz\n", 2, 11, "zzzzzz", "unknown name 'zzzzzz'"),
    ("unknown_function", "attention t\nscore: tanhh(score)\n", 2, 8, "tanhh",
     "unknown function 'tanhh' (did you mean 'tanh'?)"),
    ("function_used_as_name", "attention t\nscore: score + tanh\n", 2, 16, "tanh", "'tanh' is a function"),
    ("wrong_arity", "attention t\nscore: clamp(score, 1.0)\n", 2, 8, "clamp(score, 1.0)",
     "clamp() takes 3 argument(s), got 2"),
    ("no_arguments", "attention t\nscore: score + exp()\n", 2, 16, "exp()", "exp() takes 1 argument(s), got 0"),
    ("mask_not_boolean", "attention t\nmask: q - k\n", 2, 7, "q - k", "mask must be a boolean expression, got int"),
    ("score_not_number", "attention t\nscore: q > k\n", 2, 8, "q > k", "score must be a number, got bool"),
    ("score_in_mask", "attention t\nmask: causal and score > 0\n", 2, 18, "score", "'mask' may not use 'score'"),
    ("score_in_scale", "attention t\nscale: 0.5 * score\n", 2, 14, "score", "'scale' may not use 'score'"),
    ("index_var_in_scale", "attention t\nscale: 1.0 / q\n", 2, 14, "q",
     "scale may use only D, params and numbers, got 'q'"),
    ("input_in_scale", "attention t\ninput s: f32[H]\nscale: s[h]\n", 3, 8, "s",
     "scale may use only D, params and numbers, got 's'"),
    ("too_few_indices", "attention t\ninput t: f32[H, 4]\nscore: score + t[h]\n", 3, 16, "t[h]",
     "input 't' has 2 dim(s), indexed with 1"),
    ("too_many_indices", "attention t\ninput t: f32[H]\nscore: score + t[h, q]\n", 3, 16, "t[h, q]",
     "input 't' has 1 dim(s), indexed with 2"),
    ("float_index", "attention t\ninput t: f32[H]\nscore: score + t[1.5]\n", 3, 18, "1.5",
     "an index of 't' must be an int, got float"),
    ("float_expression_index", "attention t\ninput t: f32[H]\nscore: score + t[h / 2]\n", 3, 18, "h / 2",
     "an index of 't' must be an int, got float"),
    ("indexing_a_param", "attention t\nparam w = 3\nscore: score + w[h]\n", 3, 16, "w",
     "only inputs can be indexed, and 'w' is not an input"),
    ("bare_non_scalar_input", "attention t\ninput t: f32[H]\nscore: score + t\n", 3, 16, "t",
     "input 't' has 1 dim(s): index it as t[...]"),
    ("scalar_input_indexed", "attention t\ninput t: f32[]\nscore: score + t[h]\n", 3, 16, "t[h]",
     "input 't' has 0 dim(s), indexed with 1"),
    ("learnable_int_input", "attention t\ninput t: i32[H] learnable\n", 2, 17, "learnable",
     "a learnable input must have a float dtype (f32, f16, bf16), got 'i32'"),
    ("bad_dtype", "attention t\ninput t: f64[H]\n", 2, 10, "f64",
     "dtype must be one of f32, f16, bf16, i32, i64, bool, got 'f64'"),
    ("bad_dim_name", "attention t\ninput t: f32[H, N]\n", 2, 17, "N",
     "a dim must be one of B, H, HKV, Q_LEN, KV_LEN, an integer or '*', got 'N'"),
    ("zero_dim", "attention t\ninput t: f32[H, 0]\n", 2, 17, "0", "a dim must be a positive integer, got '0'"),
    ("float_dim", "attention t\ninput t: f32[2.5]\n", 2, 14, "2.5", "a dim must be a positive integer, got '2.5'"),
    ("duplicate_mask", "attention t\nmask: causal\nscore: score\nmask: q == k\n", 4, 1, "mask: q == k",
     "duplicate 'mask:' (the first is at line 2)"),
    ("duplicate_score", "attention t\nscore: score\n\n  score: score * 2\n", 4, 3, "score: score * 2",
     "duplicate 'score:' (the first is at line 2)"),
    ("duplicate_declaration", "attention t\nparam w = 3\ninput w: f32[H]\n", 3, 7, "w", "'w' is declared twice"),
    ("reserved_name_param", "attention t\nparam causal = 3\n", 2, 7, "causal", "'causal' is a reserved name"),
    ("reserved_index_var", "attention t\nparam q = 3\n", 2, 7, "q", "'q' is a reserved name"),
    ("reserved_function_input", "attention t\ninput exp: f32[H]\n", 2, 7, "exp", "'exp' is a reserved name"),
    ("and_on_ints", "attention t\nmask: causal and q - k\n", 2, 18, "q - k",
     "the operands of 'and' must be booleans, got int"),
    ("not_on_int", "attention t\nmask: not q\n", 2, 11, "q", "the operand of 'not' must be a boolean, got int"),
    ("arithmetic_on_bools", "attention t\nmask: causal + 1 > 0\n", 2, 7, "causal",
     "the operands of '+' must be numbers, got bool"),
    ("negating_a_bool", "attention t\nmask: -(q > k)\n", 2, 9, "q > k",
     "the operand of unary '-' must be a number, got bool"),
    ("comparing_bools", "attention t\nmask: 0 <= q - k < true\n", 2, 20, "true",
     "the operands of '<' must be numbers, got bool"),
    ("function_of_bool", "attention t\nscore: exp(q > k)\n", 2, 12, "q > k",
     "the arguments of exp() must be numbers, got bool"),
    ("where_non_bool_condition", "attention t\nscore: where(q - k, score, 0.0)\n", 2, 14, "q - k",
     "the condition of where() must be a boolean, got int"),
    ("where_mixed_branches", "attention t\nscore: where(q > k, score, q > 0)\n", 2, 28, "q > 0",
     "the branches of where() must both be numbers or both booleans, got float and bool"),
    ("unexpected_character", "attention t\nmask: q $ k\n", 2, 9, "$", "unexpected character '$'"),
    ("unexpected_unicode", "attention t\nmask: q ≥ k\n", 2, 9, "≥", "unexpected character '≥'"),
    ("c_not", "attention t\nmask: !(q < k)\n", 2, 7, "!", "unexpected '!'; use 'not'"),
    ("c_and", "attention t\nmask: causal && q - k < 4\n", 2, 14, "&&", "unexpected '&&'; use 'and'"),
    ("c_or", "attention t\nmask: causal || q == k\n", 2, 14, "||", "unexpected '||'; use 'or'"),
    ("bitand_of_float", "attention t\nscore: score & 3\n", 2, 8, "score",
     "the operands of '&' must both be ints or both booleans, got float and int"),
    ("bitor_of_int_and_bool", "attention t\nmask: q | (k < 3)\n", 2, 12, "k < 3",
     "the operands of '|' must both be ints or both booleans, got int and bool"),
    ("shift_of_bools", "attention t\nmask: (q < 1) << 1 > 0\n", 2, 8, "q < 1",
     "the operands of '<<' must both be ints, got bool and int"),
    ("invert_of_float", "attention t\nscore: ~score\n", 2, 9, "score",
     "the operand of '~' must be an int or a boolean, got float"),
    ("negative_shift", "attention t\nmask: q >> -1 > 0\n", 2, 12, "-1",
     "the count of '>>' must not be negative, got '-1', which is -1"),
    ("shift_past_int64", "attention t\nparam n = 64\nmask: q << n > k\n", 3, 12, "n",
     "the count of '<<' must be at most 63 (an int is 64 bits wide), got 'n', which is 64"),
    ("unbounded_shift_count", "attention t\nmask: q >> k - 2 > 0\n", 2, 12, "k - 2",
     "the count of '>>' must lie in 0..63 for every b, h, q, k and input value, got 'k - 2' with values in "
     "[-2, 2147483644]; clamp it, e.g. 'clamp(k - 2, 0, 63)'"),
    ("shift_overflows_int64", "attention t\nmask: q << 62 > k\n", 2, 7, "q << 62", "must fit in int64"),
    ("c_conditional", "attention t\nscore: q > k ? score : 0.0\n", 2, 14, "?",
     "unexpected '?'; use where(cond, a, b)"),
    ("python_conditional", "attention t\nscore: score if q > k else 0.0\n", 2, 14, "if",
     "unexpected 'if'; use where(cond, a, b)"),
    ("if_statement", "attention t\nmask: if q > k\n", 2, 7, "if", "unexpected 'if'; use where(cond, a, b)"),
    ("unexpected_token", "attention t\nmask: q < < k\n", 2, 11, "<", "unexpected '<'; expected '(', '+', '-'"),
    ("two_names_in_a_row", "attention t\nmask: q k\n", 2, 9, "k", "unexpected 'k'; expected"),
    ("extra_close_bracket", "attention t\nmask: q < k)\n", 2, 12, ")", "unexpected ')'; expected a new line"),
    ("mismatched_bracket", "attention t\nmask: (q < k]\n", 2, 13, "]", "unexpected ']'; expected ')'"),
    ("expression_as_param", "attention t\nparam w = 3 + 4\n", 2, 13, "+", "unexpected '+'"),
    ("missing_colon", "attention t\nmask causal\n", 2, 6, "causal", "unexpected 'causal'; expected ':'"),
    ("line_ends_early", "attention t\nmask: q <\n", 2, 10, "", "unexpected end of line"),
    ("line_ends_before_comment", "attention t\nscore: score * # oops\n", 2, 22, "", "unexpected end of line"),
    ("unclosed_paren_at_eof", "attention t\nmask: (q < k\n\n# done\n", 2, 7, "(",
     "'(' is never closed (unexpected end of file; expected ')')"),
    ("unclosed_paren_no_newline", "attention t\nmask: (q < k", 2, 7, "(", "'(' is never closed"),
    ("unclosed_index_at_eof", "attention t\ninput t: f32[H]\nscore: score + t[h", 3, 17, "[",
     "'[' is never closed (unexpected end of file; expected ',', ']')"),
    ("unclosed_inner_bracket", "attention t\nscore: min(score, (score + 1)\n", 2, 11, "(", "'(' is never closed"),
    ("unclosed_then_next_item", "attention t\nmask: (q < k\nscore: score\n", 3, 1, "score",
     "unexpected 'score'; expected"),
    ("unexpected_end_of_file", "attention t\nmask: q <", 2, 10, "", "unexpected end of file"),
    ("missing_header", "# no header\nmask: causal\n", 2, 1, "mask", "unexpected 'mask'; expected 'attention'"),
    ("header_without_name", "attention\nmask: causal\n", 1, 10, "", "unexpected end of line; expected a name"),
    ("second_header", "attention t\nattention u\n", 2, 1, "attention", "unexpected 'attention'"),
    ("error_on_a_continued_line", "attention t\nparam window = 8\nmask: (causal and\n      q - k < windw)\n",
     4, 15, "windw", "unknown name 'windw' (did you mean 'window'?)"),
    ("error_on_an_indented_line", "attention t\n\tmask: q < windw\n", 2, 12, "windw", "unknown name 'windw'"),
    ("error_with_crlf", "attention t\r\nparam window = 3\r\nmask: q < windw\r\n", 3, 11, "windw",
     "did you mean 'window'?"),
]


def caret_target(err: attngen.SpecError) -> tuple[str, str]:
    """The displayed source line and the text the caret run sits under."""
    lines = str(err).splitlines()
    assert len(lines) == 3, str(err)
    assert lines[1].startswith("    ") and lines[2].startswith("    ")
    shown, caret = lines[1][4:], lines[2][4:]
    start = caret.index("^")
    assert set(caret[start:]) == {"^"}, caret
    assert caret[:start] == " " * start
    return shown, shown[start:len(caret)]


@pytest.mark.parametrize("source, line, column, text, fragment",
                         [case[1:] for case in BAD_SPECS], ids=[case[0] for case in BAD_SPECS])
def test_bad_spec_is_reported_at_the_offending_text(source, line, column, text, fragment):
    with pytest.raises(attngen.SpecError) as info:
        parse_spec(source, "bad.attn")
    err = info.value
    message = str(err)
    head = message.splitlines()[0]
    assert head.startswith(f"bad.attn:{line}:{column}: "), message
    assert fragment in head, message
    assert "__anon" not in message.lower(), message
    assert (err.position.line, err.position.column) == (line, column)

    # The position really is the offending text in the source ...
    source_line = source.splitlines()[line - 1]
    if text:
        assert source_line[column - 1:column - 1 + len(text)] == text
    else:
        assert column == len(source_line.split("#")[0].rstrip()) + 1 or column == len(source_line) + 1
    # ... and the caret run sits exactly under it.
    shown, underlined = caret_target(err)
    assert shown == source_line.lstrip()
    if text:
        assert underlined == text, message
    else:
        assert underlined == "" and len(message.splitlines()[2]) - 4 == len(shown) + 1, message


def test_unclosed_bracket_before_next_item_names_the_bracket():
    with pytest.raises(attngen.SpecError) as info:
        parse_spec("attention t\nmask: (q < k\nscore: score\n")
    assert "(the '(' at line 2, column 7 is still open)" in str(info.value)


def test_expected_tokens_are_shown_as_text():
    with pytest.raises(attngen.SpecError) as info:
        parse_spec("attention t\nmask: q k\n")
    message = str(info.value)
    assert "'//'" in message and "'**'" in message and "'and'" in message
    # Outside brackets, a closing bracket or a comma is not something that could come next.
    assert "')'" not in message and "','" not in message


def test_empty_file_is_an_error_at_line_one():
    with pytest.raises(attngen.SpecError) as info:
        parse_spec("", "empty.attn")
    assert str(info.value).startswith("empty.attn:1:1: unexpected end of file; expected 'attention'")


def test_error_without_filename_uses_a_placeholder():
    with pytest.raises(attngen.SpecError) as info:
        parse_spec("attention t\nmask: windw\n")
    assert str(info.value).startswith("<spec>:2:7: unknown name 'windw'")


def test_error_spanning_lines_gets_one_caret():
    with pytest.raises(attngen.SpecError) as info:
        parse_spec("attention t\nscore: min(\n    score)\n", "m.attn")
    err = info.value
    assert str(err).splitlines()[0] == ("m.attn:2:8: min() takes 2 argument(s), or one input read with ':' over the dims it "
                                          "reduces (as in min(x[b, :])), got 1 without ':'")
    assert caret_target(err) == ("score: min(", "m")


# --- untrusted text: its size, its encoding, flat runs of one operator ---------------------------

def _parse_seconds(n_params: int) -> float:
    text = "attention t\n" + "".join(f"param p{n} = {n}\n" for n in range(n_params)) + "score: score + p0\n"
    start = time.perf_counter()
    parse_spec(text)
    return time.perf_counter() - start


def test_parsing_time_grows_linearly_with_the_number_of_items():
    # 8x the items takes about 8x the time; it took 64x when each item was compared with all others.
    assert _parse_seconds(8000) < 24 * min(_parse_seconds(1000) for _ in range(2))


def test_spec_text_beyond_the_size_limit_is_an_error_where_the_limit_is_passed():
    text = "attention t\n" + "# padding\n" * (MAX_SOURCE_CHARS // 10) + "mask: causal\n"
    with pytest.raises(attngen.SpecError) as info:
        parse_spec(text, "big.attn")
    err = info.value
    assert err.message == f"spec text must be at most {MAX_SOURCE_CHARS} characters, got {len(text)}"
    lines = text[:MAX_SOURCE_CHARS].split("\n")
    assert (err.position.line, err.position.column) == (len(lines), len(lines[-1]) + 1)


def test_a_byte_order_mark_is_accepted(tmp_path):
    plain = parse_spec("attention t\nmask: causal\n")
    assert parse_spec("\ufeffattention t\nmask: causal\n") == plain
    path = tmp_path / "bom.attn"
    path.write_bytes(b"\xef\xbb\xbfattention t\nmask: causal\n")
    assert attngen.load_spec(path)[0] == plain


def test_a_spec_file_that_is_not_utf8_is_an_error_naming_the_file_and_the_byte(tmp_path):
    path = tmp_path / "latin1.attn"
    path.write_bytes("attention t\n# café\nmask: causal\n".encode("latin-1"))
    with pytest.raises(ArgumentError) as info:
        attngen.load_spec(path)
    assert str(info.value) == (f"spec file {str(path)!r} must be UTF-8 text, got byte 0xe9 at line 2, column 6 "
                               f"(byte offset 17)")


def _depth(expr) -> int:
    return 1 + max((_depth(child) for child in children(expr)), default=0)


# 1000 operands nest 10 deep (2**10 >= 1000) over their own depth: 1 for a name, 2 for a comparison.
@pytest.mark.parametrize("run, depth", [
    (" + score" * 999, 11), (" - 0.5 + 1.5" * 500, 11), (" * 1.0" * 999, 11), (" and q > k" * 999, 12), (" or q > k" * 999, 12),
])
def test_a_long_run_of_one_operator_nests_as_a_balanced_tree(run, depth):
    item = "score: score" if "q >" not in run else "mask: q > k"
    spec = parse_spec(f"attention t\n{item}{run}\n")
    assert _depth(spec.score or spec.mask) == depth
    assert parse_spec(to_source(spec)) == spec  # printed with brackets, it reads back as the same tree


def test_a_long_sum_keeps_its_value_and_its_signs():
    # The scale runs on the host (printer.host_scale): the balanced sum must equal the text's value.
    spec = parse_spec("attention t\nscale: (D" + " - 1 + D - D" * 300 + " + 300) / D + 0.5" + " - D / 4 + D / 4" * 400 + "\n")
    assert [host_scale(spec.scale, {})(d) for d in (1, 7, 256)] == [1.5, 1.5, 1.5]


def test_a_long_run_mixing_ints_and_floats_keeps_the_order_written():
    # Left to right, an int after a float is added as a float: grouping floor(score * 3) with ceil(score * 2)
    # would make an int difference of two unbounded ints, which int64 cannot hold.
    terms = " + floor(score * 3) - ceil(score * 2) + 0.5" * 6
    spec = parse_spec(f"attention t\nscore: score{terms}\n")
    assert _depth(spec.score) == 19 + 2  # a left-leaning chain of 19 operands, over floor(score * 3)'s depth
    too_long = " + q + 0.5" * 60
    with pytest.raises(SpecError, match=r"2:8: expression nests too deeply \(121 levels; at most 100\): a run of"):
        parse_spec(f"attention t\nscore: score{too_long}\n")


def test_a_short_run_keeps_the_order_written():
    x, y, z = (Load(type="float", input=n, index=()) for n in "xyz")
    spec = body("input x: f32[]\ninput y: f32[]\ninput z: f32[]\nscore: x - y + z\n")
    assert spec.score == b("add", b("sub", x, y, "float"), z, "float")


# --- float constants are float32 numbers, and the scale has a range -------------------------------

@pytest.mark.parametrize("text, where, culprit", [
    ("score: softcap(score, 1e39)", "2:23", "'1e+39'"),
    ("score: score * 1e39 * 1e-39", "2:16", "'1e+39'"),
    ("score: score + 1e-46 * 1e46 * k", "2:24", "'1e+46'"),
    ("score: score + 1e20 * 1e20", "2:16", "'1e+20 * 1e+20'"),  # each finite, their product not
    ("score: score + exp(100.0)", "2:16", "'exp(100.0)'"),
    ("mask: q * 1.0 < -3e38 * 2", "2:17", "'-3e+38 * 2'"),
    ("param cap = 1e39\nscore: softcap(score, cap)", "3:23", "'cap'"),
])
def test_a_float_constant_beyond_float32_is_a_positioned_error(text, where, culprit):
    with pytest.raises(attngen.SpecError) as info:
        parse_spec(f"attention t\n{text}\n", "f.attn")
    first = str(info.value).splitlines()[0]
    assert first.startswith(f"f.attn:{where}: {culprit} must be finite in float32") and ", got " in first


@pytest.mark.parametrize("text", [
    "score: score * 3.4e38", "score: softcap(score, inf)", "score: score + inf * 2.0", "mask: q * 1.0 > -inf",
    "score: score + 1e-46 * k",  # 0 in float32: small, not infinite
])
def test_float32_constants_and_inf_are_accepted(text):
    parse_spec(f"attention t\n{text}\n")


def test_an_override_beyond_float32_names_the_param():
    with pytest.raises(ArgumentError, match=r"params: 'cap' = 1e\+39 makes 'cap' wrong: .*finite in float32"):
        attngen.build(Path(__file__).parent.parent / "specs" / "gemma2_local.attn", params={"cap": 1e39})


def test_a_spec_built_in_python_gets_the_float32_check():
    spec = Spec(name="t", score=Binary(type="float", op="mul", left=Score(), right=Const(type="float", value=1e39)))
    with pytest.raises(ArgumentError, match="'1e\\+39' must be finite in float32"):
        attngen.compile_source(spec)


@pytest.mark.parametrize("text, got", [
    ("scale: 1e30", "got 1e+30 at D=1"),
    ("scale: -1e30", "got -1e+30 at D=1"),
    ("scale: 40000.0 / sqrt(D)", "got 40000 at D=1"),
    ("scale: 0.5 * D ** 2 + 1", "got 32769 at D=256"),
])
def test_a_scale_beyond_two_to_the_fifteen_is_a_positioned_error(text, got):
    with pytest.raises(attngen.SpecError) as info:
        parse_spec(f"attention t\n{text}\n", "s.attn")
    first = str(info.value).splitlines()[0]
    assert first.startswith("s.attn:2:8: scale must be within [-2**15, 2**15] for every head dim D in 1..256")
    assert first.endswith(got)


@pytest.mark.parametrize("scale", ["32768.0", "-32768.0", "0.0", "1e-300", "0.5 * D ** 2"])
def test_a_scale_within_two_to_the_fifteen_is_accepted(scale):
    parse_spec(f"attention t\nscale: {scale}\n")


def test_a_scale_override_beyond_the_range_names_the_param():
    spec = parse_spec("attention t\nparam s = 1.0\nscale: s / sqrt(D)\n")
    with pytest.raises(ArgumentError, match=r"params: 's' = 1e\+30 makes 's / sqrt\(D\)' wrong: scale must be within"):
        with_params(spec, {"s": 1e30})
