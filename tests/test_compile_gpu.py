"""torch.compile with Inductor on the GPU: forward and backward of every family on the layouts models
pass (dense, transposed (B, N, H, D) projections, one fused QKV projection), with dO contiguous or not,
static and dynamic shapes; and opcheck of each operator on non-contiguous inputs.

Inductor checks the strides of every custom operator's outputs against what its fake implementation
announced; aot_eager on the CPU does not, so only this file can see a family break the layout contract
(tests/test_strides.py guards it on the CPU by running each family's allocations on meta tensors).
"""

from pathlib import Path

import pytest
import torch

import attngen
from attngen import testing

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_dynamo")]  # conftest: fresh compiled graphs
SPECS = Path(__file__).resolve().parent.parent / "specs"
ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
# Each test id's call on an H200: the family serving it, its spec, its (B, H, HKV, Q_LEN, KV_LEN, D, dtype), and
# the query rows of the Hopper forward's tile where that family runs it. hopper: bf16, D = 128; portable: D = 48,
# which the Hopper family does not take; decode: a few query rows over many keys (its backward runs another
# family's kernels); hopper_three_consumers: full attention at D = 64, whose forward takes 192-row tiles and three
# consumer warpgroups.
CALLS = {
    "hopper": ("hopper", "causal", (2, 8, 8, 512, 512, 128, torch.bfloat16), 128),
    "portable": ("portable", "causal", (2, 8, 8, 1024, 1024, 48, torch.bfloat16), None),
    "decode": ("decode", "causal_bottom_right", (2, 8, 2, 4, 4096, 64, torch.bfloat16), None),
    "hopper_three_consumers": ("hopper", "full", (2, 8, 8, 1024, 1024, 64, torch.bfloat16), 192),
}
LAYOUTS = ("dense", "transposed", "fused_qkv")


def _qkv(layout, B, H, HKV, Q_LEN, KV_LEN, D, dtype):
    """Leaf projections and the q, k, v views of them that a model passes."""
    g = torch.Generator(device="cuda").manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, generator=g, device="cuda", dtype=dtype)  # noqa: E731
    if layout == "fused_qkv":  # x.view(B, N, 3, H, D).permute(2, 0, 3, 1, 4): needs Q_LEN = KV_LEN, H = HKV
        fused = randn(B, Q_LEN, 3, H, D).requires_grad_()
        q, k, v = fused.permute(2, 0, 3, 1, 4).unbind(0)
        return [fused], (q, k, v)
    if layout == "transposed":
        leaves = [randn(B, Q_LEN, H, D), randn(B, KV_LEN, HKV, D), randn(B, KV_LEN, HKV, D)]
        leaves = [t.requires_grad_() for t in leaves]
        return leaves, tuple(t.transpose(1, 2) for t in leaves)
    leaves = [randn(B, H, Q_LEN, D), randn(B, HKV, KV_LEN, D), randn(B, HKV, KV_LEN, D)]
    leaves = [t.requires_grad_() for t in leaves]
    return leaves, tuple(leaves)


def _shape(call, layout):
    B, H, HKV, Q_LEN, KV_LEN, D, dtype = CALLS[call][2]
    if layout == "fused_qkv":
        HKV, KV_LEN = H, Q_LEN
    return B, H, HKV, Q_LEN, KV_LEN, D, dtype


@pytest.mark.skipif(not ON_HOPPER, reason="the family calls are chosen for a Hopper GPU")
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("contiguous_do", [True, False], ids=["do_dense", "do_transposed"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("call", list(CALLS))
def test_inductor_forward_and_backward_on_model_layouts(call, layout, contiguous_do, dynamic):
    family, spec, _, forward_rows = CALLS[call]
    if family == "decode" and layout == "fused_qkv":
        pytest.skip("a fused QKV projection has Q_LEN = KV_LEN: no decode call")
    attn = attngen.build(SPECS / f"{spec}.attn")
    shape = _shape(call, layout)
    leaves, (q, k, v) = _qkv(layout, *shape)
    assert attn.forward_family(q, k, v) == family
    if forward_rows is not None:
        assert attn.module._family_tiles(q, v, "hopper")[0] == forward_rows

    def step(q, k, v):
        out = attn(q, k, v)
        # transformers reads O back as (B, N, H, D): its gradient then arrives transposed.
        read = out.transpose(1, 2) if not contiguous_do else out
        return (read.float().square() * 0.5).sum() + read.float().sum()

    eager_loss = step(q, k, v)
    eager_grads = torch.autograd.grad(eager_loss, leaves)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, dynamic=dynamic)
    leaves2, (q2, k2, v2) = _qkv(layout, *shape)
    loss = compiled(q2, k2, v2)
    grads = torch.autograd.grad(loss, leaves2)
    # Same kernels, same inputs: the compiled step must give the eager step's numbers.
    torch.testing.assert_close(loss, eager_loss, rtol=1e-3, atol=1e-3)
    for got, want in zip(grads, eager_grads):
        assert not got.isnan().any()
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not ON_HOPPER, reason="the family calls are chosen for a Hopper GPU")
@pytest.mark.parametrize("family", ["hopper", "portable"])
def test_outputs_follow_the_transposed_layout_on_gpu(family):
    # O and the gradients come back in q's, k's and v's (B, N, H, D) memory: reading O as (B, N, H, D)
    # and the projections' gradients need no copy.
    attn = attngen.build(SPECS / "causal.attn")
    leaves, (q, k, v) = _qkv("transposed", *CALLS[family][2])
    assert attn.backward_family(q, k, v) == family
    out = attn(q, k, v)
    assert out.transpose(1, 2).is_contiguous()
    dq, dk, dv = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    assert all(g.transpose(1, 2).is_contiguous() for g in (dq, dk, dv))
    assert all(leaf.stride() == leaf.detach().contiguous().stride() for leaf in leaves)


@pytest.mark.parametrize("name", ["causal", "document_causal", "learned_rel_bias"])
def test_opcheck_on_non_contiguous_inputs_on_gpu(name):
    attn = attngen.build(SPECS / f"{name}.attn")
    B, H, N, D = 2, 4, 256, 128
    dense = testing.random_qkv(B, H, H, N, N, D, D, torch.bfloat16, device="cuda", layout="transposed")
    q, k, v = dense
    assert not q.is_contiguous()
    inputs = testing.random_inputs(attn.spec, B, H, H, N, N, device="cuda")
    table_op, forward_op, backward_op, cache_op = attn.module.OPERATORS[:4]
    tensors = [inputs[i.name] for i in attn.spec.inputs]
    tables = []
    if attn.module.FACTS.tile_table:
        key = attn.module._table_key(q, v, 0)
        torch.library.opcheck(table_op, (q, k, tensors, *key))
        tables = list(table_op(q, k, tensors, *key))
    torch.library.opcheck(forward_op, (q, k, v, tensors, tables, [], [], 0.0))
    with torch.no_grad():
        out, lse = forward_op(q, k, v, tensors, tables, [], [], 0.0)
    do = torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    torch.library.opcheck(backward_op, (q, k, v, out, lse, do, torch.randn_like(lse), tensors, [], [], 0.0))
    kv_len = torch.full((B,), N, dtype=torch.int32, device="cuda")
    torch.library.opcheck(cache_op, (q[:, :, :4], k, v, tensors, [kv_len], [kv_len - 4], [], []))
