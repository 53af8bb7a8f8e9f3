"""Deterministic backward (attngen.build(..., deterministic=True), attn(..., deterministic=True) or
torch.use_deterministic_algorithms(True)): the same gradient bits run after run, against the float64 reference.

On the CPU, Triton's interpreter runs a launch's programs one after another in grid order, so every backward
repeats itself there; `shuffled_programs` runs them in a random order instead, as a GPU's scheduler may, so
that the atomic adds of a learnable input's gradient meet in another order each time: the default backward's
bits then move (shown), the deterministic one's do not. The Hopper family's backward serves no deterministic
call (its key tiles add their dQ tiles concurrently): on a Hopper GPU such a call runs the Hopper forward and
the portable backward (the gpu tests; tests/test_hopper.py checks the choice on the CPU).
"""

import functools
import itertools
import math
import random

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import attngen
from attngen import api, testing
from attngen.runtime.helpers import EXACT_WORDS, _exact_add
from attngen.runtime.kernels import _exact_finish
from conftest import CPU_CALLS, SPECS

# ALiBi whose slopes are learned: a gradient point-summed over whole tiles and over every head's rows.
ALIBI_LEARNED = """
attention alibi_learned
input slopes: f32[H] learnable
mask: causal
score: score + slopes[h] * (k - q)
"""


