"""Kernels compiled ahead (attngen/runtime/ahead.py): a plan's first call runs its host code over meta
stand-ins, so that every launch compiles (in a pool) and none launches. On the CPU: the stand-ins have the
facts Triton specializes on, and the stand-in run makes the very launches of the call it stands in for, in
every family, keeping no table. On a GPU: a first training call compiles everything ahead and nothing at
its launches, and gives the reference's answers."""

from pathlib import Path

import pytest
import torch
import triton
from hypothesis import given, settings
from hypothesis import strategies as st

import attngen
from attngen import testing
from attngen.testing import strategies
from attngen.families.decode import runtime as decode
from attngen.families.hopper import runtime as hopper
from attngen.families.portable import runtime as portable
from attngen.runtime import ahead, dropout as dropout_runtime, launch, launching, tables
from attngen.runtime.plans import _CallPlan, _backward_plan

SPECS = Path(__file__).parent.parent / "specs"
ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _views():
    """Tensors as calls pass them: dense, transposed, one of a fused projection's three, sliced off 16
    bytes, expanded, empty."""
    base = torch.zeros(2, 33, 3, 4, 64, dtype=torch.bfloat16)
    yield base[:, :, 0].transpose(1, 2)
    yield base.permute(2, 0, 3, 1, 4)[1]
    yield torch.zeros(2, 4, 33, 64, dtype=torch.bfloat16)
    for offset in range(1, 9):
        yield torch.zeros(2, 4, 100, dtype=torch.float16).view(-1)[offset:offset + 640].view(2, 4, 80)
    yield torch.zeros(3, dtype=torch.int64)[1:]
    yield torch.zeros(4, 1, dtype=torch.float32).expand(4, 50)
    yield torch.zeros(0, 4, 8, dtype=torch.float32)


@pytest.mark.parametrize("t", list(_views()), ids=lambda t: f"{tuple(t.shape)}/{t.stride()}/{t.storage_offset()}")
def test_a_stand_in_has_the_facts_triton_specializes_on(t):
    m = ahead._stand_in(t)
    assert m.device.type == "meta" and (m.shape, m.stride(), m.dtype) == (t.shape, t.stride(), t.dtype)
    assert launch._launch_fact(m) == launch._launch_fact(t)
    assert m.data_ptr() % 16 == t.data_ptr() % 16


# Every module that launches a kernel, by the name it imported _launch under.
LAUNCHERS = (portable, launching, tables, hopper, decode, dropout_runtime)


def _record_launches(patch, calls):
    """Stubs every launch with one that appends (whether it ran ahead, kernel, argument facts, options) to calls."""
    def record(kernel, grid, *args, bind=None, **options):
        calls.append((ahead.AHEAD.get(), getattr(kernel, "__name__", repr(kernel)),
                      tuple(launch._launch_fact(a) for a in args), tuple(sorted(options.items()))))
    for module in LAUNCHERS:
        patch.setattr(module, "_launch", record)


@pytest.fixture
def recorded(monkeypatch):
    calls = []
    _record_launches(monkeypatch, calls)
    return calls


def _in_family(rt, plan, family):
    """`plan`, or for "hopper" the plan a Hopper GPU would make (this CPU's is the portable family's)."""
    if family != "hopper":
        return plan
    hop = rt.families["hopper"]
    return _CallPlan(plan.sizes, ("hopper", hop.forward), ("hopper", "hopper_bwd", hop.backward))


def _stood_in_and_called(calls):
    """The launches of the stand-in run and of the call, apart."""
    return [call[1:] for call in calls if call[0]], [call[1:] for call in calls if not call[0]]


def _run_dense(rt, plan, q, k, v, tensors, sink, dropout):
    """A training call's forward and backward host code as _Attention runs them, dO in out's layout."""
    known = {}
    build = rt._builder(plan.sizes[:5], q.device, tensors, plan)
    with torch.no_grad():
        out, lse = rt._forward_with_tables(q, k, v, tensors, known, build, plan, sink, dropout)
        rt._backward_with_tables(q, k, v, out, lse, torch.randn_like(out), None, tensors, known, build, plan, False,
                                 sink if sink is not None and sink.requires_grad else None, dropout)


