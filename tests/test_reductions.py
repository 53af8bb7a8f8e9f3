"""Reductions over whole dims of an input (`sum(x[b, :])`, max, min, mean): parsed, printed back, typed, and
their kernels match the float64 reference forward and backward, in the score, the mask and the sink."""

import pytest
import torch

import attngen
from attngen import SpecError, testing
from attngen.frontend.printer import to_source
from attngen.reference import make_env, evaluate_expr
from conftest import CPU_CALLS

B, H, HKV, N, D = 2, 2, 1, 20, 16


def _check(text, inputs=None, **kwargs):
    attn = attngen.build(text)
    q, k, v = testing.random_qkv(B, H, HKV, N, N, D, D, torch.float32)
    given = testing.random_inputs(attn.spec, B, H, HKV, N, N) | (inputs or {})
    testing.check_against_reference(attn.spec, attn, q, k, v, given, **kwargs)
    return attn, q, k, v, given


@pytest.mark.parametrize("text", [
    "attention r\ninput x: f32[B, H, *]\nscore: score + max(x[b, h, :]) - min(x[b, h, :])",
    "attention r\ninput x: f32[H, 5, *]\nscore: score * mean(x[h, :, :])",
    "attention r\ninput n: i32[B, 3]\ninput x: f32[*, H]\nmask: k <= sum(n[b, :]) or q >= k\nscore: score + sum(x[:, h])",
    "attention r\ninput flag: bool[B, 4]\nmask: max(flag[b, :]) or min(flag[b, :]) and q >= k",
])
def test_reductions_print_back_as_written(text):
    spec = attngen.parse_spec(text)
    assert attngen.parse_spec(to_source(spec)) == spec
    assert to_source(spec).splitlines()[-1] == text.splitlines()[-1]


def test_types_follow_the_op_and_the_input_dtype():
    spec = attngen.parse_spec("attention r\ninput f: f16[B, *]\ninput n: i32[B, *]\ninput t: bool[B, *]\n"
                              "score: score + sum(f[b, :]) + sum(n[b, :]) + max(n[b, :]) + mean(n[b, :]) + sum(t[b, :])"
                              " + where(max(t[b, :]) and not min(t[b, :]), 1.0, 0.0)")
    types = {(n.op, n.input): n.type for n in attngen.ir.walk(spec.score) if isinstance(n, attngen.ir.Reduce)}
    assert types == {("sum", "f"): "float", ("sum", "n"): "int", ("max", "n"): "int", ("mean", "n"): "float",
                     ("sum", "t"): "int", ("max", "t"): "bool", ("min", "t"): "bool"}


def test_the_reference_reduces_then_indexes():
    spec = attngen.parse_spec("attention r\ninput x: f32[B, 3, H]\ninput t: bool[B, 2]\n"
                              "score: sum(x[b, :, h]) + max(x[b, :, h]) + mean(x[b, :, h]) + min(x[b, :, h]) "
                              "+ sum(t[b, :])")
    x = torch.arange(2 * 3 * 2, dtype=torch.float64).reshape(2, 3, 2)
    t = torch.tensor([[True, True], [False, True]])
    env = make_env(spec, B=2, H=2, HKV=1, Q_LEN=1, KV_LEN=1, D=4, inputs={"x": x, "t": t}, float_dtype=torch.float64)
    got = evaluate_expr(spec.score, env).reshape(2, 2)
    expected = x.sum(1) + x.amax(1) + x.mean(1) + x.amin(1) + t.sum(1, keepdim=True)
    assert torch.equal(got, expected)


def test_a_reduction_read_at_an_index_from_another_input():
    """The kept index of a reduction may read other inputs (prefix[b]), in the reference as in the kernels."""
    spec = attngen.parse_spec("attention r\ninput x: f32[H, 5]\ninput prefix: i32[B]\n"
                              "score: mean(x[:, prefix[b]]) + sum(x[h, :])")
    x = torch.arange(10, dtype=torch.float64).reshape(2, 5)
    prefix = torch.tensor([1, 4], dtype=torch.int32)
    env = make_env(spec, B=2, H=2, HKV=1, Q_LEN=1, KV_LEN=1, D=4, inputs={"x": x, "prefix": prefix},
                   float_dtype=torch.float64)
    got = evaluate_expr(spec.score, env).reshape(2, 2)
    expected = x.mean(0)[prefix.long()].reshape(2, 1) + x.sum(1).reshape(1, 2)
    assert torch.equal(got, expected)


