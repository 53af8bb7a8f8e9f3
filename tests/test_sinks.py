"""The `sink:` item end to end: its errors, the reference's meaning (O = 0 and LSE = sink on a row with no key),
the runtime's evaluation of the sink against the reference's, and the kernels' calls (training with the
learnable sink's gradient, GQA, cache, paged, packed and compiled calls) against the float64 reference."""

import itertools

import pytest
import torch

import attngen
from attngen import reference, testing
from attngen.emit.module import sink_literal
from attngen.errors import SpecError
from attngen.families.decode import runtime as decode_runtime
from attngen.frontend.printer import to_source
from attngen.runtime.sinks import sink_rows
from attngen.testing import strategies
from conftest import CPU_CALLS, rows_case

# Reads b, h, q, KV_LEN, a param and a learnable input; its mask leaves the last rows of a square call
# without a key (k > q + 2), and cuts each batch row's keys at lens[b].
ROWS = """
attention sink_rows
param base = 0.5
input bias: f32[B, H] learnable
input lens: i32[B]
mask: k > q + 2 and k < lens[b]
sink: bias[b, h] * base + 0.01 * (q + 1.0 * KV_LEN) - 0.02 * b
"""
# A sink of the packed call's own terms: the sequence (b), positions from 0, and its lengths.
PACKED = """
attention sink_packed
input bias: f32[B, H] learnable
mask: causal and q - k < 5
sink: bias[b, h] + 0.1 * q - 0.05 * Q_LEN + 0.02 * KV_LEN
"""


def _spec(text):
    return attngen.parse_spec(text)


# --- the language --------------------------------------------------------------------------------

@pytest.mark.parametrize("text, message, column", [
    ("sink: 1.0 * k", "'sink' may not use 'k'", 13),
    ("sink: score", "'sink' may not use 'score'", 7),
    ("sink: q > 1", "sink must be a float expression, got bool", 7),
    ("sink: h", r"sink must be a float expression, got int \(write a float", 7),
    # The number checks of every item hold for a sink too: it runs exactly or not at all.
    ("sink: 1.0 * (q // 0)", "the divisor of '//' must not be a constant zero", 14),
    ("sink: 1.0 * (q * q * q * q * q * q * q * q)", "must fit in int64 at lengths up to 1024", 14),
])
def test_bad_sinks_are_refused_where_they_are(text, message, column):
    with pytest.raises(SpecError, match=message) as e:
        attngen.parse_spec(f"attention t\n{text}\n", "t.attn")
    assert str(e.value).startswith(f"t.attn:2:{column}:")


def test_a_second_sink_is_refused():
    with pytest.raises(SpecError, match=r"t.attn:3:1: duplicate 'sink:' \(the first is at line 2\)"):
        attngen.parse_spec("attention t\nsink: 1.0\nsink: 2.0\n", "t.attn")


def test_a_sink_prints_back_and_keeps_specs_without_one_as_they_were():
    spec = _spec(ROWS)
    assert attngen.parse_spec(to_source(spec)) == spec
    assert "sink: " in to_source(spec)
    # An input may still be named `sink`: the item's keyword is one only where an item begins.
    assert _spec("attention t\ninput sink: f32[H]\nsink: sink[h]\n").sink.input == "sink"
    plain = _spec("attention t\nmask: causal\n")
    assert plain.sink is None and "sink" not in plain.model_dump_json(exclude={"sink"})


def test_explain_shows_the_sink_and_where_it_runs():
    from attngen import api
    text = api.explain(ROWS, q_len=32, kv_len=32, head_dim=16, head_dim_v=16, dtype="f32").text
    assert "  sink: " in text and "start each row's softmax at it" in text
    assert "  sink: " not in api.explain("attention t\nmask: causal\n", q_len=32, kv_len=32, head_dim=16,
                                         head_dim_v=16, dtype="f32").text


def test_the_reference_gives_a_row_without_keys_zero_and_its_sink():
    spec = _spec(ROWS)
    q, k, v = testing.random_qkv(2, 2, 1, 9, 9, 8, 8, torch.float64)
    inputs = testing.random_inputs(spec, 2, 2, 1, 9, 9)
    inputs["lens"] = torch.tensor([9, 4], dtype=torch.int32)
    out, lse = reference.evaluate(spec, q, k, v, inputs)
    sink = reference.sink_logits(spec, q, k, v, inputs)
    empty = ~torch.isfinite(reference.modified_scores(spec, q, k, v, inputs)).any(-1)
    assert empty.any() and (~empty).any()
    assert (out[empty] == 0).all() and torch.equal(lse[empty], sink[empty])
    # Elsewhere the sink is one more term of the softmax's sum.
    plain = reference.evaluate(spec.model_copy(update={"sink": None}), q, k, v, inputs)[1]
    torch.testing.assert_close(lse[~empty], torch.logaddexp(plain, sink)[~empty])


