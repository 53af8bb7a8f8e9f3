"""attngen.to_flex: FlexAttention's mods computing what the float64 reference computes, for every catalog spec
and specs covering every operator, function and integer width; the BlockMask's shape; the API's errors."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import pytest
import torch

import attngen
from attngen import testing
from attngen.errors import ArgumentError
from attngen.reference import evaluate, evaluate_expr, make_env
from conftest import slow_in_interpreter

ROOT = Path(__file__).parent.parent
# The catalog's specs Flex can express: a sink has no place in its mods (test_a_sink_is_refused), and its softmax
# is fixed (tests/test_sigmoid.py: to_flex refuses sigmoid attention).
SPECS = sorted(p for p in (ROOT / "specs").glob("*.attn") if p.stem not in ("gpt_oss_sinks", "sigmoid_alibi"))
# Small params, so that windows, chunks and blocks cut through the short test sequences.
SMALL = {"sliding_window": {"window": 8}, "gemma2_local": {"window": 8}, "chunked_causal": {"chunk": 8},
         "block_sparse": {"block": 8}}

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

# Every operator, comparison and boolean connective on ints, with negative operands for // and %, an int
# power, every size, int32 and int64 inputs, and a param beyond int32.
INT_OPS = """
attention int_ops
param c = 3
param big = 4000000000
input off: i64[B]
input lens: i32[B]
mask: ((((k - q) // c) % 2 == 0 or (k - q) % 5 == 4 or ((q % 4) ** 2 >= 4 and not (q == k + 1)))
       and k < lens[b] + Q_LEN and q - KV_LEN + Q_LEN + HKV * H - B + 30 >= k and off[b] >= k - q
       and (q + big) % 7 != 2)
"""
# Ints whose ranges need int64 (the analysis says so; computed in int32 they wrap), read from an i64 scalar.
WIDE = """
attention wide_ints
input base: i64[]
mask: (base % 1000003 + q * k) % 5 != 0 and ((q - k) ** 4) // 1000 < 60 and abs(k - q) * 3000000000 >= 0
score: score + ((base % 9 + k * 2147483647) % 9) * 0.25
"""
# Every function, float params and literals (inf), loads of every float dtype, bool and scalar inputs,
# hkv, int/float promotion, true division of ints, float powers (also of ints to negative or input
# exponents) and a scale expression of D.
FLOAT_FNS = """
attention float_fns
param cap = 20.0
param half = 0.5
input bias: f32[H, Q_LEN]
input bias16: f16[KV_LEN]
input biasbf: bf16[HKV]
input gate: bool[KV_LEN]
input s0: f32[]
input n: i32[B]
scale: half * rsqrt(D * 1.0) + 0.01 * log2(D)
score: (softcap(score, cap) + tanh(score) * exp(-abs(score)) + exp2(score / 4) - log(1 + sigmoid(score))
        + log2(2 + abs(score)) + sqrt(abs(score) + 1) * rsqrt(1.5 + score * score)
        + where(gate[k], bias[h, q], s0) + min(score, half) - max(score, -half) + clamp(score, -1, 1)
        + floor(score * 3) - ceil(score * 2) + (q - k) / 7 + 2.0 ** (hkv - h) + abs(score) ** 0.5
        + min(score, inf) + bias16[k] * biasbf[hkv] + where(k < n[b], 1, 0) + clamp(q - k, -3, 3)
        + max(q, k) // 5 + min(k, 2) + abs(k - q) % 3 + 2 ** -1 + (q + 1) ** (-2) + (k % 3 + 1) ** n[b] * 0.01
        + sin(cos(score)) + cos(score) * sin(score) + tan(tanh(score)) + atan(score * 3) + erf(score)
        + sign(score) + sign(k - q) + round(score * 2) + round(bias[h, q]))
"""
# Every bit operation on ints (negative operands, int64 ones, counts from 0 to 63, a count past 31 on
# an int32) and on bools.
BITS = """
attention bit_ops
input off: i64[B]
input lens: i32[B]
mask: (((q ^ k) & 7) != 5 and (q >> 1) >= (k >> 2) - 3 and (~k | 1) < 0 and ((q < 30) ^ (k > 20) | ~(q == k))
       and (off[b] >> 33) >= 0 and (q << 33) + (off[b] & 4294967295) >= 0 and (q - 20) >> 40 <= 0)
score: score + ((q << 3) ^ (k | 5)) * 0.01 + ((q & k) >> 1) * 0.1 + (off[b] >> 30) * 0.001 \
       + (q >> clamp(k, 0, 63)) * 0.1 + (lens[b] ^ ~k) * 0.01 + ((k - q) >> 2) * 0.1 + ((k - 9) | -16) * 0.1
"""
# An int score (the reference's score' is its float), and rows with no allowed key (q % 4 == 1).
INT_SCORE = """
attention int_score
mask: q % 4 != 1 and k <= q and true or false
score: (q - k) % 5 - D // 8
"""
# No row has an allowed key; the score does not read score.
NOTHING_ALLOWED = """
attention nothing_allowed
mask: false
score: 2.5
"""
# Reductions over whole dims of inputs (captured as reduced buffers of their own), in the mask and the score.
REDUCTIONS = """
attention reductions
input lens: i32[B, 3]
input flags: bool[B, KV_LEN]
input bias: f32[H, *, 2]
mask: k <= max(lens[b, :]) + sum(flags[b, :]) or (max(flags[b, :]) and q >= k)
score: score + sum(bias[h, :, 1]) - 0.5 * max(bias[:, :, 0]) + mean(lens[b, :]) * min(bias[hkv, :, :])
"""
HANDWRITTEN = {"int_ops": INT_OPS, "wide_ints": WIDE, "float_fns": FLOAT_FNS, "bit_ops": BITS, "int_score": INT_SCORE,
               "nothing_allowed": NOTHING_ALLOWED, "reductions": REDUCTIONS}

B, H, HKV, D = 2, 4, 2, 16


def _inputs(spec, Q_LEN, KV_LEN):
    inputs = testing.random_inputs(spec, B, H, HKV, Q_LEN, KV_LEN)
    # Values that make int32 arithmetic wrong: the int64 paths must be taken.
    if "base" in inputs:
        inputs["base"] = torch.tensor(2 ** 40 + 3)
    if "off" in inputs:
        inputs["off"] = torch.tensor([2 ** 35, 3])
    return inputs


def _lengths(name):
    # doc is i32[KV_LEN] and indexed by q: Q_LEN <= KV_LEN. Elsewhere Q_LEN > KV_LEN, so that
    # causal_bottom_right leaves its first rows empty.
    return (24, 40) if name == "document_causal" else (40, 24)


CASES = ([pytest.param(str(path), SMALL.get(path.stem), torch.float64, id=path.stem) for path in SPECS]
         + [pytest.param(text, None, dtype, id=f"{name}-{str(dtype)[6:]}")
            for name, text in HANDWRITTEN.items() for dtype in (torch.float64, torch.float32)])


@pytest.mark.parametrize("spec, params, dtype", CASES)
def test_flex_computes_the_reference(spec, params, dtype):
    flex = attngen.to_flex(spec, params=params)
    Q_LEN, KV_LEN = _lengths(flex.spec.name)
    q, k, v = testing.random_qkv(B, H, HKV, Q_LEN, KV_LEN, D, D, dtype, seed=3)
    inputs = _inputs(flex.spec, Q_LEN, KV_LEN)
    # out and LSE within the data-derived tolerance of the float64 reference (in float64: a few ulps
    # and fp32 ulps of the sums; in float32: 3x the reference's own float32 error). Flex has no
    # backward on the CPU, so gradients are checked only on the GPU (below).
    testing.check_against_reference(flex.spec, flex, q, k, v, inputs, grads=False)


@pytest.mark.parametrize("spec, params", [pytest.param(str(p), SMALL.get(p.stem), id=p.stem) for p in SPECS]
                         + [pytest.param(t, None, id=n) for n, t in HANDWRITTEN.items()])
def test_mask_mod_is_the_references_mask(spec, params):
    from torch.nn.attention.flex_attention import create_mask

    flex = attngen.to_flex(spec, params=params)
    Q_LEN, KV_LEN = _lengths(flex.spec.name)
    q, k, _ = testing.random_qkv(B, H, HKV, Q_LEN, KV_LEN, D, D, torch.float32)
    inputs = _inputs(flex.spec, Q_LEN, KV_LEN)
    mask_mod, _ = flex.mods(q, k, **inputs)
    if flex.spec.mask is None:
        assert mask_mod is None
        return
    env = make_env(flex.spec, B=B, H=H, HKV=HKV, Q_LEN=Q_LEN, KV_LEN=KV_LEN, D=D, inputs=inputs)
    expected = evaluate_expr(flex.spec.mask, env).expand(B, H, Q_LEN, KV_LEN)
    assert torch.equal(create_mask(mask_mod, B, H, Q_LEN, KV_LEN, device="cpu"), expected)


def test_empty_rows_give_zero_and_minus_inf_as_in_attngen():
    flex = attngen.to_flex(str(ROOT / "specs" / "causal_bottom_right.attn"))
    q, k, v = testing.random_qkv(1, 2, 2, 40, 24, D, D, torch.float64)
    out, lse = flex(q, k, v, return_lse=True)
    ref_out, ref_lse = evaluate(flex.spec, q, k, v)
    assert torch.isneginf(lse[..., :16]).all() and torch.isfinite(lse[..., 16:]).all()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    assert (out[..., :16, :] == 0).all() and not out.isnan().any()
    # LSE is a natural log, as attngen's: log(sum(exp(score))) over the allowed keys.
    torch.testing.assert_close(lse[..., 16:], ref_lse[..., 16:], rtol=0, atol=1e-12)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name, batch, heads", [("causal", False, False), ("prefix_lm", True, False),
                                                 ("block_sparse", False, True), ("document_causal", False, False)])
def test_block_mask_broadcasts_over_what_the_mask_does_not_read(name, batch, heads):
    flex = attngen.to_flex(str(ROOT / "specs" / f"{name}.attn"), params=SMALL.get(name))
    q, k, _ = testing.random_qkv(B, H, HKV, 40, 40, D, D, torch.float32)
    block_mask = flex.block_mask(q, k, **testing.random_inputs(flex.spec, B, H, HKV, 40, 40))
    assert (flex.mask_reads_batch, flex.mask_reads_heads) == (batch, heads)
    assert tuple(block_mask.kv_num_blocks.shape[:2]) == (B if batch else 1, H if heads else 1)


def test_hkv_in_the_mask_needs_the_heads_of_the_block_mask():
    flex = attngen.to_flex("attention by_kv_head\nmask: (q + hkv) % 3 != 0\n")
    assert flex.mask_reads_heads and not flex.mask_reads_batch


def test_plain_specs_have_no_mods_and_the_call_is_plain_attention():
    flex = attngen.to_flex(str(ROOT / "specs" / "full.attn"))
    q, k, v = testing.random_qkv(B, H, HKV, 20, 30, D, D, torch.float64)
    assert flex.mods(q, k) == (None, None) and flex.block_mask(q, k) is None
    kwargs = flex.kwargs(q, k)
    assert kwargs["scale"] == pytest.approx(D ** -0.5) and kwargs["enable_gqa"] is True
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(flex(q, k, v), expected, rtol=0, atol=1e-12)


def test_to_flex_takes_paths_text_specs_and_params():
    path = ROOT / "specs" / "sliding_window.attn"
    by_path = attngen.to_flex(path, params={"window": 8})
    by_text = attngen.to_flex(path.read_text(), params={"window": 8})
    by_spec = attngen.to_flex(attngen.load_spec(path)[0], params={"window": 8})
    assert by_path.spec == by_text.spec == by_spec.spec and by_path.spec.param("window").value == 8
    with pytest.raises(ArgumentError, match="unknown param 'windw'"):
        attngen.to_flex(path, params={"windw": 8})


def test_inputs_are_checked_and_call_options_cannot_be_input_names():
    flex = attngen.to_flex(str(ROOT / "specs" / "alibi_causal.attn"))
    q, k, _ = testing.random_qkv(1, 2, 2, 8, 8, D, D, torch.float32)
    with pytest.raises(ArgumentError, match="input 'slopes' must be given"):
        flex.mods(q, k)
    with pytest.raises(ArgumentError, match=r"input 'slopes' must have shape \[H=2\]"):
        flex.mods(q, k, slopes=torch.ones(3))
    with pytest.raises(ArgumentError, match="input 'kernel' has the name of an option of the Flex call"):
        attngen.to_flex("attention k\ninput kernel: f32[H]\nscore: score + kernel[h]\n")


def test_lengths_where_an_int_would_overflow_int64_are_refused_as_by_the_kernels():
    flex = attngen.to_flex("attention quartic\nscore: score + (q - k) ** 4 * 1e-30\n")
    assert flex.max_length == 55109  # README: the module refuses longer Q_LEN or KV_LEN for this term
    q = torch.zeros(1, 1, 55110, 1)
    with pytest.raises(ArgumentError, match=r"Q_LEN and KV_LEN must be at most 55109 \(beyond it"):
        flex.mods(q, q[:, :, :8])


@slow_in_interpreter  # 21 s on 2 cores: Inductor compiles C++ on the CPU
@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="Inductor on the CPU needs a C++ compiler")
def test_mods_compile_with_inductor():
    """torch.compile(flex_attention) traces the mods into its kernel (Inductor on the CPU here, Triton on a
    GPU): constants, int64 where needed, an int power, loads of each dtype. The CPU kernel has no LSE."""
    from torch.nn.attention.flex_attention import flex_attention

    text = ("attention compiled\nparam c = 3\ninput base: i64[]\ninput gate: bool[KV_LEN]\ninput w: f16[H]\n"
            "mask: ((k - q) // c) % 2 == 0 or (q % 4) ** 2 >= 4 or (base % 1000003 + q * k) % 5 != 0\n"
            "score: where(gate[k], softcap(score, 5.0), score * w[h]) + clamp(q - k, -3, 3) / 2 + max(k, 2) % c\n")
    flex = attngen.to_flex(text)
    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, dynamic=False)
    q, k, v = testing.random_qkv(B, H, HKV, 64, 48, D, D, torch.float32)
    inputs = testing.random_inputs(flex.spec, B, H, HKV, 64, 48)
    inputs["base"] = torch.tensor(2 ** 40 + 3)
    out = flex(q, k, v, kernel=compiled, **inputs)
    ref = evaluate(flex.spec, q.double(), k.double(), v.double(),
                   {n: x.double() if x.is_floating_point() else x for n, x in inputs.items()})[0]
    low = evaluate(flex.spec, q, k, v, inputs)[0]
    testing.assert_matches_reference("out", out, ref, low)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["alibi_causal", "learned_rel_bias", "document_causal", "sliding_window"])
def test_compiled_flex_on_the_gpu_matches_the_reference_with_gradients(name):
    from torch.nn.attention.flex_attention import flex_attention

    params = {"window": 64} if name == "sliding_window" else None
    flex = attngen.to_flex(str(ROOT / "specs" / f"{name}.attn"), params=params)
    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, dynamic=False)
    q, k, v = testing.random_qkv(2, 4, 2, 256, 256, 64, 64, torch.bfloat16, device="cuda")
    inputs = testing.random_inputs(flex.spec, 2, 4, 2, 256, 256, device="cuda")

    # Flex's default tiles for a captured buffer with a gradient (learned_rel_bias) need 245760
    # bytes of shared memory, over the H200's 232448 (the error suggests smaller tiles and stages).
    small = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_M1": 32, "BLOCK_N1": 32, "BLOCK_M2": 32, "BLOCK_N2": 32,
             "num_stages": 1}
    options = small if flex.spec.learnable_inputs else None

    def call(*args, **kwargs):
        return flex(*args, kernel=functools.partial(compiled, kernel_options=options), **kwargs)
    testing.check_against_reference(flex.spec, call, q, k, v, inputs)


def test_a_sink_is_refused():
    with pytest.raises(ArgumentError, match=r"must have no 'sink:' to run as FlexAttention, got 'sink: sinks\[h\]'"):
        attngen.to_flex(str(ROOT / "specs" / "gpt_oss_sinks.attn"))


def test_dropout_is_refused_and_none_is_the_plain_call():
    flex = attngen.to_flex(str(ROOT / "specs" / "causal.attn"))
    q, k, v = testing.random_qkv(1, 2, 2, 8, 8, 16, 16, torch.float32)
    with pytest.raises(ArgumentError, match="dropout_p must be 0 for FlexAttention, which has no dropout argument, "
                                            "got 0.1"):
        flex(q, k, v, dropout_p=0.1)
    assert torch.equal(flex(q, k, v, dropout_p=0.0), flex(q, k, v))
