"""Inputs that once gave silently wrong answers: upstream gradients in any layout (losses of the LSE
alone too), double backward and gradients asked of inputs not declared learnable (refused by
name), mask inputs written behind the version counter or made under inference mode (tile tables are
built on every call unless the caller passes its own), and bf16 in Triton's interpreter. And the backward
kernels alone (attn.gradients), given a call's out and LSE or those of more keys than it holds.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import attngen
from attngen import testing

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SPECS = Path(__file__).parent.parent / "specs"
LAYOUTS = ["contiguous", "expanded", "transposed", "heads_last", "sliced"]


def _upstream(shape: tuple[int, ...], layout: str, seed: int, dtype=torch.float32) -> torch.Tensor:
    """A random gradient of `shape` (B, H, Q_LEN[, DV]) laid out as autograd may hand it over."""
    g = torch.Generator().manual_seed(seed)

    def base(*dims):  # drawn on the CPU and moved before the view is taken: .to() would densify it
        return torch.randn(dims, generator=g).to(DEVICE, dtype)
    if layout == "contiguous":
        x = base(*shape)
    elif layout == "expanded":  # what .sum() and .expand() give: stride 0 everywhere
        x = base().expand(shape)
    elif layout == "transposed":
        x = base(*shape[:-2], shape[-1], shape[-2]).transpose(-1, -2)
    elif layout == "heads_last":  # a (B, Q_LEN, H, ...) tensor viewed as (B, H, Q_LEN, ...)
        x = base(shape[0], shape[2], shape[1], *shape[3:]).transpose(1, 2)
    else:  # every other query row of a larger tensor, from an offset
        x = base(*shape[:2], 2 * shape[2], *shape[3:])[:, :, 1::2]
    assert x.shape == shape and (layout == "contiguous") == x.is_contiguous()
    return x


def _assert_gradients(spec, q, k, v, inputs, grads, dout, dlse, out):
    """Kernel gradients (dq, dk, dv, then the learnable inputs') against the float64 reference's for
    the upstream gradients dout and dlse (None: that output is not in the loss); `out` is the kernel's
    output, whose rounding the backward reads through delta (testing.output_error_effect)."""
    dout = torch.zeros_like(out) if dout is None else dout
    ref = testing.reference_error(spec, q, k, v, inputs, dout=dout, dlse=dlse)
    scales = testing.summation_scales(spec, q, k, v, inputs, dout=dout, dlse=dlse)
    effects = testing.output_error_effect(spec, q, k, v, inputs, out, dout)
    names = ["dq", "dk", "dv"] + [f"d_{i.name}" for i in spec.learnable_inputs]
    for name, actual in zip(names, grads, strict=True):
        floor = (testing.default_floor(ref.truth[name], actual.dtype)
                 + testing.FLOOR_ULPS * testing.FP32_EPS * scales.get(name, 0.0) + effects.get(name, 0.0))
        testing.assert_matches_reference(name, actual, ref.truth[name], ref.low_precision[name], floor=floor)


def test_a_loss_of_the_lse_alone_gets_the_reference_gradients():
    attn = attngen.build(SPECS / "learned_rel_bias.attn")
    q, k, v = (x.requires_grad_() for x in testing.random_qkv(1, 2, 1, 30, 30, 16, 16, torch.float32, DEVICE))
    inputs = {name: x.requires_grad_() for name, x in testing.random_inputs(attn.spec, 1, 2, 1, 30, 30,
                                                                            device=DEVICE).items()}
    out, lse = attn(q, k, v, return_lse=True, **inputs)
    lse.sum().backward()  # dO is None and dLSE an expanded scalar
    _assert_gradients(attn.spec, q, k, v, inputs, [q.grad, k.grad, v.grad, inputs["table"].grad],
                      None, torch.ones_like(lse), out)


@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else []), ids=str)
@pytest.mark.parametrize("loss", ["out", "lse", "both"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_upstream_gradients_in_any_layout_give_the_reference_gradients(layout, loss, dtype):
    attn = attngen.build(SPECS / "causal.attn")
    q, k, v = (x.requires_grad_() for x in testing.random_qkv(2, 2, 1, 24, 24, 16, 16, dtype, DEVICE))
    out, lse = attn(q, k, v, return_lse=True)
    dout = _upstream(tuple(out.shape), layout, seed=1, dtype=out.dtype) if loss != "lse" else None
    dlse = _upstream(tuple(lse.shape), layout, seed=2) if loss != "out" else None
    pairs = [(x, g) for x, g in ((out, dout), (lse, dlse)) if g is not None]
    grads = torch.autograd.grad([x for x, _ in pairs], [q, k, v], [g for _, g in pairs])
    _assert_gradients(attn.spec, q, k, v, {}, grads, dout, dlse, out)


def test_double_backward_is_refused():
    attn = attngen.build(SPECS / "causal.attn")
    q, k, v = (x.requires_grad_() for x in testing.random_qkv(1, 2, 2, 20, 20, 16, 16, torch.float32, DEVICE))
    out = attn(q, k, v)
    with pytest.raises(ValueError, match="double backward .* is not supported"):
        torch.autograd.grad(out.sum(), q, create_graph=True)  # as a gradient penalty does


def test_an_input_not_declared_learnable_may_not_require_grad():
    attn = attngen.build(SPECS / "alibi_causal.attn")
    q, k, v = testing.random_qkv(1, 4, 2, 20, 20, 16, 16, torch.float32, DEVICE)
    slopes = torch.ones(4, device=DEVICE, requires_grad=True)
    with pytest.raises(ValueError, match=r"input 'slopes' requires grad.*`input slopes: f32\[H\] learnable`"):
        attn(q, k, v, slopes=slopes)
    with torch.no_grad():
        assert torch.equal(attn(q, k, v, slopes=slopes), attn(q, k, v, slopes=slopes.detach()))


def _document_case(B: int = 1):
    attn = attngen.build(SPECS / "document_causal.attn")
    q, k, v = testing.random_qkv(B, 2, 2, 40, 40, 16, 16, torch.float32, DEVICE)
    doc = torch.tensor([0] * 18 + [1] * 22, dtype=torch.int32, device=DEVICE)
    return attn, q, k, v, doc


def _out_and_grads(attn, q, k, v, doc):
    qkv = [x.detach().requires_grad_() for x in (q, k, v)]
    out = attn(*qkv, doc=doc)
    out.backward(torch.ones_like(out))
    return [out.detach()] + [x.grad for x in qkv]


def test_mask_inputs_written_behind_the_version_counter_are_followed():
    """The same tensor, written where its version counter cannot see, gives what a fresh copy of it
    gives (and that, the reference's: the copy is what check_against_reference runs)."""
    attn, q, k, v, doc = _document_case()
    _out_and_grads(attn, q, k, v, doc)
    doc.data[5:] = 1  # .data has a version counter of its own
    for got, want in zip(_out_and_grads(attn, q, k, v, doc), _out_and_grads(attn, q, k, v, doc.clone())):
        assert torch.equal(got, want)
    testing.check_against_reference(attn.spec, attn, q, k, v, {"doc": doc})
    if DEVICE == "cpu":
        doc.numpy()[30:] = 2  # a numpy view shares the storage, not the counter
        assert torch.equal(attn(q, k, v, doc=doc), attn(q, k, v, doc=doc.clone()))
        testing.check_against_reference(attn.spec, attn, q, k, v, {"doc": doc}, grads=False)


def test_mask_inputs_made_under_inference_mode():
    attn, q, k, v, doc = _document_case()
    with torch.inference_mode():
        doc = doc.clone()  # an inference tensor: it has no version counter
        out = attn(q, k, v, doc=doc)
        tables = attn.tile_tables(q, k, v, doc=doc)
        assert torch.equal(attn(q, k, v, doc=doc, tile_tables=tables), out)
    testing.check_against_reference(attn.spec, attn, q, k, v, {"doc": doc.clone()}, grads=False)


def test_tile_tables_that_do_not_fit_the_call_are_refused(monkeypatch):
    attn, q, k, v, doc = _document_case()
    tables = attn.tile_tables(q, k, v, doc=doc)
    q2, k2, v2 = testing.random_qkv(2, 2, 2, 40, 40, 16, 16, torch.float32, DEVICE)
    with pytest.raises(ValueError, match=r"tile_tables must be built for this call's \(B, H, HKV, Q_LEN, KV_LEN\)"):
        attn(q2, k2, v2, doc=doc, tile_tables=tables)
    other = attngen.build(SPECS / "causal.attn")
    with pytest.raises(ValueError, match=r"tile_tables must come from this attention's tile_tables.*causal"):
        attn(q, k, v, doc=doc, tile_tables=other.tile_tables(q, k, v))
    with pytest.raises(ValueError, match="tile_tables must come from this attention's tile_tables"):
        attn(q, k, v, doc=doc, tile_tables={})
    # fp16 with tiles other than fp32's: tables built for fp32 q do not fit an fp16 call.
    module = attn.module
    monkeypatch.setattr(module.ATTENTION, "facts", dataclasses.replace(module.FACTS, plan={
        key: ((32, 16, 4, 1),) * 3 if key[2] == "f16" else tiles for key, tiles in module.FACTS.plan.items()}))
    with pytest.raises(ValueError, match=r"must be built for this call's q dtype torch.float16.*got tables for "
                                         r"q dtype torch.float32"):
        attn(q.half(), k.half(), v.half(), doc=doc, tile_tables=tables)


def test_tile_tables_of_a_spec_without_them_are_accepted():
    attn = attngen.build(SPECS / "causal.attn")
    q, k, v = testing.random_qkv(1, 2, 2, 20, 20, 16, 16, torch.float32, DEVICE)
    assert torch.equal(attn(q, k, v, tile_tables=attn.tile_tables(q, k, v)), attn(q, k, v))


@pytest.mark.parametrize("name", ["causal", "document_causal", "learned_rel_bias"])
def test_bf16_matches_the_reference(name):
    """On the CPU through the interpreter, whose own bf16 tl.dot is wrong (the kernels then dot in fp32)."""
    attn = attngen.build(SPECS / f"{name}.attn")
    B, H, HKV, N, D, DV = 1, 2, 1, 37, 20, 24
    q, k, v = testing.random_qkv(B, H, HKV, N, N, D, DV, torch.bfloat16, DEVICE)
    inputs = testing.random_inputs(attn.spec, B, H, HKV, N, N, device=DEVICE)
    testing.check_against_reference(attn.spec, attn, q, k, v, inputs)


GATED = """
attention gated
input gate: f32[H] learnable
input table: f32[H, 5] learnable
score: score * gate[h] + max(table[h, :])
"""


@pytest.mark.parametrize("text", [GATED, SPECS / "gpt_oss_sinks.attn", SPECS / "document_causal.attn"])
def test_gradients_given_out_and_lse_are_the_autograd_ones(text):
    """attn.gradients runs the backward kernels of a call from its out, LSE and dO: through reductions
    (max(table[h, :])) and sinks to the inputs, as autograd of the call gives them."""
    attn = attngen.build(text, params={"window": 7} if "oss" in str(text) else None)
    B, H, HKV, N, D = 1, 2, 1, 40, 16
    q, k, v = (x.requires_grad_() for x in testing.random_qkv(B, H, HKV, N, N, D, D, torch.float32, DEVICE, seed=3))
    inputs = {n: x.requires_grad_(attn.spec.input(n).learnable)
              for n, x in testing.random_inputs(attn.spec, B, H, HKV, N, N, device=DEVICE, seed=3).items()}
    out, lse = attn(q, k, v, return_lse=True, **inputs)
    g = torch.Generator().manual_seed(4)
    do, dlse = (torch.randn(x.shape, generator=g).to(DEVICE) for x in (out, lse))
    leaves = [q, k, v, *(x for x in inputs.values() if x.requires_grad)]
    expected = torch.autograd.grad([out, lse], leaves, [do, dlse])
    dq, dk, dv, grads = attn.gradients(q, k, v, out, lse, do, dlse, **inputs)
    assert list(grads) == [i.name for i in attn.spec.learnable_inputs]
    for got, want in zip([dq, dk, dv, *grads.values()], expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_gradients_of_parts_of_the_keys_add_up_to_the_whole():
    """Given the output and LSE of all keys, each part of the keys gets its share of the gradients: dq and
    the learnable inputs' add up over the parts, dk and dv are the parts' rows."""
    attn = attngen.build(GATED)
    B, H, N, D = 1, 2, 40, 16
    q, k, v = testing.random_qkv(B, H, H, N, N, D, D, torch.float32, DEVICE, seed=5)
    inputs = testing.random_inputs(attn.spec, B, H, H, N, N, device=DEVICE, seed=5)
    out, lse = attn(q, k, v, return_lse=True, **inputs)
    g = torch.Generator().manual_seed(6)
    do, dlse = (torch.randn(x.shape, generator=g).to(DEVICE) for x in (out, lse))
    whole = attn.gradients(q, k, v, out, lse, do, dlse, **inputs)
    parts = [attn.gradients(q, k[:, :, s], v[:, :, s], out, lse, do, dlse, **inputs)
             for s in (slice(0, 17), slice(17, N))]
    torch.testing.assert_close(parts[0][0] + parts[1][0], whole[0])
    torch.testing.assert_close(torch.cat([parts[0][1], parts[1][1]], dim=2), whole[1])
    torch.testing.assert_close(torch.cat([parts[0][2], parts[1][2]], dim=2), whole[2])
    for name in ("gate", "table"):
        torch.testing.assert_close(parts[0][3][name] + parts[1][3][name], whole[3][name])
    with pytest.raises(ValueError, match=r"lse must be a float tensor of shape \(1, 2, 40\)"):
        attn.gradients(q, k, v, out, lse[:, :, :3], do, **inputs)
