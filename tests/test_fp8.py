"""FP8 calls: float8_e4m3fn q, k and v with (B, HKV) descale factors, against the float64 reference of the
dequantized tensors, and their refusals.

The forward rounds P to e4m3 before its product with V (as FlashAttention-3's FP8 forward does): each P
element is off by at most 2^-4 of itself (normals) or 2^-10 (subnormals, below 2^-6), and the row sum it is
divided by is at least 1, so O is off by at most (2^-4 + KV_LEN * 2^-10) * max |V| from the reference,
plus bfloat16's rounding of O."""

from pathlib import Path

import pytest
import torch

import attngen
from attngen import reference, testing

SPECS = Path(__file__).parent.parent / "specs"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _fp8_case(attn, B=2, H=4, HKV=2, N=40, M=64, D=32, seed=0):
    torch.manual_seed(seed)
    q, k, v = testing.random_qkv(B, H, HKV, N, M, D, D, torch.float32, device=DEVICE)
    inputs = testing.random_inputs(attn.spec, B, H, HKV, N, M, device=DEVICE)
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    scales = [torch.rand(B, HKV, device=DEVICE) + 0.5 for _ in range(3)]
    return q8, k8, v8, scales, inputs


def _dequantized(t, scale):
    return t.double() * scale.double().repeat_interleave(t.shape[1] // scale.shape[1], 1)[:, :, None, None]


@pytest.mark.parametrize("name", ["full", "causal", "alibi_causal", "gpt_oss_sinks", "document_causal"])
def test_an_fp8_call_matches_the_dequantized_reference(name):
    attn = attngen.build(SPECS / f"{name}.attn")
    q8, k8, v8, (qd, kd, vd), inputs = _fp8_case(attn)
    with torch.no_grad():
        out, lse = attn(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, return_lse=True, **inputs)
    assert out.dtype == torch.bfloat16 and out.shape == q8.shape
    want, want_lse = reference.evaluate(attn.spec, _dequantized(q8, qd), _dequantized(k8, kd), _dequantized(v8, vd),
                                        inputs)
    vmax = _dequantized(v8, vd).abs().max().item()
    bound = (2**-4 + k8.shape[2] * 2**-10) * vmax + 2**-8 * want.abs().max().item()
    error = (out.double() - want).abs().max().item()
    assert error <= bound, (error, bound)
    # LSE comes from the fp32 scores of exact e4m3 products: as close as a bf16 call's.
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-3, rtol=1e-3)


def test_descale_factors_default_to_one():
    attn = attngen.build("attention full\n")
    q8, k8, v8, _, _ = _fp8_case(attn)
    ones = torch.ones(2, 2, device=DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(attn(q8, k8, v8), attn(q8, k8, v8, q_descale=ones, k_descale=ones, v_descale=ones),
                                   atol=0, rtol=0)


@pytest.mark.parametrize("call, message", [
    (lambda a, q, k, v, s: a(q, k, v), "no backward pass"),
    (lambda a, q, k, v, s: a(q, k.float(), v, ), "k must be float8_e4m3fn like q"),
    (lambda a, q, k, v, s: a(q, k, v, q_descale=s[:1]), r"q_descale must be a float32 tensor of shape \(B, HKV\)"),
    (lambda a, q, k, v, s: a(q, k, v, v_descale=s.double()), "v_descale must be a float32 tensor"),
    (lambda a, q, k, v, s: a(q.float(), k.float(), v.float(), k_descale=s), "q, k and v must be float8_e4m3fn"),
    (lambda a, q, k, v, s: a(q, k, v, dropout_p=0.1), "takes no dropout_p"),
    (lambda a, q, k, v, s: a(q, k, v, kv_len=torch.full((2,), 8, dtype=torch.int32, device=DEVICE)), "dense forward"),
])
def test_fp8_calls_refuse_what_they_cannot_do(call, message):
    attn = attngen.build("attention full\n")
    q8, k8, v8, (scale, _, _), _ = _fp8_case(attn)
    grad = message == "no backward pass"
    with torch.set_grad_enabled(grad), pytest.raises(ValueError, match=message):
        call(attn, q8.requires_grad_(grad) if grad else q8, k8, v8, scale)


def test_each_descale_factor_scales_its_own_batch_row_and_head():
    # Powers of two per (batch, key/value head): a factor folded into the kernel must equal the same factor
    # multiplied into the e4m3 values themselves (exact at these magnitudes), bit for bit, which a factor read
    # at another row or head, or not at all, would not.
    attn = attngen.build(SPECS / "alibi_causal.attn")
    q8, k8, v8, _, inputs = _fp8_case(attn)
    factors = torch.tensor([[1.0, 2.0], [4.0, 8.0]], device=DEVICE)  # no e4m3 value leaves the normal range

    def scaled(t, scale):
        return (t.float() * scale.repeat_interleave(t.shape[1] // scale.shape[1], 1)[:, :, None, None]).to(t.dtype)

    with torch.no_grad():
        for name in ("q_descale", "k_descale", "v_descale"):
            folded = attn(q8, k8, v8, **{name: factors}, **inputs)
            tensors = [scaled(t, factors) if name[0] == t_name else t for t, t_name in zip((q8, k8, v8), "qkv")]
            assert torch.equal(folded, attn(*tensors, **inputs)), name