# --- the runtime's sink is the reference's ---------------------------------------------------------

SINK_EXPRESSIONS = [
    "sinks[h]",
    "tanh(table[hkv, q % 3]) * 2.0 - sqrt(abs(sinks[h]) + 1.0)",
    "where(q < Q_LEN // 2, 1.5, -inf) + exp2(1.0 * (b - B)) + log(1.0 + H * HKV)",
    "max(sinks[h], 0.25) + clamp(q - KV_LEN, -3, 3) + floor(q / 2.0) ** 2 + ((q << 2) ^ 5) % 7",
    "softcap(sinks[h] * 10.0, 3.0) + sign(q - 4.5) + round(q * 0.3) + erf(q * 0.1) + atan(1.0 * D)",
    # Loads of a whole input along the rows' axes (transposed here) beside gathers.
    "bt[h, b] * 0.5 + sinks[q % H] - bt[h, 1]",
]


@pytest.mark.parametrize("expression", SINK_EXPRESSIONS)
def test_the_runtime_evaluates_a_sink_as_the_reference_does(expression):
    spec = _spec(f"attention t\ninput sinks: f32[H]\ninput table: f32[HKV, 3]\ninput bt: f32[H, B]\nsink: {expression}\n")
    tree = eval(sink_literal(spec.sink, spec.param_values), {"__builtins__": {}})  # a literal: data only
    B, H, HKV, N, M, D = 2, 4, 2, 7, 11, 8
    q, k, v = testing.random_qkv(B, H, HKV, N, M, D, D, torch.float32)
    inputs = testing.random_inputs(spec, B, H, HKV, N, M)
    sizes = dict(B=B, H=H, HKV=HKV, Q_LEN=N, KV_LEN=M, D=D, device="cpu")
    torch.testing.assert_close(sink_rows(tree, inputs, **sizes), reference.sink_logits(spec, q, k, v, inputs))
    kv_len, q_offset = torch.tensor([9, 11], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32)
    torch.testing.assert_close(sink_rows(tree, inputs, **sizes, kv_len=kv_len, q_offset=q_offset),
                               reference.sink_logits(spec, q, k, v, inputs, kv_len=kv_len, q_offset=q_offset))


# --- the kernels' calls ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rows():
    return attngen.build(ROWS)