@CPU_CALLS
def test_a_reduction_read_at_an_index_from_another_input_matches_the_kernels():
    _check("attention red_at\ninput x: f32[H, 21] learnable\ninput prefix: i32[B]\nmask: q >= k\n"
           "score: score + mean(x[:, min(prefix[b], 20)]) * (q - k) * 0.1")


@pytest.mark.parametrize("text, where", [
    ("score: score + x[b, :]", "4:21"),
    ("score: score + sum(x[b, 1])", "4:16"),
    ("score: max(x[b, :], 1.0)", "4:17"),
    ("score: score + sum(y[b, :])", "4:20"),
    ("score: score + sum(x[b, 0.5])", "4:16"),
    ("mask: sum(n[b, :]) + 1 > k", "4:7"),
    ("scale: mean(x[0, :])", "4:13"),
])
def test_misplaced_slices_and_reductions_are_positioned_errors(text, where):
    with pytest.raises(SpecError) as e:
        attngen.parse_spec("attention r\ninput x: f32[B, *]\ninput n: i32[B, *]\n" + text)
    assert str(e.value).startswith(f"<spec>:{where}:"), str(e.value)


def test_a_slice_outside_a_reduction_says_where_slices_belong():
    with pytest.raises(SpecError, match=r"':' \(a whole dim\) is only allowed inside sum\(\), max\(\), min\(\) or mean\(\)"):
        attngen.parse_spec("attention r\ninput x: f32[B, *]\nscore: score + x[b, :]")


@CPU_CALLS
@pytest.mark.parametrize("op", ["sum", "max", "min", "mean"])
def test_each_op_of_a_learnable_input_matches_the_reference_forward_and_backward(op):
    # check_against_reference compares out, lse, dq, dk, dv and the learnable input's gradient.
    _check(f"attention red_{op}\ninput x: f32[H, *] learnable\nmask: q >= k\n"
           f"score: score * (1.0 + 0.5 * {op}(x[h, :])) + x[h, 0] * (q - k)")


@CPU_CALLS
def test_int_and_bool_reductions_in_the_mask_match_the_reference():
    n = torch.tensor([[1, 2, 3], [0, 0, 4]], dtype=torch.int32)
    t = torch.tensor([[True, False, True, True], [False, False, False, False]])
    _check("attention red_mask\ninput n: i32[B, 3]\ninput t: bool[B, 4]\n"
           "mask: k <= max(n[b, :]) + sum(t[b, :]) or (max(t[b, :]) and q >= k)\n"
           "score: score + mean(n[b, :]) + min(n[b, :])", {"n": n, "t": t})


@CPU_CALLS
def test_a_mask_reading_a_reduction_at_k_follows_tile_tables_built_from_it():
    attn, q, k, v, given = _check("attention red_table\ninput seen: bool[3, KV_LEN]\nmask: max(seen[:, k]) and q >= k")
    assert attn.module.FACTS.tile_table
    tables = attn.tile_tables(q, k, v, **given)
    torch.testing.assert_close(attn(q, k, v, tile_tables=tables, **given), attn(q, k, v, **given))


@CPU_CALLS
def test_a_reduction_in_the_sink_matches_the_reference():
    _check("attention red_sink\ninput s: f32[H, *] learnable\nmask: q >= k\nsink: max(s[h, :])")


