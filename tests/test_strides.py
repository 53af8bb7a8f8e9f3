"""The layout contract: every family's launches return O, LSE and the gradients in the strides the
custom operators' fake implementations announce to torch.compile.

O follows q's layout and dQ, dK, dV follow q's, k's and v's (`_empty_in_layout`). Inductor plans its
graph with the fakes' strides and asserts them on the real outputs, so a family that returned other
strides would fail every compiled backward on the layouts models pass. Only a GPU runs the Hopper and
decode kernels; here each family's launch code runs on meta tensors with its kernel launches stubbed
out, so what it allocates is compared with the fakes on every layout, for every family.
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import attngen
from attngen.families.decode import runtime as decode
from attngen.families.hopper import runtime as hopper
from attngen.families.portable import runtime as portable
from attngen.runtime import arguments, launching, tables

B, H, HKV, N, D = 2, 4, 2, 48, 64
LAYOUTS = ("dense", "transposed", "fused_qkv", "one_batch_one_head")


def _qkv(layout, device="meta", dv=D):
    """q (B, H, N, D), k and v (B, HKV, N, D/DV) as a model would pass them in `layout`."""
    if layout == "dense":
        make = lambda heads, d: torch.empty(B, heads, N, d, dtype=torch.bfloat16, device=device)  # noqa: E731
        return make(H, D), make(HKV, D), make(HKV, dv)
    if layout == "transposed":  # (B, N, heads, D) projections, as transformers passes them
        make = lambda heads, d: torch.empty(B, N, heads, d, dtype=torch.bfloat16,  # noqa: E731
                                            device=device).transpose(1, 2)
        return make(H, D), make(HKV, D), make(HKV, dv)
    if layout == "fused_qkv":  # one projection's output, viewed as q, k, v (MHA: HKV = H)
        qkv = torch.empty(B, N, 3, H, D, dtype=torch.bfloat16, device=device).permute(2, 0, 3, 1, 4)
        return qkv[0], qkv[1], qkv[2]
    q = torch.empty(1, N, 1, D, dtype=torch.bfloat16, device=device).transpose(1, 2)
    kv = torch.empty(1, 1, N, D, dtype=torch.bfloat16, device=device)
    return q, kv, kv


@pytest.fixture(scope="module")
def module():
    # The H200's plan: its module holds all three families.
    return attngen.build("specs/causal.attn", target="h200").module


@pytest.fixture
def stubbed(module, monkeypatch):
    # The runtime's modules that launch kernels or read the SM count, each by its own imported name.
    for launcher in (portable, launching, tables, hopper, decode):
        monkeypatch.setattr(launcher, "_launch", lambda *args, **kwargs: None)
    for counting in (arguments, hopper, decode):
        monkeypatch.setattr(counting, "_sm_count", lambda device: 132)
    return module


def _fake_outputs(module, q, k, v):
    """The forward and backward operators' fakes on tensors of q, k and v's strides."""
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)) for t in (q, k, v))
        out, lse = module.OPERATORS[1](fq, fk, fv, [], [], [], [], 0.0)
        dq, dk, dv, _ = module.OPERATORS[2](fq, fk, fv, out, lse, torch.empty_like(out), lse, [], [], [], 0.0)
    return out, lse, dq, dk, dv


def _layout(t):
    return tuple(t.shape), t.stride(), t.dtype


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", ["portable", "hopper", "decode"])
def test_each_family_returns_the_strides_its_fakes_announce(stubbed, family, layout):
    q, k, v = _qkv(layout)
    out_fake, lse_fake, dq_fake, dk_fake, dv_fake = _fake_outputs(stubbed, q, k, v)
    forward = stubbed._portable_forward if family == "portable" else stubbed.families[family].forward
    out, lse = forward(q, k, v, [], ())
    assert _layout(out) == _layout(out_fake) and _layout(lse) == _layout(lse_fake)
    if family == "decode":  # a forward-only family: training calls' backwards run the others
        return
    do = torch.empty_like(out)
    if family == "portable":
        dq, dk, dv, _, _ = stubbed._portable_backward(q, k, v, out, lse, do, None, [], ((), ()))
    else:
        dq, dk, dv, _, _ = stubbed.families["hopper"].backward(q, k, v, out, lse, do, None, [], ())
    assert [_layout(t) for t in (dq, dk, dv)] == [_layout(t) for t in (dq_fake, dk_fake, dv_fake)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_outputs_and_gradients_follow_the_inputs_layout(stubbed, layout):
    q, k, v = _qkv(layout)
    out, _, dq, dk, dv = _fake_outputs(stubbed, q, k, v)
    # O lies in memory as q does, so O.transpose(1, 2) of transposed projections is a dense (B, N, H, D).
    order = lambda t: sorted(range(3), key=lambda d: -t.stride(d))  # noqa: E731
    assert order(out) == order(q) and order(dq) == order(q) and order(dk) == order(k) and order(dv) == order(v)
    for t in (out, dq, dk, dv):
        assert t.is_contiguous() or t.transpose(1, 2).is_contiguous() or layout == "one_batch_one_head"
    if layout == "transposed":
        assert out.transpose(1, 2).is_contiguous() and dq.transpose(1, 2).is_contiguous()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's kernels (the GPU tests above check a GPU's)")
def test_the_portable_kernels_write_o_and_gradients_in_the_contract_strides():
    # On the CPU the portable kernels run: their real outputs, and a transposed call's values against a
    # dense call's.
    attn = attngen.build("specs/causal.attn")
    q, k, v = (t.float() for t in _qkv("transposed", device="cpu"))
    for t in (q, k, v):
        t.normal_()
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    dense = [t.detach().contiguous().requires_grad_() for t in (q, k, v)]
    out = attn(*leaves)
    assert out.transpose(1, 2).is_contiguous()
    out.square().sum().backward()
    assert all(t.grad.transpose(1, 2).is_contiguous() for t in leaves)
    reference = attn(*dense)
    reference.square().sum().backward()
    assert torch.equal(out, reference)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(leaves, dense))