@pytest.fixture
def shuffled_programs(monkeypatch):
    """shuffle(seed): from then on, each launch in Triton's interpreter runs its programs (every one once,
    with its own program ids) in an order drawn from `seed`."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    set_dim, set_idx = builder.set_grid_dim, builder.set_grid_idx
    state = {}

    def set_grid_dim(x, y, z):
        order = list(itertools.product(range(x), range(y), range(z)))
        state["rng"].shuffle(order)
        state["order"], state["dims"] = order, (y, z)
        return set_dim(x, y, z)

    def set_grid_idx(x, y, z):
        y_size, z_size = state["dims"]
        return set_idx(*state["order"][(x * y_size + y) * z_size + z])

    def shuffle(seed):
        state["rng"] = random.Random(seed)
        monkeypatch.setattr(builder, "set_grid_dim", set_grid_dim)
        monkeypatch.setattr(builder, "set_grid_idx", set_grid_idx)
    return shuffle


# --- exact sums ----------------------------------------------------------------------------------

@triton.jit
def _scatter(Words, Values, Index, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    value = tl.load(Values + offs, mask=ok, other=0.0)
    index = tl.load(Index + offs, mask=ok, other=0)
    _exact_add(Words + index.to(tl.int64) * EXACT_WORDS, value, ok)


def _exact_sums(values, index, entries):
    words = torch.zeros(entries * EXACT_WORDS.value, dtype=torch.int64)
    _scatter[(triton.cdiv(values.numel(), 64),)](words, values, index, values.numel(), BLOCK=64)
    out = torch.empty(entries, dtype=torch.float32)
    _exact_finish[(triton.cdiv(entries, 64),)](words, out, entries, BLOCK=64)
    return out


@CPU_CALLS
def test_exact_sums_are_the_same_in_any_order_and_the_sum_rounded_once():
    g = torch.Generator().manual_seed(0)
    n, entries = 700, 5
    # Magnitudes over 60 orders, both signs, denormals, and terms that cancel to the last bit.
    values = (torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 20)).float()
    values[::9] = torch.tensor(1e-44)
    values[1::11] = -values[0::11][:values[1::11].numel()]
    index = torch.randint(0, entries, (n,), generator=g, dtype=torch.int32)
    sums = _exact_sums(values, index, entries)
    for seed in range(3):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 1))
        assert torch.equal(_exact_sums(values[order], index[order], entries), sums)
    for entry in range(entries):
        exact = math.fsum(float(x) for x, i in zip(values, index) if i == entry)
        # Rounded from the exact sum (through float64: twice, so by at most one float32 ulp).
        assert abs(float(sums[entry]) - exact) <= float(np.spacing(np.float32(abs(exact))))


@CPU_CALLS
def test_exact_sums_of_infinities_and_nan_are_what_float_addition_gives():
    inf, nan = float("inf"), float("nan")
    terms = [[1.0, inf, 2.0], [-inf, 3.0], [inf, -inf], [nan, 1.0], [3e38, 3e38], [1e-45, 1e-45, -2e-45], [0.0]]
    values = torch.tensor([x for t in terms for x in t], dtype=torch.float32)
    index = torch.tensor([i for i, t in enumerate(terms) for _ in t], dtype=torch.int32)
    sums = _exact_sums(values, index, len(terms))
    # The float32 terms summed in float64 (exact for these), then rounded: 3e38 + 3e38 overflows to inf.
    want = torch.stack([values[index == i].double().sum() for i in range(len(terms))]).float()
    assert torch.equal(sums.isnan(), want.isnan())
    assert torch.equal(sums[~sums.isnan()], want[~want.isnan()])


# --- the backward ----------------------------------------------------------------------------------

def _case(spec, B=2, H=4, HKV=2, N=40, D=16, seed=0):
    # 40 positions cross three of the interpreter's 16-wide tiles; two query heads a key/value head.
    torch.manual_seed(seed)
    q, k, v = testing.random_qkv(B, H, HKV, N, N, D, D, torch.float32)
    inputs = testing.random_inputs(spec, B, H, HKV, N, N)
    leaves = [q, k, v, *(inputs[i.name] for i in spec.learnable_inputs)]
    for t in leaves:
        t.requires_grad_()
    dout = torch.randn(B, H, N, D)
    return q, k, v, inputs, leaves, dout


def _gradients(attn, case, **call):
    q, k, v, inputs, leaves, dout = case
    return torch.autograd.grad(attn(q, k, v, **inputs, **call), leaves, dout)


def _same_bits(a, b):
    return all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a, b))


@CPU_CALLS
# learned_rel_bias (a table gathered per pair: 26 s in the interpreter) in the slow tier; alibi_learned keeps it here.
@pytest.mark.parametrize("spec", [pytest.param("learned_rel_bias", marks=pytest.mark.slow), ALIBI_LEARNED],
                         ids=["learned_rel_bias", "alibi_learned"])
def test_five_backward_passes_give_the_same_bits_in_any_program_order(spec, shuffled_programs):
    attn = attngen.build(SPECS / f"{spec}.attn" if "\n" not in spec else spec, deterministic=True)
    case = _case(attn.spec, B=1)
    shuffled_programs(0)
    first = _gradients(attn, case)
    for seed in range(1, 5):
        shuffled_programs(seed)
        assert _same_bits(_gradients(attn, case), first), f"pass {seed + 1} differs"
    # The shuffle does move the default backward's learnable gradient (its fp32 atomics meet in another
    # order), so the passes above could have failed.
    default = [_gradients(attn, case, deterministic=False)[-1]]
    shuffled_programs(7)
    default.append(_gradients(attn, case, deterministic=False)[-1])
    assert not torch.equal(*default)
    # ... by rounding only: the deterministic gradients are the same numbers.
    torch.testing.assert_close(first[-1], default[0], rtol=1e-5, atol=1e-6)
    testing.check_against_reference(attn.spec, attn, *case[:4])


@CPU_CALLS
def test_torch_use_deterministic_algorithms_turns_it_on_at_call_time(shuffled_programs):
    attn = attngen.build(SPECS / "learned_rel_bias.attn")  # built without deterministic=True
    case = _case(attn.spec, B=1, H=2, HKV=1)
    attn.module.ATTENTION.call_plans.clear()  # the module (and its plans) may be another test's too
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        grads = []
        for seed in range(2):
            shuffled_programs(seed)
            grads.append(_gradients(attn, case))
        assert _same_bits(*grads)
    finally:
        torch.use_deterministic_algorithms(was)
    # Read at each call, not at build time: the call's plan is keyed by it, and the flag off again plans anew.
    _gradients(attn, case)
    plans = attn.module.ATTENTION.call_plans
    assert sorted(key[0] for key in plans) == [False, True]


@CPU_CALLS
def test_a_deterministic_packed_call_gives_the_same_bits_and_the_reference(shuffled_programs):
    attn = attngen.build(ALIBI_LEARNED, deterministic=True)
    lengths = [21, 5, 34]
    H, HKV, D, total = 4, 2, 16, sum(lengths)
    torch.manual_seed(3)
    q, k, v = torch.randn(total, H, D), torch.randn(total, HKV, D), torch.randn(total, HKV, D)
    slopes = torch.rand(H, requires_grad=True)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    packed = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths), max_seqlen_k=max(lengths))
    leaves = [t.requires_grad_() for t in (q, k, v)] + [slopes]
    dout = torch.randn(total, H, D)
    grads = []
    for seed in range(3):
        shuffled_programs(seed)
        grads.append(torch.autograd.grad(attn(q, k, v, slopes=slopes, **packed), leaves, dout))
    assert _same_bits(grads[0], grads[1]) and _same_bits(grads[0], grads[2])
    testing.check_against_reference(attn.spec, attn, q, k, v, {"slopes": slopes}, packed=packed)


@pytest.mark.slow  # 32 s on 2 cores (interpreted backwards in five orders, dense and packed)
@CPU_CALLS
def test_a_deterministic_backward_with_dropout_gives_the_same_bits_in_any_program_order(shuffled_programs):
    # The keep-mask is a function of the call's words alone (the same generator state: the same mask), so
    # deterministic mode repeats a dropout call's gradients as it does a plain call's; dense and packed.
    attn = attngen.build(ALIBI_LEARNED, deterministic=True)
    case = _case(attn.spec, B=1)
    grads = []
    for seed in range(3):
        shuffled_programs(seed)
        grads.append(_gradients(attn, case, dropout_p=0.3, generator=torch.Generator().manual_seed(5)))
    assert _same_bits(grads[0], grads[1]) and _same_bits(grads[0], grads[2])
    # The default backward's learnable gradient moves with the order under dropout too, so the above could fail;
    # and another generator state drops other weights.
    default = []
    for seed in (0, 7):
        shuffled_programs(seed)
        default.append(_gradients(attn, case, dropout_p=0.3, generator=torch.Generator().manual_seed(5),
                                  deterministic=False)[-1])
    assert not torch.equal(*default)
    assert not torch.equal(_gradients(attn, case, dropout_p=0.3, generator=torch.Generator().manual_seed(6))[0],
                           grads[0][0])
    testing.check_against_reference(attn.spec, attn, *case[:4], seed=5, dropout_p=0.3)
    lengths = [21, 5, 34]
    torch.manual_seed(3)
    q, k, v = (torch.randn(sum(lengths), heads, 16) for heads in (4, 2, 2))
    slopes = torch.rand(4)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    packed = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths), max_seqlen_k=max(lengths))
    leaves = [t.requires_grad_() for t in (q, k, v, slopes)]
    dout = torch.randn(sum(lengths), 4, 16)
    packed_grads = []
    for seed in range(2):
        shuffled_programs(seed)
        out = attn(q, k, v, slopes=slopes, dropout_p=0.4, generator=torch.Generator().manual_seed(1), **packed)
        packed_grads.append(torch.autograd.grad(out, leaves, dout))
    assert _same_bits(*packed_grads)
    testing.check_against_reference(attn.spec, attn, q, k, v, {"slopes": slopes}, packed=packed, seed=1,
                                    dropout_p=0.4)


def test_a_call_argument_may_not_name_an_input():
    with pytest.raises(attngen.SpecError, match="'deterministic' is an argument of the attention call"):
        attngen.parse_spec("attention t\ninput deterministic: f32[H]\nscore: score + deterministic[h]\n")
    with pytest.raises(attngen.ArgumentError, match="deterministic must be a bool, got int"):
        attngen.build(SPECS / "causal.attn", deterministic=1)


# --- which backward a deterministic call runs -------------------------------------------------------

def test_explain_says_which_backward_a_deterministic_call_runs():
    def line(text):
        report = api.explain(text, q_len=256, kv_len=256, head_dim=128, head_dim_v=128, dtype="bf16", target="h200")
        return next(x for x in report.text.splitlines() if x.strip().startswith("deterministic backward"))
    # On Hopper the portable backward, after the hopper forward, and why not the hopper one.
    for text in ((SPECS / "learned_rel_bias.attn").read_text(), "attention t\ninput t: f32[H]\nscore: score * t[h]\n"):
        said = line(text).split(": ", 1)[1]
        assert said.startswith("portable (each dQ program writes its query tile's rows once"), said
        assert "not hopper: its key tiles add their dQ tiles concurrently" in said
        assert "runs the portable backward after the hopper forward" in said
    assert "learnable inputs' gradients summed exactly" in line((SPECS / "learned_rel_bias.attn").read_text())
    assert "summed exactly" not in line("attention t\ninput t: f32[H]\nscore: score * t[h]\n")
    portable_only = api.explain("attention t\nmask: causal\n", q_len=64, kv_len=64, head_dim=16, head_dim_v=16,
                                dtype="f32", target="interpreter").text
    assert "deterministic backward" in portable_only and "hopper" not in portable_only.split("deterministic backward")[1]


# --- on the GPU --------------------------------------------------------------------------------------

def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("spec, D, forward", [
    ("learned_rel_bias", 128, "hopper"), ("causal", 64, "hopper"), ("gemma2_local", 128, "hopper"),
    ("causal", 256, "hopper"), ("learned_rel_bias", 32, "portable"), ("causal", 32, "portable"),
    ("attention scaled\ninput t: f32[H] learnable\nmask: causal\nscore: score * t[h]\n", 128, "hopper"),
])
def test_deterministic_backward_is_bitwise_repeatable_on_gpu(spec, D, forward, dtype):
    # Every deterministic call's backward is the portable one, after the Hopper forward where that serves it.
    attn = attngen.build(SPECS / f"{spec}.attn" if "\n" not in spec else spec, deterministic=True)
    B, H, HKV, N = 2, 8, 2, 1000  # GQA, a length no tile divides
    torch.manual_seed(0)
    q, k, v = testing.random_qkv(B, H, HKV, N, N, D, D, dtype, device="cuda")
    inputs = testing.random_inputs(attn.spec, B, H, HKV, N, N, device="cuda")
    leaves = [q, k, v, *(inputs[i.name] for i in attn.spec.learnable_inputs)]
    for t in leaves:
        t.requires_grad_()
    assert attn.forward_family(q, k, v, **inputs) == forward
    assert attn.backward_family(q, k, v, **inputs) == "portable"
    assert attn.backward_family(q, k, v, deterministic=False, **inputs) == forward
    dout = torch.randn(B, H, N, D, device="cuda", dtype=dtype)
    first = torch.autograd.grad(attn(q, k, v, **inputs), leaves, dout)
    for _ in range(4):
        again = torch.autograd.grad(attn(q, k, v, **inputs), leaves, dout)
        assert all(torch.equal(a, b) for a, b in zip(first, again))
    testing.check_against_reference(attn.spec, attn, q, k, v, inputs)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("spec, D", [("learned_rel_bias", 128), ("causal", 64), ("causal", 256)])
def test_a_deterministic_call_with_dropout_after_the_hopper_forward_is_repeatable_and_right(spec, D):
    # The Hopper forward, then the portable backward regenerating its keep-mask; the same generator state every
    # run, so the same mask.
    attn = attngen.build(SPECS / f"{spec}.attn", deterministic=True)
    B, H, HKV, N, p = 2, 8, 2, 1000, 0.8
    torch.manual_seed(0)
    q, k, v = testing.random_qkv(B, H, HKV, N, N, D, D, torch.bfloat16, device="cuda")
    inputs = testing.random_inputs(attn.spec, B, H, HKV, N, N, device="cuda")
    leaves = [q, k, v, *(inputs[i.name] for i in attn.spec.learnable_inputs)]
    for t in leaves:
        t.requires_grad_()
    assert attn.forward_family(q, k, v, dropout_p=p, **inputs) == "hopper"
    assert attn.backward_family(q, k, v, **inputs) == "portable"
    dout = torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16)

    def grads():
        generator = torch.Generator(device="cuda").manual_seed(3)
        return torch.autograd.grad(attn(q, k, v, dropout_p=p, generator=generator, **inputs), leaves, dout)
    first = grads()
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(first, grads()))
    testing.check_against_reference(attn.spec, attn, q, k, v, inputs, seed=3, dropout_p=p)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
def test_a_deterministic_packed_call_after_the_hopper_forward_is_repeatable_and_right():
    attn = attngen.build(SPECS / "learned_rel_bias.attn", deterministic=True)
    lengths, H, D = [700, 129, 1500, 64], 8, 128
    total = sum(lengths)
    torch.manual_seed(0)
    q, k, v = (torch.randn(total, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    table = (torch.randn(H, 257, device="cuda") * 0.5).requires_grad_()
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
    packed = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths), max_seqlen_k=max(lengths))
    assert attn.forward_family(q, k, v, table=table, **packed) == "hopper"
    assert attn.backward_family(q, k, v, table=table, **packed) == "portable"
    dout = torch.randn(total, H, D, device="cuda", dtype=torch.bfloat16)
    leaves = [q, k, v, table]
    first = torch.autograd.grad(attn(q, k, v, table=table, **packed), leaves, dout)
    for _ in range(4):
        again = torch.autograd.grad(attn(q, k, v, table=table, **packed), leaves, dout)
        assert all(torch.equal(a, b) for a, b in zip(first, again))
    testing.check_against_reference(attn.spec, attn, q, k, v, {"table": table}, packed=packed)


@pytest.mark.gpu
def test_a_compiled_deterministic_backward_is_repeatable():
    attn = attngen.build(SPECS / "learned_rel_bias.attn", deterministic=True)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 8, 512, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    table = (torch.randn(8, 257, device="cuda") * 0.5).requires_grad_()
    step = torch.compile(functools.partial(attn, table=table), fullgraph=True)
    dout = torch.randn_like(q)
    first = torch.autograd.grad(step(q, k, v), [q, k, v, table], dout)
    again = torch.autograd.grad(step(q, k, v), [q, k, v, table], dout)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    eager = torch.autograd.grad(attn(q, k, v, table=table), [q, k, v, table], dout)
    assert all(torch.equal(a, b) for a, b in zip(first, eager))