@CPU_CALLS
def test_a_reduction_runs_in_packed_and_cache_calls():
    attn = attngen.build("attention red_calls\ninput x: f32[H, *]\nmask: q >= k\nscore: score + sum(x[h, :])")
    x = torch.randn(H, 3)
    lengths = [7, 13]
    q, k, v = testing.random_qkv(1, H, HKV, sum(lengths), sum(lengths), D, D, torch.float32)
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)
    packed = [t[0].transpose(0, 1).contiguous() for t in (q, k, v)]
    out = attn(*packed, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=13, max_seqlen_k=13, x=x)
    for b, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        row = attn(*(t[:, :, start:end] for t in (q, k, v)), x=x)
        torch.testing.assert_close(out[start:end].transpose(0, 1), row[0])
    kv_len = torch.tensor([N - 4, N], dtype=torch.int32)
    q1, k1, v1 = testing.random_qkv(B, H, HKV, 1, N, D, D, torch.float32)
    cached = attn(q1, k1, v1, kv_len=kv_len, x=x)
    for b in range(B):
        end = int(kv_len[b])
        full = attn(torch.cat([torch.zeros(1, H, end - 1, D), q1[b:b + 1]], dim=2), k1[b:b + 1, :, :end],
                    v1[b:b + 1, :, :end], x=x)
        torch.testing.assert_close(cached[b, :, 0], full[0, :, -1])


@CPU_CALLS
def test_call_errors_name_the_users_input():
    attn = attngen.build("attention red_calls\ninput x: f32[H, *]\nmask: q >= k\nscore: score + sum(x[h, :])")
    q, k, v = testing.random_qkv(B, H, HKV, N, N, D, D, torch.float32)
    with pytest.raises(ValueError, match="input 'x' must have shape"):
        attn(q, k, v, x=torch.randn(H + 1, 3))
    with pytest.raises(ValueError, match="missing input"):
        attn(q, k, v)
    with pytest.raises(ValueError, match="unknown input"):
        attn(q, k, v, x=torch.randn(H, 3), sum0_x=torch.randn(H))


@CPU_CALLS
def test_a_reduction_over_no_elements_is_a_call_error_but_a_sum_is_zero():
    attn = attngen.build("attention red_empty\ninput x: f32[H, *]\nscore: score + max(x[h, :])")
    q, k, v = testing.random_qkv(B, H, HKV, N, N, D, D, torch.float32)
    with pytest.raises(ValueError, match=r"max\(\) over dims \(1,\) of input 'x' must have at least one element"):
        attn(q, k, v, x=torch.empty(H, 0))
    summed = attngen.build("attention red_empty_sum\ninput x: f32[H, *]\nscore: score + sum(x[h, :])")
    torch.testing.assert_close(summed(q, k, v, x=torch.empty(H, 0)), attngen.build("attention full")(q, k, v))


@CPU_CALLS
def test_compiled_calls_equal_eager_with_the_reductions_gradient(fresh_dynamo):
    attn = attngen.build("attention red_compiled\ninput x: f32[H, *] learnable\nmask: q >= k\n"
                         "score: score * (1.0 + 0.25 * max(x[h, :])) + mean(x[h, :]) * (q - k) * 0.1")

    def loss(q, k, v, x):
        return attn(q, k, v, x=x).square().sum()

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True, dynamic=False)
    q, k, v = testing.random_qkv(B, H, HKV, 17, 17, D, D, torch.float32)
    leaves = [t.requires_grad_() for t in (q, k, v, torch.randn(H, 3))]
    want = torch.autograd.grad(loss(*leaves), leaves)
    got = torch.autograd.grad(compiled(*leaves), leaves)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert want[3].abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_reductions_on_gpu(dtype):
    """On the GPU, whatever families the device's plan picks (Hopper's on an H100/H200, decode for the
    cache call): the reductions' tensors are made on q's device, in the dtypes the kernels read."""
    attn = attngen.build("attention red_gpu\ninput x: f32[H, *] learnable\ninput n: i32[B, 4]\n"
                         "mask: k < sum(n[b, :]) + 64 and causal\n"
                         "score: score * (1.0 + 0.25 * max(x[h, :])) + mean(x[h, :]) * min(n[b, :]) * 0.01")
    B, H, HKV, N, D = 2, 8, 2, 300, 128
    q, k, v = testing.random_qkv(B, H, HKV, N, N, D, D, dtype, device="cuda")
    inputs = testing.random_inputs(attn.spec, B, H, HKV, N, N, device="cuda")
    testing.check_against_reference(attn.spec, attn, q, k, v, inputs)
    kv_len = torch.tensor([N, N - 37], dtype=torch.int32, device="cuda")
    testing.check_against_reference(attn.spec, attn, q[:, :, :1], k, v, inputs, grads=False, cache={"kv_len": kv_len})
