"""FP8 calls: float8_e4m3fn q, k and v with (B, HKV) descale factors, against the float64 reference of the
dequantized tensors within attngen.testing.tolerances.fp8_bound (which says why the bound holds), and their
refusals. tests/test_fuzz.py draws random specs and cases for the same check."""

from pathlib import Path

import pytest
import torch

import attngen
from attngen import reference, testing
from attngen.testing import tolerances

SPECS = Path(__file__).parent.parent / "specs"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _fp8_case(attn, B=2, H=4, HKV=2, N=40, M=64, D=32, seed=0):
    torch.manual_seed(seed)
    q, k, v = testing.random_qkv(B, H, HKV, N, M, D, D, torch.float32, device=DEVICE)
    inputs = testing.random_inputs(attn.spec, B, H, HKV, N, M, device=DEVICE)
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    scales = [torch.rand(B, HKV, device=DEVICE) + 0.5 for _ in range(3)]
    return q8, k8, v8, scales, inputs


_dequantized = tolerances.dequantized


def _bound(attn, q, k, v, inputs):
    return tolerances.fp8_bound(attn.spec, q, k, v, inputs)


@pytest.mark.parametrize("name", ["full", "causal", "alibi_causal", "gpt_oss_sinks", "document_causal"])
def test_an_fp8_call_matches_the_dequantized_reference(name):
    attn = attngen.build(SPECS / f"{name}.attn")
    q8, k8, v8, (qd, kd, vd), inputs = _fp8_case(attn)
    assert attn.forward_family(q8, k8, v8, **inputs) == "portable"  # the interpreter's
    with torch.no_grad():
        out, lse = attn(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, return_lse=True, **inputs)
    assert out.dtype == torch.bfloat16 and out.shape == q8.shape
    exact = (_dequantized(q8, qd), _dequantized(k8, kd), _dequantized(v8, vd))
    bound, want = _bound(attn, *exact, inputs)
    error = (out.double() - want).abs().amax(-1)
    assert torch.all(error <= bound), (error.max().item(), bound.min().item())
    want_lse = reference.evaluate(attn.spec, *exact, inputs)[1]
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


ON_FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_FP8_GPU, reason="needs a GPU with e4m3 tensor cores (compute capability 8.9 or more)")
@pytest.mark.parametrize("name", ["full", "causal", "alibi_causal", "gpt_oss_sinks", "document_causal", "sliding_window"])
@pytest.mark.parametrize("shape", [(2, 8, 2, 1000, 1000, 128), (1, 4, 4, 257, 700, 64), (1, 4, 2, 300, 333, 256),
                                   (2, 2, 1, 130, 1037, 96)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("family", ["chosen", "portable"])
def test_fp8_calls_on_gpu(name, shape, family, monkeypatch):
    """The FP8 forward as the GPU compiles it (e4m3 wgmma, P rounded by cvt.rn.satfinite), by the family the
    call goes to (on a Hopper GPU the Hopper family's, V transposed by the host) and by the portable one: no
    NaN, and within the bound above of the dequantized reference, at training-sized shapes."""
    B, H, HKV, N, M, D = shape
    attn = attngen.build(SPECS / f"{name}.attn")
    q8, k8, v8, (qd, kd, vd), inputs = _fp8_case(attn, B, H, HKV, N, M, D)
    if family == "portable":
        monkeypatch.setattr(attn.module.ATTENTION, "forward_families", ())
    hopper = family == "chosen" and torch.cuda.get_device_capability()[0] == 9
    assert attn.forward_family(q8, k8, v8, **inputs) == ("hopper" if hopper else "portable")
    with torch.no_grad():
        out = attn(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, **inputs)
    assert not out.isnan().any()
    bound, want = _bound(attn, _dequantized(q8, qd), _dequantized(k8, kd), _dequantized(v8, vd), inputs)
    assert torch.all((out.double() - want).abs().amax(-1) <= bound)


def _negative_factor_rows_are_nan(factor, B=2, H=4, HKV=2, N=40, M=64, D=32):
    """One (batch row, kv head)'s factor made negative: its query heads' rows of O and LSE are NaN (even with a
    sink, whose +inf would set them otherwise), every other row is the call's without it, bit for bit."""
    attn = attngen.build(SPECS / "gpt_oss_sinks.attn")
    q8, k8, v8, (qd, kd, vd), inputs = _fp8_case(attn, B, H, HKV, N, M, D)
    inputs["sinks"][1] = float("inf")
    scales = {"q_descale": qd, "k_descale": kd, "v_descale": vd}
    negative = scales[factor].clone()
    negative[1, 0] = -negative[1, 0]
    with torch.no_grad():
        want, want_lse = attn(q8, k8, v8, **scales, return_lse=True, **inputs)
        out, lse = attn(q8, k8, v8, **{**scales, factor: negative}, return_lse=True, **inputs)
    bad = torch.zeros(B, H, dtype=torch.bool)
    bad[1, :H // HKV] = True  # batch row 1, the query heads of kv head 0
    assert out[bad].isnan().all() and lse[bad].isnan().all()
    assert torch.equal(out[~bad], want[~bad]) and torch.equal(lse[~bad], want_lse[~bad])
    return attn.forward_family(q8, k8, v8, **inputs)


@pytest.mark.parametrize("factor", ["q_descale", "k_descale", "v_descale"])
def test_a_negative_descale_factor_makes_its_rows_nan(factor):
    _negative_factor_rows_are_nan(factor)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_FP8_GPU, reason="needs a GPU with e4m3 tensor cores (compute capability 8.9 or more)")
@pytest.mark.parametrize("factor", ["q_descale", "k_descale", "v_descale"])
def test_a_negative_descale_factor_makes_its_rows_nan_on_gpu(factor):
    """As above, by the family a GPU runs (the Hopper family's on a Hopper GPU, which scales after the row max)."""
    family = _negative_factor_rows_are_nan(factor, N=300, M=333, D=64)
    assert family == ("hopper" if torch.cuda.get_device_capability()[0] == 9 else "portable")