@CPU_CALLS
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_training_calls_with_rows_without_keys_match_the_reference(rows, dtype):
    q, k, v, inputs = rows_case(rows, dtype=dtype)  # GQA: two query heads a kv head
    testing.check_against_reference(rows.spec, rows, q, k, v, inputs)
    out, lse = rows(q, k, v, return_lse=True, **inputs)
    sink = reference.sink_logits(rows.spec, q, k, v, inputs).float()
    empty = ~torch.isfinite(reference.modified_scores(rows.spec, q, k, v, inputs)).any(-1)
    assert empty.any()
    assert (out[empty] == 0).all() and not out.isnan().any()
    torch.testing.assert_close(lse[empty], sink[empty], rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def minus_inf():
    """A spec whose sink is -inf on every other row, beside rows without keys (k > q + 2: the last three of
    12), and a call's q, k, v and inputs: row 10 has neither a key nor a sink."""
    attn = attngen.build("attention no_sink\ninput bias: f32[H] learnable\nmask: k > q + 2\n"
                         "sink: where(q % 2 == 0, -inf, bias[h])\n")
    q, k, v = testing.random_qkv(1, 2, 2, 12, 12, 16, 16, torch.float32)
    return attn, q, k, v, testing.random_inputs(attn.spec, 1, 2, 2, 12, 12)


@CPU_CALLS
def test_a_sink_of_minus_inf_is_no_sink_even_on_rows_without_keys(minus_inf):
    attn, *tensors, inputs = minus_inf
    q, k, v, bias = (t.clone() for t in (*tensors, inputs["bias"]))  # the fixture's stay without grad
    inputs = inputs | {"bias": bias}
    testing.check_against_reference(attn.spec, attn, q, k, v, inputs)
    leaves = [x.requires_grad_() for x in (q, k, v, inputs["bias"])]
    out, lse = attn(q, k, v, return_lse=True, **inputs)
    assert torch.isneginf(lse[..., 10]).all() and (out[..., 10, :] == 0).all()  # no key and no sink
    grads = torch.autograd.grad(out.sum() + torch.where(lse.isfinite(), lse, 0.0).sum(), leaves)
    assert not any(g.isnan().any() for g in grads)


@CPU_CALLS
def test_a_sink_of_minus_inf_is_no_sink_in_cache_and_packed_calls(minus_inf):
    # The decode family's merge and the packed kernels start at the sink too.
    attn, q, k, v, inputs = minus_inf
    cache = {"kv_len": torch.tensor([12], dtype=torch.int32), "q_offset": torch.tensor([10], dtype=torch.int32)}
    assert attn.forward_family(q[:, :, :2], k, v, **cache, **inputs) == "decode"
    testing.check_against_reference(attn.spec, attn, q[:, :, :2], k, v, inputs, grads=False, cache=cache)
    with torch.no_grad():
        out, lse = attn(q[:, :, :2], k, v, return_lse=True, **cache, **inputs)
    assert torch.isneginf(lse[..., 0]).all() and (out[..., 0, :] == 0).all()
    packed = dict(cu_seqlens_q=torch.tensor([0, 12], dtype=torch.int32), cu_seqlens_k=torch.tensor([0, 12], dtype=torch.int32),
                  max_seqlen_q=12, max_seqlen_k=12)
    pq, pk, pv = (t[0].transpose(0, 1).contiguous() for t in (q, k, v))  # (TOTAL, heads, D)
    testing.check_against_reference(attn.spec, attn, pq, pk, pv, inputs, packed=packed)
    out, lse = attn(pq, pk, pv, return_lse=True, **packed, **inputs)
    assert torch.isneginf(lse[:, 10]).all() and (out[10] == 0).all() and not out.isnan().any()


@CPU_CALLS
def test_the_sinks_gradient_through_the_lse_alone_matches_the_reference(rows):
    # A loss on LSE only: no gradient reaches O (dO is None in the autograd node), the sink's comes from dLSE.
    q, k, v, inputs = rows_case(rows, N=13, M=13)
    weights = torch.randn(2, 4, 13, generator=torch.Generator().manual_seed(3))

    def loss(attention, q, k, v, inputs):
        _, lse = attention(q, k, v, return_lse=True, **inputs)
        return (torch.where(lse.isfinite(), lse, 0.0) * weights.to(lse.dtype)).sum()

    bias = inputs["bias"].clone().requires_grad_()
    got = torch.autograd.grad(loss(rows, q, k, v, inputs | {"bias": bias}), bias)[0]
    bias64 = inputs["bias"].double().requires_grad_()
    def evaluate(q, k, v, return_lse, **inputs):
        return reference.evaluate(rows.spec, q, k, v, inputs)
    want = torch.autograd.grad(loss(evaluate, q.double(), k.double(), v.double(), inputs | {"bias": bias64}), bias64)[0]
    assert want.abs().sum() > 0
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_only_a_spec_with_a_sink_gives_its_forward_kernels_the_sink_rows():
    # The sink enters every family's forward: the portable and Hopper kernels as a pointer of their own (a
    # spec without a sink keeps its kernels, parameter for parameter), the decode merge behind HAS_SINK.
    for text, has_sink in ((ROWS, True), ("attention t\nmask: causal\n", False)):
        module = attngen.build(text, target="h200").module
        for kernel in (module._fwd_kernel, module._hopper_fwd_kernel):
            assert ("Sink" in kernel.arg_names) == has_sink, (text, kernel)
        assert {"Sink", "HAS_SINK"} <= set(decode_runtime._decode_combine.arg_names)
        assert "Sink" not in module._bwd_kernel.arg_names and "Sink" not in module._hopper_bwd_kernel.arg_names


@CPU_CALLS
def test_cache_calls_match_the_reference(rows):
    q, k, v, inputs = rows_case(rows, M=30)
    kv_len = torch.tensor([30, 19], dtype=torch.int32)
    for n in (1, 5):  # a decoding step and a chunk of prefill: the decode family's merge takes the sink
        cache = {"kv_len": kv_len}
        testing.check_against_reference(rows.spec, rows, q[:, :, :n], k, v, inputs, grads=False, cache=cache)
        cache["q_offset"] = torch.tensor([2, 0], dtype=torch.int32)
        testing.check_against_reference(rows.spec, rows, q[:, :, :n], k, v, inputs, grads=False, cache=cache)


@CPU_CALLS
def test_a_long_cache_chunk_takes_the_sink_in_the_portable_forward(rows):
    q, k, v, inputs = rows_case(rows, N=40, M=48)
    cache = {"kv_len": torch.tensor([48, 45], dtype=torch.int32)}
    assert rows.forward_family(q, k, v, **cache, **inputs) == "portable"
    testing.check_against_reference(rows.spec, rows, q, k, v, inputs, grads=False, cache=cache)


@CPU_CALLS
def test_paged_cache_calls_match_the_reference(rows):
    q, k, v, inputs = rows_case(rows, N=3, M=32)
    kv_len = torch.tensor([32, 23], dtype=torch.int32)
    k_pages, v_pages, table = strategies.paged(k, v, 16, seed=1)
    with torch.no_grad():
        out, lse = rows(q, k_pages, v_pages, page_table=table, kv_len=kv_len, return_lse=True, **inputs)
    want, want_lse = reference.evaluate(rows.spec, q.double(), k.double(), v.double(), inputs, kv_len=kv_len)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)