def _call(rt, spec, layout, dropout_p):
    """A training call's q, k, v, the inputs' tensors, its sink rows and dropout, as Attention.attn hands
    them to the families, on the CPU (B2 H4/HKV2, 100 queries over 300 keys, D64)."""
    B, H, HKV, Q_LEN, KV_LEN, D = 2, 4, 2, 100, 300, 64
    q, k, v = testing.random_qkv(B, H, HKV, Q_LEN, KV_LEN, D, D, torch.bfloat16)
    if layout == "transposed":  # (B, N, heads, D) memory, as transformers passes it
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    inputs = rt._reduced(testing.random_inputs(spec, B, H, HKV, Q_LEN, KV_LEN))
    for i in spec.learnable_inputs:
        inputs[i.name].requires_grad_()
    tensors = [inputs[name].contiguous() for name in rt.facts.inputs]
    return q, k, v, inputs, tensors, rt._sink_rows(q, k, inputs), rt._dropout(q, dropout_p, None)


@pytest.mark.parametrize("name, dropout_p", [("causal", 0.0), ("causal", 0.25), ("document_causal", 0.0),
                                             ("block_sparse", 0.0), ("learned_rel_bias", 0.0),
                                             ("gpt_oss_sinks", 0.0), ("sigmoid_alibi", 0.0)])
@pytest.mark.parametrize("family", ["portable", "hopper"])
@pytest.mark.parametrize("layout", ["dense", "transposed"])
def test_the_stand_in_run_makes_the_launches_of_the_call(recorded, name, dropout_p, family, layout):
    attn = attngen.build(SPECS / f"{name}.attn", target="h200")
    rt = attn.module.ATTENTION
    spec = attn.spec
    q, k, v, inputs, tensors, sink, dropout = _call(rt, spec, layout, dropout_p)
    plan = _in_family(rt, rt._call_plan(q, k, v, inputs, dropout=dropout is not None), family)
    kept, built = dict(rt.static_tables), rt.table_stats["built"]
    ahead.stand_in_run(rt, plan, q, k, v, tensors, sink, dropout, False, True)
    assert rt.static_tables == kept and rt.table_stats["built"] == built
    _run_dense(rt, plan, q, k, v, tensors, sink, dropout)
    stood_in, called = _stood_in_and_called(recorded)
    assert stood_in and stood_in == called
    kernels = {call[0] for call in called}
    assert any(n.startswith("_hopper_fwd") for n in kernels) == (family == "hopper")


@settings(max_examples=20)
@given(text=strategies.spec_texts(), family=st.sampled_from(["portable", "hopper"]),
       layout=st.sampled_from(["dense", "transposed"]))
def test_the_stand_in_run_makes_the_launches_of_calls_of_drawn_specs(text, family, layout):
    # Masks and scores of every construct, inputs learnable or not, sinks and sigmoid, as the fuzz draws them.
    attn = attngen.build(text, target="h200")
    rt = attn.module.ATTENTION
    calls = []
    with pytest.MonkeyPatch.context() as patch:  # (hypothesis runs examples inside one test: no fixture)
        _record_launches(patch, calls)
        q, k, v, inputs, tensors, sink, dropout = _call(rt, attn.spec, layout, 0.0)
        plan = _in_family(rt, rt._call_plan(q, k, v, inputs), family)
        ahead.stand_in_run(rt, plan, q, k, v, tensors, sink, dropout, False, True)
        _run_dense(rt, plan, q, k, v, tensors, sink, dropout)
    stood_in, called = _stood_in_and_called(calls)
    assert stood_in and stood_in == called


def _packed_call(rt, spec, dropout_p):
    """A packed training call's q, k, v (TOTAL, heads, D), inputs' tensors, sink rows, dropout and
    (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) on the CPU: four sequences of 37, 100, 1 and 64."""
    lengths, H, HKV, D = [37, 100, 1, 64], 4, 2, 64
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    total, longest = int(cu[-1]), max(lengths)
    q = torch.randn(total, H, D, dtype=torch.bfloat16)
    k, v = (torch.randn(total, HKV, D, dtype=torch.bfloat16) for _ in range(2))
    inputs = rt._reduced(testing.random_inputs(spec, len(lengths), H, HKV, longest, longest))
    for i in spec.learnable_inputs:
        inputs[i.name].requires_grad_()
    tensors = [inputs[name].contiguous() for name in rt.facts.inputs]
    packed = (cu, cu, longest, longest)
    return (q, k, v, inputs, tensors, rt._sink_rows(q, k, inputs, packed=(cu, cu)), rt._dropout(q, dropout_p, None),
            packed)


@pytest.mark.parametrize("name, dropout_p", [("causal", 0.0), ("causal", 0.25), ("learned_rel_bias", 0.0),
                                             ("gpt_oss_sinks", 0.0), ("sigmoid_alibi", 0.0)])
