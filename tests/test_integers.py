"""Exact integer arithmetic: the kernels agree with the reference on every int a spec computes, or the
spec is rejected (positioned), or the module refuses the call (lengths past what int64 holds).

Kernel tests run in Triton's interpreter on tiny shapes; one compiles the generated kernels for sm_90
on the CPU, since the interpreter does not type ints as a GPU compile does.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import attngen
from attngen import testing
from attngen.analysis import spans
from attngen import intervals
from attngen.analysis import integers
from attngen.api import parse_spec, with_params
from attngen.errors import ArgumentError, SpecError
from attngen.frontend.lower import MAX_DEPTH

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _check(text: str, n: int = 24, inputs=None, grads: bool = True, B: int = 2):
    attn = attngen.build(text)
    q, k, v = testing.random_qkv(B, 1, 1, n, n, 16, 16, torch.float32, device=DEVICE)
    inputs = {name: t.to(DEVICE) for name, t in (inputs or {}).items()}
    testing.check_against_reference(attn.spec, attn, q, k, v, inputs, grads=grads)
    return attn


def _error(text: str) -> SpecError:
    with pytest.raises(SpecError) as err:
        parse_spec(text)
    return err.value


# --- 1. widths: int32 where it provably fits, int64 otherwise ------------------------------------

def test_a_quartic_distance_is_computed_in_int64():
    # (q - k) ** 4 passes 2**31 from |q - k| = 216 on: in int32 the bias was off by 0.1.
    _check("attention t\nscore: score - 1e-10 * (q - k) ** 4\n", n=256, grads=False, B=1)


def test_int_literals_beyond_int32_work_and_beyond_int64_are_rejected():
    _check("attention t\nmask: k < 3000000000 and q + 3000000000 >= k + 3000000000\n"
           "score: score + (k - 3000000000) * 1e-10\n", n=20)
    err = _error("attention t\nmask: k < 9223372036854775808\n")
    assert (err.position.line, err.position.column) == (2, 11)
    assert "an int literal must fit in int64" in err.message


def test_products_of_i32_inputs_are_exact():
    text = "attention t\ninput x: i32[B]\nmask: x[b] * x[b] > q * 1000000\nscore: score + x[b] * k % 7\n"
    x = torch.tensor([-2 ** 31, 46341], dtype=torch.int32)  # both squares pass 2**31
    _check(text, n=20, inputs={"x": x})


def test_lengths_past_what_int64_holds_are_refused_at_call_time():
    attn = attngen.build("attention t\nscore: score + (q - k) ** 5 * 1e-20\n")
    limit = 6209  # 6208 ** 5 < 2**63 <= 6209 ** 5
    assert attn.module.FACTS.max_length == limit
    q, k, v = testing.random_qkv(1, 1, 1, 8, limit + 1, 16, 16, torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match=rf"Q_LEN and KV_LEN must be at most {limit} \(beyond it "
                                         r"'\(q - k\) \*\* 5' overflows int64\), got 8 and 6210"):
        attn(q, k, v)


def test_a_spec_that_overflows_int64_even_at_short_lengths_is_rejected():
    err = _error("attention t\nscore: score + (q - k) ** 8 * 1e-30\n")
    assert (err.position.line, err.position.column, err.position.end_column) == (2, 16, 28)
    assert "'(q - k) ** 8' must fit in int64 at lengths up to 1024 (it overflows beyond length 235)" in err.message
    err = _error("attention t\ninput lens: i64[B]\nmask: k < lens[b] + 1\n")
    assert (err.position.line, err.position.column) == (3, 11)
    assert "'lens[b] + 1' must fit in int64 whatever the call's inputs and sizes" in err.message


def test_the_width_rule_uses_the_declared_dtype():
    spec = parse_spec("attention t\ninput a: i32[B]\ninput c: i64[B]\nmask: a[b] + 1 > k and c[b] > k\n")
    ranges = intervals.Ranges(intervals.box(spec, intervals.MAX_LENGTH))
    a_plus_1 = spec.mask.left.left
    assert ranges.value(a_plus_1).hi == 2 ** 31 and ranges.wide(a_plus_1)
    assert not ranges.wide(spec.mask.left.right)  # k < 2**31


# --- 2. loop bounds: int64, and saturated where an i64 input could wrap them ----------------------

@pytest.mark.parametrize("mask", ["k < prefix[b] or causal", "k >= prefix[b] and causal", "q < prefix[b]",
                                  "k <= prefix[b] - 1 or q - k < 3"])
def test_loop_bounds_from_extreme_i32_inputs(mask):
    prefix = torch.tensor([-2 ** 31, 2 ** 31 - 1, -2 ** 31 + 1, 5], dtype=torch.int32)
    _check(f"attention t\ninput prefix: i32[B]\nmask: {mask}\n", n=20, inputs={"prefix": prefix}, B=4)


@pytest.mark.parametrize("mask", ["k < lens[b] or causal", "k >= lens[b]", "q <= lens[b] and k + 3 > lens[b]",
                                  "k // 4 < lens[b]"])
def test_loop_bounds_from_extreme_i64_inputs(mask):
    lens = torch.tensor([-2 ** 63, 2 ** 63 - 1, -2 ** 62, 7], dtype=torch.int64)
    attn = _check(f"attention t\ninput lens: i64[B]\nmask: {mask}\n", n=20, inputs={"lens": lens}, B=4)
    assert not attn.module.FACTS.tile_table  # still closed-form spans: the loaded values were saturated


def test_a_bound_that_cannot_be_made_exact_is_widened():
    # c[b] - a[b] - 1 may wrap int64 and neither input can be saturated alone: the span of keys is
    # left unbounded (every tile visited, and masked), which stays exact.
    text = "attention t\ninput a: i64[B]\ninput c: i64[B]\nmask: a[b] < c[b]\n"
    spec = parse_spec(text)
    ranges = intervals.Ranges(intervals.box(spec, intervals.MAX_LENGTH))
    reg = spans.region(spec.mask, "k", {})
    assert integers.exact_span(reg.visit, ranges, intervals.MAX_LENGTH, inner=False) == spans.Span(None, None)
    assert integers.exact_span(reg.full, ranges, intervals.MAX_LENGTH, inner=True) is None
    a = torch.tensor([-2 ** 63, 2 ** 63 - 1, 0, 3], dtype=torch.int64)
    c = torch.tensor([2 ** 63 - 1, -2 ** 63, 0, 4], dtype=torch.int64)
    _check(text, n=20, inputs={"a": a, "c": c}, B=4)


# --- 3. int powers --------------------------------------------------------------------------------

def test_int_powers_are_exact_by_repeated_squaring():
    # (k % 9) ** 13 reaches 8 ** 13 > 2**31; q ** c is an int power the IR types float (a param exponent).
    _check("attention t\nparam c = 5\nscore: score + ((q - k) ** 5 + q ** c) * 1e-6 + (k % 9) ** 13 % 1000 * 1e-3\n"
           "mask: (q - k) ** 0 == 1\n", n=20)


def test_an_int_power_needs_a_constant_exponent():
    err = _error("attention t\nscore: score + q ** (k % 3)\n")
    assert (err.position.line, err.position.column) == (2, 22)
    assert "the exponent of an int '**' must be a constant" in err.message


# --- 4. zero divisors and the scale ---------------------------------------------------------------

@pytest.mark.parametrize("text, column, op", [
    ("param c = 0\nmask: q // c == 0\n", 7, "//"),
    ("param c = 0\nmask: q % c == 0\n", 7, "%"),
    ("mask: q % (3 - 3) == k\n", 7, "%"),
    ("score: score / 0\n", 8, "/"),
    ("scale: 1 / 0\n", 8, "/"),
])
def test_dividing_by_a_constant_zero_is_a_compile_time_error(text, column, op):
    err = _error(f"attention t\n{text}")
    assert (err.position.line, err.position.column) == (text.count("\n") + 1, column)
    assert f"the divisor of '{op}' must not be a constant zero" in err.message


@pytest.mark.parametrize("text, column, shown", [
    ("mask: q // (k - 3) >= 0\n", 13, "'k - 3' with values in [-3, 2147483643]"),
    ("mask: q // (k - 5000) >= 0\n", 13, "'k - 5000'"),  # zero only past length 5000: still refused
    ("input c: i32[B]\nmask: q % c[b] == k % c[b]\n", 11, "'c[b]' with values in [-2147483648, 2147483647]"),
    ("score: score + q // (k - q)\n", 22, "'k - q'"),
])
def test_an_int_divisor_that_may_be_zero_is_a_compile_time_error(text, column, shown):
    # The reference raises on an int division by zero; a kernel would return some number.
    err = _error(f"attention t\n{text}")
    assert (err.position.line, err.position.column) == (text.count("\n") + 1, column)
    assert "must be nonzero for every b, h, q, k and input value, got " + shown in err.message
    assert "e.g. 'max(" in err.message


def test_an_int_divisor_bounded_away_from_zero_is_exact():
    _check("attention t\nmask: q // max(k - 3, 1) >= k // 5\n")
    _check("attention t\nscore: score + (q - k) % (q + 1) - 1.5 * (q // max(k, 2))\n")


def test_an_int_to_a_negative_or_input_power_is_a_float_power_in_both():
    # 2 ** -1 is 0.5, as in Python (the reference once took torch's int power, 0).
    attn = _check("attention t\nscore: score + 2 ** -1 + (q + 1) ** (-2)\n")
    assert attn.spec.score.type == "float"
    _check("attention t\ninput e: i32[B]\nscore: score + (q - k + 30) ** e[b] * 1e-3 + 2.0 ** e[b]\n",
           inputs={"e": torch.tensor([2, -1], dtype=torch.int32)})


def test_a_scale_that_is_not_finite_for_some_head_dim_is_rejected():
    err = _error("attention t\nscale: 1.0 / (D - 4)\n")
    assert (err.position.line, err.position.column) == (2, 8)
    assert "scale must be a finite number for every head dim D in 1..256, got ZeroDivisionError" in err.message
    assert "at D=4" in err.message
    assert "got inf at D=1" in _error("attention t\nscale: 1e300 * 1e300 / D\n").message
    assert "got OverflowError (math range error) at D=71" in _error("attention t\nscale: exp(D * 10.0)\n").message
    assert "'D ** 9' must fit in int64 for every head dim D" in _error("attention t\nscale: 1.0 / D ** 9\n").message


# --- 5. params ------------------------------------------------------------------------------------

def test_non_finite_params_are_errors_naming_the_param():
    err = _error("attention t\nparam x = 1e999\n")
    assert (err.position.line, err.position.column) == (2, 11)
    assert "params: 'x' must be a finite number, got inf" in err.message
    spec = parse_spec("attention t\nparam cap = 50.0\nscore: softcap(score, cap)\n")
    for value in (math.nan, math.inf, -math.inf, 10 ** 400):
        with pytest.raises(ArgumentError, match=f"params: 'cap' must be a finite number, got {value!r}"):
            with_params(spec, {"cap": value})


def test_overrides_are_checked_like_the_text():
    spec = parse_spec("attention t\nparam c = 3\nparam w = 5\nmask: q // c == k // c and q - k < w\n")
    with pytest.raises(ArgumentError, match=r"params: 'c' = 0 makes 'q // c' wrong: the divisor of '//' must "
                                            r"not be a constant zero"):
        with_params(spec, {"w": 2, "c": 0})
    with pytest.raises(ArgumentError, match=r"params: 'cap' = 0 makes 'softcap\(score, cap\)' wrong"):
        with_params(parse_spec("attention t\nparam cap = 50.0\nscore: softcap(score, cap)\n"), {"cap": 0})
    with pytest.raises(ArgumentError, match=r"params: 'n' = 9 makes '\(q - k\) \*\* n' wrong: .* must fit in int64"):
        with_params(parse_spec("attention t\nparam n = 2\nscore: score + (q - k) ** n * 1e-9\n"), {"n": 9})
    with pytest.raises(ArgumentError, match=r"params: 'd' = 4 makes '1.0 / \(D - d\)' wrong: scale must be a "
                                            r"finite number .* at D=4"):
        with_params(parse_spec("attention t\nparam d = 0\nscale: 1.0 / (D - d)\n"), {"d": 4})
    with pytest.raises(ArgumentError, match="'w' is an int param and must fit in int64"):
        with_params(spec, {"w": 2 ** 63})


# --- 6. deep expressions --------------------------------------------------------------------------

@pytest.mark.parametrize("text", [
    "score: " + "-" * 400 + "score",
    "score: score" + " + (1.0" * 400 + ")" * 400,
    "score: " + "tanh(" * 400 + "score" + ")" * 400,
    "mask: " + "not " * 400 + "causal",
    "mask: " + " < ".join(["q"] * 400),
])
def test_too_deep_expressions_are_refused(text):
    err = _error(f"attention t\n{text}\n")
    assert err.position.line == 2
    assert f"levels; at most {MAX_DEPTH})" in err.message and "expression nests too deeply" in err.message


def _deep(depth: int) -> list[str]:
    """Specs whose mask or score nests exactly `depth` deep (a name or number is 1 deep)."""
    mask = "causal"
    for i in range(depth - 2):  # (a) or q > i: an `or` over a comparison 2 deep
        mask = f"({mask}) or q > {1000 + i}"
    score = "score"
    for _ in range((depth - 1) // 2):  # tanh(a) * 0.5: a product over a call
        score = f"tanh({score}) * 0.5"
    score += " + 0.1" if depth % 2 == 0 else ""
    nested = "score" + " - (0.01" * (depth - 2) + " - 0.01" + ")" * (depth - 2)
    return [f"attention t\nmask: {mask}\nscore: {score}\n", f"attention t\nscore: {nested}\n"]


def test_the_deepest_expressions_allowed_build_and_run():
    # The backward pass differentiates the score, which nests deeper still.
    for text in _deep(MAX_DEPTH + 1):
        assert f"({MAX_DEPTH + 1} levels; at most {MAX_DEPTH})" in _error(text).message
    for text in _deep(MAX_DEPTH):
        _check(text, n=8)


def test_flat_runs_of_a_thousand_operands_build_and_run():
    # A run of one operator nests as a balanced tree (lower._balanced), 10 deep for 1000 operands:
    # analysis, derivatives, folding, the kernels and the reference all see a shallow tree.
    terms = "".join(f" {'+-'[n % 2]} {n % 7} * (q - k) * 0.001" for n in range(1000))
    _check(f"attention t\nmask: causal" + " and q - k < 40" * 999 + f"\nscore: score{terms}\n", n=8)


# --- the generated kernels compile for Hopper ------------------------------------------------------

_COMPILE = textwrap.dedent('''
    import importlib.util, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    spec = importlib.util.spec_from_file_location("generated", sys.argv[1])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    constants = dict(HEAD_DIM=16, HEAD_DIM_V=16, HEAD_DIM_PAD=16, HEAD_DIM_V_PAD=16, BLOCK_M=64, BLOCK_N=64,
                     BLOCK_M1=32, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=32, PARTS=3, COUNT_VISITS=False,
                     DOT_PRECISION="tf32", FOLLOW_TABLE=False, KV_LEN=1,  # an int argument equal to 1 is a constexpr
                     HAS_KV_LEN=True, HAS_Q_OFFSET=True, PAGED=True, PAGE_SIZE=16,  # cache calls, paged
                     n_rows=1, SPLIT_BLOCK=16,  # one row to merge (found by attngen check on an H200)
                     VARLEN=False,  # packed calls' launches: tools/compile_sm90.py compiles them
                     HAS_SINK=True,  # the decode merge's part for a sink (fp32 rows)
                     CHECK=True, BLOCK_PAGES=2048,  # the decode merge checks a cache call's values
                     DROPOUT=True,  # the kernels that form P, with dropout's Philox draws beside the spec's ints
                     FP8=False)
    ints = {"lens_ptr": "*i64", "prefix_ptr": "*i32", "KvLen": "*i32", "QOffset": "*i32", "PageTable": "*i32",
            "OutPart": "*fp32", "LsePart": "*fp32", "CuSeqlensQ": "*i32", "CuSeqlensK": "*i32", "Sink": "*fp32",
            "Rng": "*i64", "QDescale": "*fp32", "KDescale": "*fp32", "VDescale": "*fp32"}
    SIZES = ("B", "H", "HKV", "Q_LEN", "SPLITS", "NUM_PAGES", "TOTAL_Q", "MAX_KV", "MAX_OFFSET", "MAX_PAGES")
    from attngen.families.decode.runtime import _decode_combine  # the decode family's merge, every spec's
    for kernel in (module._fwd_kernel, module._bwd_kernel, module._decode_fwd_kernel, _decode_combine):
        signature = {}
        for name in kernel.arg_names:
            if name in constants:
                signature[name] = "constexpr"
            elif name in ints:
                signature[name] = ints[name]
            elif name.startswith(("stride_", "size_")) or name in SIZES:
                signature[name] = "i32"
            elif name in ("sm_scale", "qk_scale", "dropout_p"):
                signature[name] = "fp32"
            else:
                signature[name] = "*fp16"
        used = {n: v for n, v in constants.items() if n in kernel.arg_names}
        compiled = triton.compile(ASTSource(kernel, signature, used), target=GPUTarget("cuda", 90, 32))
        assert kernel is _decode_combine or "mul.lo.s64" in compiled.asm["ptx"]
    print("compiled")
''')


def test_the_kernels_compile_for_sm90():
    text = ("attention t\ninput lens: i64[B]\ninput prefix: i32[B]\n"
            "mask: (k < lens[b] or causal) and k >= prefix[b] - 5\n"
            "score: score - 1e-10 * (q - k) ** 4 + (KV_LEN * 3000000000 + q) * 1e-12\n")
    attn = attngen.build(text)
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    result = subprocess.run([sys.executable, "-c", _COMPILE, str(attn.path)], capture_output=True, text=True,
                            env=env, timeout=600)
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]