def _packed_case(attn, lengths_q=(5, 17, 9), lengths_k=(7, 17, 12), H=4, HKV=2, D=16):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lengths_q), H, D, generator=g)
    k, v = (torch.randn(sum(lengths_k), HKV, D, generator=g) for _ in range(2))

    def offsets(lengths):
        return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    packed = dict(cu_seqlens_q=offsets(lengths_q), cu_seqlens_k=offsets(lengths_k), max_seqlen_q=max(lengths_q),
                  max_seqlen_k=max(lengths_k))
    return q, k, v, testing.random_inputs(attn.spec, len(lengths_q), H, HKV, max(lengths_q), max(lengths_k)), packed


@CPU_CALLS
def test_packed_calls_match_the_reference_of_each_sequence():
    attn = attngen.build(PACKED)
    q, k, v, inputs, packed = _packed_case(attn)
    testing.check_against_reference(attn.spec, attn, q, k, v, inputs, packed=packed)


def _compiled_loss(rows, dynamic):
    def loss(q, k, v, inputs):
        out, lse = rows(q, k, v, return_lse=True, **inputs)
        return out.square().sum() + lse.sum()
    return loss, torch.compile(loss, backend="aot_eager", fullgraph=True, dynamic=dynamic)


def _assert_compiled_equals_eager(rows, loss, compiled, n):
    q, k, v, inputs = rows_case(rows, N=n, M=n)
    leaves = [x.requires_grad_() for x in (q, k, v, inputs["bias"])]
    want = torch.autograd.grad(loss(q, k, v, inputs), leaves)
    got = torch.autograd.grad(compiled(q, k, v, inputs), leaves)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert want[3].abs().sum() > 0  # the sink's gradient reached its input


@CPU_CALLS
def test_compiled_calls_equal_eager_with_the_sinks_gradient(rows, fresh_dynamo):
    _assert_compiled_equals_eager(rows, *_compiled_loss(rows, dynamic=False), 17)


@CPU_CALLS
def test_compiled_packed_and_cache_calls_equal_eager(fresh_dynamo):
    attn = attngen.build(PACKED)
    q, k, v, inputs, packed = _packed_case(attn)

    def loss(q, k, v, bias):
        out, lse = attn(q, k, v, return_lse=True, bias=bias, **packed)
        return out.square().sum() + lse.sum()

    grads = []
    for fn in (loss, torch.compile(loss, backend="aot_eager", fullgraph=True)):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, inputs["bias"])]
        grads.append(torch.autograd.grad(fn(*leaves), leaves))
    assert all(torch.equal(a, b) for a, b in zip(*grads)) and grads[0][3].abs().sum() > 0
    q, k, v = testing.random_qkv(2, 4, 2, 3, 20, 16, 16, torch.float32)
    inputs = testing.random_inputs(attn.spec, 2, 4, 2, 3, 20)
    kv_len = torch.tensor([20, 11], dtype=torch.int32)

    def step(q, k, v, bias):
        return attn(q, k, v, kv_len=kv_len, return_lse=True, bias=bias)

    with torch.no_grad():
        for got, want in zip(torch.compile(step, backend="aot_eager", fullgraph=True)(q, k, v, inputs["bias"]),
                             step(q, k, v, inputs["bias"])):
            assert torch.equal(got, want)