@pytest.mark.parametrize("family", ["portable", "hopper"])
def test_the_stand_in_run_makes_the_launches_of_a_packed_call(recorded, name, dropout_p, family):
    attn = attngen.build(SPECS / f"{name}.attn", target="h200")
    rt = attn.module.ATTENTION
    q, k, v, inputs, tensors, sink, dropout, packed = _packed_call(rt, attn.spec, dropout_p)
    plan = _in_family(rt, rt._packed_plan(q, k, v, inputs, *packed, dropout=dropout is not None), family)
    ahead.stand_in_run(rt, plan, q, k, v, tensors, sink, dropout, False, True, packed)

    with torch.no_grad():
        out, lse = rt._packed_forward(q, k, v, tensors, *packed, sink, plan, dropout)
        do, dlse = torch.randn_like(out), torch.zeros_like(lse)
        rt._packed_backward(q, k, v, out, lse, do, dlse, tensors, *packed, _backward_plan(plan, do, dlse), False,
                            sink if sink is not None and sink.requires_grad else None, dropout)
    stood_in, called = _stood_in_and_called(recorded)
    assert stood_in and stood_in == called
    assert any(n.startswith("_hopper_bwd") for n, *_ in called) == (family == "hopper")


@pytest.fixture
def compiles(monkeypatch):
    """Every kernel compile from here on, as (kernel, whether a stand-in run asked for it), by Triton's hook
    that runs before each; LAST_ERROR cleared."""
    seen = []
    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook",
                        lambda **kwargs: seen.append((kwargs["fn"].name, ahead.AHEAD.get())))
    monkeypatch.setattr(ahead, "LAST_ERROR", None)
    return seen


def _assert_all_compiled_ahead(compiles):
    assert ahead.LAST_ERROR is None
    assert [fn for fn, was_ahead in compiles if not was_ahead] == []  # nothing compiled at a launch
    assert any(fn.endswith(("_fwd_kernel", "_bwd_kernel")) for fn, _ in compiles)  # the spec's own, ahead


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("name, target, dropout_p", [
    ("causal", "h200", 0.0), ("causal", "h200", 0.2), ("document_causal", "h200", 0.0),
    ("learned_rel_bias", "h200", 0.0), ("gpt_oss_sinks", "h200", 0.0), ("sigmoid_alibi", "h200", 0.0),
    ("causal", "a100", 0.0), ("learned_rel_bias", "a100", 0.0)])
@pytest.mark.parametrize("layout", ["dense", "transposed"])
def test_a_first_training_call_compiles_every_kernel_ahead_on_gpu(compiles, name, target, dropout_p, layout):
    # A spec of its own name: a module no other test imported, so its kernels are compiled here.
    text = (SPECS / f"{name}.attn").read_text().replace(f"attention {name}", f"attention {name}_ahead_{layout}", 1)
    attn = attngen.build(text, target=target)
    B, H, HKV, N, D = 2, 8, 4, 1000, 128
    q, k, v = testing.random_qkv(B, H, HKV, N, N, D, D, torch.bfloat16, device="cuda")
    if layout == "transposed":
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    inputs = testing.random_inputs(attn.spec, B, H, HKV, N, N, device="cuda")
    leaves = [t.requires_grad_() for t in (q, k, v)] + [inputs[i.name].requires_grad_() for i in attn.spec.learnable_inputs]
    out = attn(q, k, v, dropout_p=dropout_p, **inputs)
    torch.autograd.grad(out, leaves, torch.randn_like(out))
    _assert_all_compiled_ahead(compiles)
    if dropout_p == 0.0:
        testing.check_against_reference(attn.spec, attn, q.detach(), k.detach(), v.detach(), inputs)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("name", ["causal", "learned_rel_bias", "gpt_oss_sinks"])
def test_a_first_packed_training_call_compiles_every_kernel_ahead_on_gpu(compiles, name):
    text = (SPECS / f"{name}.attn").read_text().replace(f"attention {name}", f"attention {name}_ahead_packed", 1)
    attn = attngen.build(text)
    lengths, H, HKV, D = [300, 1000, 17, 640], 8, 4, 128
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total, longest = int(cu[-1]), max(lengths)
    q = torch.randn(total, H, D, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    k, v = (torch.randn(total, HKV, D, dtype=torch.bfloat16, device="cuda", requires_grad=True) for _ in range(2))
    inputs = testing.random_inputs(attn.spec, len(lengths), H, HKV, longest, longest, device="cuda")
    leaves = [q, k, v] + [inputs[i.name].requires_grad_() for i in attn.spec.learnable_inputs]
    out = attn(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest, **inputs)
    grads = torch.autograd.grad(out, leaves, torch.randn_like(out))
    _assert_all_compiled_ahead(compiles)
    assert all(g.isfinite().all() for g in (out, *grads))