@CPU_CALLS
def test_opcheck_of_the_operators_with_a_sink(rows):
    # The fakes of the forward, cache and packed operators given the sink's rows, and of the sink rows'
    # gradient, announce what they return.
    q, k, v, inputs = rows_case(rows, N=12, M=12)
    runtime = rows.module.ATTENTION
    _, forward_op, _, cache_op, packed_op, _, sink_grad_op = rows.module.OPERATORS
    tensors = [inputs[i.name] for i in rows.spec.inputs]
    sink = runtime._sink_rows(q, k, inputs)
    torch.library.opcheck(forward_op, (q, k, v, tensors, [], [sink], [], 0.0), test_utils=("test_schema", "test_faketensor"))
    out, lse = forward_op(q, k, v, tensors, [], [sink], [], 0.0)
    do = torch.randn(2, 4, 16, 12).transpose(2, 3)  # dO in another layout than O's
    for dlse in ([], [torch.randn_like(lse)]):
        torch.library.opcheck(sink_grad_op, (out, do, dlse, lse, sink))
    kv_len = torch.tensor([12, 7], dtype=torch.int32)
    cached = runtime._sink_rows(q[:, :, :2], k, inputs, cache=(kv_len, kv_len - 2, False))
    torch.library.opcheck(cache_op, (q[:, :, :2], k, v, tensors, [kv_len], [kv_len - 2], [], [cached]),
                          test_utils=("test_schema", "test_faketensor"))
    attn = attngen.build(PACKED)
    q, k, v, inputs, packed = _packed_case(attn)
    tensors = [inputs["bias"]]
    sink = attn.module.ATTENTION._sink_rows(q, k, inputs, packed=(packed["cu_seqlens_q"], packed["cu_seqlens_k"]))
    assert sink.shape == (4, q.shape[0])
    torch.library.opcheck(attn.module.OPERATORS[4], (q, k, v, tensors, *packed.values(), [sink], [], 0.0),
                          test_utils=("test_schema", "test_faketensor"))


# A sink read at (b, h) alone (its rows are the input viewed, attngen.runtime.sinks.whole_load), and the same
# sink through the general evaluator; a window of 9 on causal rows.
SPECIAL = {"whole": "attention special\ninput bias: f32[B, H] learnable\nmask: causal and q - k < 9\nsink: bias[b, h]\n",
           "evaluated": "attention special_evaluated\ninput bias: f32[B, H] learnable\nmask: causal and q - k < 9\n"
                        "sink: bias[b, h] + 0.0 * q\n"}
INF, NAN = float("inf"), float("nan")
# Per (b, h): finite, +inf (all of the row's weight: O = 0, LSE = +inf), -inf (no sink), NaN (a NaN row).
SPECIAL_BIAS = [[0.5, INF, -INF, NAN], [NAN, -1.0, INF, 2.0]]


def _assert_rows_match(got, want):
    # Within float32's reach of the float64 reference, with NaN and infinities exactly where it has them.
    for x, y in zip(got, want):
        torch.testing.assert_close(x.double(), y.double(), equal_nan=True, rtol=1e-4, atol=1e-5)


@CPU_CALLS
@pytest.mark.parametrize("variant", sorted(SPECIAL))
def test_infinite_and_nan_sinks_give_the_reference_rows_on_every_path(variant):
    attn = attngen.build(SPECIAL[variant])
    assert (attn.module.ATTENTION.sink_load is not None) == (variant == "whole")
    B, H, HKV, N, M, D = 2, 4, 2, 40, 48, 16
    q, k, v = testing.random_qkv(B, H, HKV, N, M, D, D, torch.float32)
    inputs = {"bias": torch.tensor(SPECIAL_BIAS)}
    with torch.no_grad():
        _assert_rows_match(attn(q, k, v, return_lse=True, **inputs), reference.evaluate(attn.spec, q, k, v, inputs))
        for n, family in ((1, "decode"), (N, "portable")):  # the decode family's merge, the portable forward
            cache = {"kv_len": torch.tensor([M, M - 3], dtype=torch.int32)}
            assert attn.forward_family(q[:, :, :n], k, v, **cache, **inputs) == family
            _assert_rows_match(attn(q[:, :, :n], k, v, return_lse=True, **cache, **inputs),
                               reference.evaluate(attn.spec, q[:, :, :n], k, v, inputs, **cache))
        packed_bias = {"bias": torch.tensor(SPECIAL_BIAS + [[INF, NAN, -INF, 0.0]])}
        pq, pk, pv, _, packed = _packed_case(attn)
        _assert_rows_match(attn(pq, pk, pv, return_lse=True, **packed, **packed_bias),
                           reference.evaluate_packed(attn.spec, pq, pk, pv, packed_bias, **packed))
    out, lse = attn(q, k, v, return_lse=True, **inputs)
    assert (out[0, 1] == 0).all() and torch.isposinf(lse[0, 1]).all()
    assert out[0, 3].isnan().all() and lse[0, 3].isnan().all()


@CPU_CALLS
@pytest.mark.parametrize("variant", sorted(SPECIAL))
def test_gradients_through_infinite_sinks_match_the_reference(variant):
    # A +inf row passes no gradient to q, k and v (P = 0 there) and its LSE's to the sink (its weight is 1);
    # -inf is no sink. (A NaN sink's row is NaN, and so is every gradient it reaches.)
    attn = attngen.build(SPECIAL[variant])
    B, H, HKV, N, D = 2, 4, 2, 21, 16
    q, k, v = testing.random_qkv(B, H, HKV, N, N, D, D, torch.float32)
    inputs = {"bias": torch.tensor([[0.5, INF, -INF, 1.0], [-1.0, INF, 2.0, -INF]])}
    testing.check_against_reference(attn.spec, attn, q, k, v, inputs)
    pq, pk, pv, _, packed = _packed_case(attn)
    packed_bias = {"bias": torch.tensor([[INF, 0.5, -INF, 1.0], [-1.0, 1.0, INF, 2.0], [-INF, INF, 0.0, 3.0]])}
    testing.check_against_reference(attn.spec, attn, pq, pk, pv, packed_bias, packed=packed)
    # The sink's gradient from LSE alone: its weight is 1 on a +inf row, so dLSE itself, and 0 on a -inf one.
    bias = inputs["bias"].clone().requires_grad_()
    _, lse = attn(q, k, v, return_lse=True, bias=bias)
    weights = torch.randn_like(lse)
    (grad,) = torch.autograd.grad(lse, bias, weights)
    assert torch.allclose(grad[0, 1], weights[0, 1].sum()) and grad[1, 3] == 0


@CPU_CALLS
@pytest.mark.parametrize("variant", sorted(SPECIAL))
def test_infinite_and_nan_sinks_with_dropout_match_the_reference(variant):
    # Dropout drops the keys' weights after the softmax the sink takes part in: a +inf row keeps O = 0 and
    # LSE = +inf (all its weight is the sink's, which has no value to drop), a NaN row stays NaN, -inf is no
    # sink; out, LSE and every gradient (the sink's through LSE and delta) as the reference with the call's mask.
    attn = attngen.build(SPECIAL[variant])
    B, H, HKV, N, D = 2, 4, 2, 21, 16
    q, k, v = testing.random_qkv(B, H, HKV, N, N, D, D, torch.float32)
    with torch.no_grad():
        inputs = {"bias": torch.tensor(SPECIAL_BIAS)}
        mask = attn.dropout_mask(q, k, v, dropout_p=0.5, generator=torch.Generator().manual_seed(2), **inputs)
        got = attn(q, k, v, return_lse=True, dropout_p=0.5, generator=torch.Generator().manual_seed(2), **inputs)
        _assert_rows_match(got, reference.evaluate(attn.spec, q, k, v, inputs, dropout_p=0.5, dropout_mask=mask))
        assert (got[0][0, 1] == 0).all() and torch.isposinf(got[1][0, 1]).all() and got[0][0, 3].isnan().all()
    finite = {"bias": torch.tensor([[0.5, INF, -INF, 1.0], [-1.0, INF, 2.0, -INF]])}
    testing.check_against_reference(attn.spec, attn, q, k, v, finite, seed=2, dropout_p=0.5)
    pq, pk, pv, _, packed = _packed_case(attn)
    packed_bias = {"bias": torch.tensor([[INF, 0.5, -INF, 1.0], [-1.0, 1.0, INF, 2.0], [-INF, INF, 0.0, 3.0]])}
    testing.check_against_reference(attn.spec, attn, pq, pk, pv, packed_bias, packed=packed, seed=3, dropout_p=0.3)


@CPU_CALLS
def test_a_sink_read_at_the_head_is_its_input_viewed_with_no_copy():
    attn = attngen.build("attention per_head\ninput sinks: f32[H] learnable\nmask: causal\nsink: sinks[h]\n")
    q, k, v = testing.random_qkv(2, 4, 2, 9, 9, 16, 16, torch.float32)
    sinks = torch.randn(4)
    rows = attn.module.ATTENTION._sink_rows(q, k, {"sinks": sinks})
    assert rows.shape == (2, 4, 9) and rows.stride() == (0, 1, 0) and rows.data_ptr() == sinks.data_ptr()
    packed = (torch.tensor([0, 4, 9], dtype=torch.int32),) * 2
    rows = attn.module.ATTENTION._sink_rows(q[0].transpose(0, 1), k[0].transpose(0, 1), {"sinks": sinks}, packed=packed)
    assert rows.shape == (4, 9) and rows.stride() == (1, 0) and rows.data_ptr() == sinks.data_ptr()
    testing.check_against_reference(attn.spec, attn, q, k, v, {"sinks": sinks})


@CPU_CALLS
@pytest.mark.slow
def test_compiled_sinks_take_dynamic_lengths_without_a_recompile(rows, fresh_dynamo):
    loss, compiled = _compiled_loss(rows, dynamic=True)
    for n in (17, 24):
        _assert_compiled_equals_eager(rows, loss, compiled, n)
        torch.compiler.set_stance("fail_on_recompile")  # a second length that recompiles raises


ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
# Sinks the Hopper family's forward starts its rows at: gpt-oss's (a window of 128, a sink per head), one
# on causal attention, and one of -inf on every other row beside rows without keys (k > q + 2).
HOPPER_SINKS = {
    "gpt_oss_sinks": "specs/gpt_oss_sinks.attn",
    "causal_sink": "attention causal_sink\ninput sinks: f32[H] learnable\nmask: causal\nsink: sinks[h]\n",
    "minus_inf_rows": "attention minus_inf_rows\ninput sinks: f32[H] learnable\nmask: k > q + 2\n"
                      "sink: where(q % 2 == 0, -inf, sinks[h] + 0.01 * q)\n",
}


def _hopper_sink_inputs(H):
    # Sinks from well below to well above a row's LSE (about log of its keys), so some rows' weight goes
    # mostly to the sink and the test sees it.
    return {"sinks": torch.linspace(-4.0, 9.0, H, device="cuda")}


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(HOPPER_SINKS))
@pytest.mark.parametrize("shape", [(2, 8, 2, 1000, 1000), (1, 4, 4, 257, 700)], ids=lambda s: "x".join(map(str, s)))
def test_sinks_through_the_hopper_family_on_gpu(name, dtype, shape):
    """The Hopper forward starts each row at its sink; its backward recomputes P from the LSE that holds it:
    out, LSE, dq, dk, dv and the learnable sink's gradient against the float64 reference."""
    B, H, HKV, Q_LEN, KV_LEN = shape
    attn = attngen.build(HOPPER_SINKS[name])
    q, k, v = testing.random_qkv(B, H, HKV, Q_LEN, KV_LEN, 128, 128, dtype, device="cuda")
    inputs = _hopper_sink_inputs(H)
    assert attn.forward_family(q, k, v, **inputs) == "hopper" and attn.backward_family(q, k, v, **inputs) == "hopper"
    out = attn(q, k, v, **inputs)
    assert not out.isnan().any()
    testing.check_against_reference(attn.spec, attn, q, k, v, inputs)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", ["gpt_oss_sinks", "packed"])
def test_packed_calls_with_a_sink_through_the_hopper_family_on_gpu(name, dtype):
    # Sequences empty, single, ragged and several tiles long; the packed spec's sink reads q and the lengths.
    attn = attngen.build(HOPPER_SINKS["gpt_oss_sinks"] if name == "gpt_oss_sinks" else PACKED)
    lengths = [300, 1, 0, 700, 77, 129]
    H, HKV, D = 8, 2, 128
    g = torch.Generator().manual_seed(1)
    q = torch.randn(sum(lengths), H, D, generator=g).to("cuda", dtype)
    k, v = (torch.randn(sum(lengths), HKV, D, generator=g).to("cuda", dtype) for _ in range(2))
    offsets = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
    packed = dict(cu_seqlens_q=offsets, cu_seqlens_k=offsets, max_seqlen_q=max(lengths), max_seqlen_k=max(lengths))
    if name == "gpt_oss_sinks":
        inputs = _hopper_sink_inputs(H)
    else:
        inputs = testing.random_inputs(attn.spec, len(lengths), H, HKV, max(lengths), max(lengths), device="cuda")
    assert attn.forward_family(q, k, v, **packed, **inputs) == "hopper"
    assert attn.backward_family(q, k, v, **packed, **inputs) == "hopper"
    testing.check_against_reference(attn.spec, attn, q, k, v, inputs, packed=packed)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_sinks_on_gpu(dtype):
    """On the GPU, whatever families the device's plan picks (Hopper's on an H100/H200, decode for the
    cache call): training with rows without keys and the sink's gradient, and a decoding step."""
    attn = attngen.build(ROWS)
    B, H, HKV, N, D = 2, 8, 2, 300, 128
    q, k, v = testing.random_qkv(B, H, HKV, N, N, D, D, dtype, device="cuda")
    inputs = testing.random_inputs(attn.spec, B, H, HKV, N, N, device="cuda")
    inputs["lens"] = torch.tensor([N, N // 2], dtype=torch.int32, device="cuda")
    testing.check_against_reference(attn.spec, attn, q, k, v, inputs)
    kv_len = torch.tensor([N, N - 37], dtype=torch.int32, device="cuda")
    testing.check_against_reference(attn.spec, attn, q[:, :, :1], k, v, inputs, grads=False, cache={"kv_len": kv_len})


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("variant", sorted(SPECIAL))
def test_infinite_and_nan_sinks_through_the_hopper_and_decode_families_on_gpu(variant, dtype):
    attn = attngen.build(SPECIAL[variant])
    B, H, HKV, N, D = 2, 4, 2, 300, 128
    q, k, v = testing.random_qkv(B, H, HKV, N, N, D, D, dtype, device="cuda")
    inputs = {"bias": torch.tensor(SPECIAL_BIAS, device="cuda")}
    assert attn.forward_family(q, k, v, **inputs) == "hopper"
    with torch.no_grad():
        out, lse = attn(q, k, v, return_lse=True, **inputs)
        want_out, want_lse = reference.evaluate(attn.spec, q.double(), k.double(), v.double(), inputs)
        torch.testing.assert_close(lse.double(), want_lse, equal_nan=True, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(out.double(), want_out, equal_nan=True, rtol=2e-2, atol=2e-2)
        cache = {"kv_len": torch.tensor([N, N - 37], dtype=torch.int32, device="cuda")}
        assert attn.forward_family(q[:, :, :1], k, v, **cache, **inputs) == "decode"
        out, lse = attn(q[:, :, :1], k, v, return_lse=True, **cache, **inputs)
        want_out, want_lse = reference.evaluate(attn.spec, q[:, :, :1].double(), k.double(), v.double(), inputs, **cache)
        torch.testing.assert_close(lse.double(), want_lse, equal_nan=True, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(out.double(), want_out, equal_nan=True, rtol=2e-2, atol=2e-2)
    finite = {"bias": torch.tensor([[0.5, INF, -INF, 1.0], [-1.0, INF, 2.0, -INF]], device="cuda")}
    testing.check_against_reference(attn.spec, attn, q, k, v, finite)
    testing.check_against_reference(attn.spec, attn, q, k, v, finite, seed=2, dropout_p=0.3)


@pytest.mark.gpu
def test_a_decoding_step_with_a_sink_replays_in_a_cuda_graph():
    # The sink's rows are made on the device (no host copy, which would fail the capture), and read the
    # lengths and offsets a serving loop updates in place.
    attn = attngen.build(ROWS)
    B, H, HKV, M, D = 2, 8, 2, 256, 64
    q, k, v = testing.random_qkv(B, H, HKV, 1, M, D, D, torch.bfloat16, device="cuda")
    inputs = testing.random_inputs(attn.spec, B, H, HKV, 1, M, device="cuda")
    inputs["lens"] = torch.tensor([M, M // 2], dtype=torch.int32, device="cuda")
    kv_len = torch.tensor([M, 10], dtype=torch.int32, device="cuda")
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(stream):
        attn(q, k, v, kv_len=kv_len, **inputs)  # compiles the kernels outside the capture
        with torch.cuda.graph(graph, stream=stream):
            out = attn(q, k, v, kv_len=kv_len, **inputs)
    torch.cuda.current_stream().wait_stream(stream)
    for lengths in ([M, 10], [3, M - 1], [100, 200]):
        kv_len.copy_(torch.tensor(lengths, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        with torch.no_grad():
            assert torch.equal(out, attn(q, k, v, kv_len=kv_len, **inputs))
        want, _ = reference.evaluate(attn.spec, q.double(), k.double(), v.double(), inputs, kv_len=kv_len)
        torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
