"""Dropout end to end: the reference's meaning, the keep-mask against an independent Philox4x32-7 and its keep
fraction against binomial bounds, the kernels' calls (GQA, learnable inputs, sinks, tile tables, packed calls,
calls without grad) against the float64 reference with the call's mask, reproducibility from the generator,
the errors, torch.compile, and their GPU twins (bf16 and fp16, the Hopper and portable families, Inductor)."""

import itertools
import math

import numpy as np
import pytest
import torch

import attngen
import triton
import triton.language as tl
from attngen import reference, testing
from attngen.errors import ArgumentError
from attngen.runtime.helpers import _dropout_keep, _dropout_keep_tile, _dropout_state
from attngen.testing import strategies
from conftest import CPU_CALLS, tiered

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# A learnable relative bias under a window (GQA, a learnable gradient through dS), and a sink beside
# rows without keys (k > q + 2) with a learnable sink (dropout leaves LSE and the sink's gradient as they are).
BIAS = """
attention dropout_bias
input table: f32[H, 9] learnable
mask: q - k < 6 and k - q < 11
score: score + table[h, clamp(q - k, -4, 4) + 4]
"""
SINK = """
attention dropout_sink
input sinks: f32[H] learnable
mask: k > q + 2
sink: sinks[h] + 0.01 * q
"""


@pytest.fixture(scope="module")
def causal():
    return attngen.build("specs/causal.attn")


@pytest.fixture(scope="module")
def bias():
    return attngen.build(BIAS)


def _qkv(B=2, H=4, HKV=2, N=37, M=45, D=16, DV=24, dtype=torch.float32, seed=0):
    return testing.random_qkv(B, H, HKV, N, M, D, DV, dtype, device=DEVICE, seed=seed)


def _generator(seed):
    return torch.Generator(device=DEVICE).manual_seed(seed)


# --- the reference ---------------------------------------------------------------------------------

def test_the_reference_drops_p_after_the_softmax_and_keeps_lse():
    spec = attngen.parse_spec("attention t\nmask: causal\n")
    q, k, v = testing.random_qkv(2, 2, 1, 9, 11, 8, 8, torch.float64)
    mask = torch.rand(2, 2, 9, 11, generator=torch.Generator().manual_seed(0)) < 0.6
    out, lse = reference.evaluate(spec, q, k, v, dropout_p=0.4, dropout_mask=mask)
    plain, plain_lse = reference.evaluate(spec, q, k, v)
    p = reference.probabilities(spec, q, k, v)
    torch.testing.assert_close(out, (p * mask / 0.6) @ v.repeat_interleave(2, dim=1))
    assert torch.equal(lse, plain_lse)
    # A mask that keeps everything at p = 0 is no dropout.
    assert torch.equal(reference.evaluate(spec, q, k, v, dropout_p=0.0, dropout_mask=torch.ones_like(mask))[0], plain)


@pytest.mark.parametrize("kwargs, message", [
    (dict(dropout_p=0.5), "dropout_mask must be given with dropout_p=0.5"),
    (dict(dropout_p=1.0, dropout_mask=True), r"dropout_p must be a number in \[0, 1\), got 1.0"),
    (dict(dropout_p=0.5, dropout_mask=torch.ones(2, 2, 9, 9, dtype=torch.bool)),
     r"dropout_mask must be a bool tensor of shape \(2, 2, 9, 11\)"),
    (dict(dropout_p=0.5, dropout_mask=torch.ones(2, 2, 9, 11)), "dropout_mask must be a bool tensor"),
])
def test_the_reference_refuses_a_wrong_dropout(kwargs, message):
    spec = attngen.parse_spec("attention t\n")
    q, k, v = testing.random_qkv(2, 2, 1, 9, 11, 8, 8, torch.float64)
    with pytest.raises(ArgumentError, match=message):
        reference.evaluate(spec, q, k, v, **kwargs)


# --- the keep-mask ---------------------------------------------------------------------------------

def _philox4x32(seed, c0, c1, c2, c3, rounds):
    """Philox4x32 of `rounds` rounds (Salmon et al. 2011) in numpy, written from its definition as Triton's
    tl.philox states it: the four counter words (uint32 arrays) under the 64-bit key `seed` (low word k0,
    high word k1)."""
    mask = np.uint64(0xFFFFFFFF)
    c = [np.asarray(x, dtype=np.uint64) & mask for x in (c0, c1, c2, c3)]
    k0, k1 = np.uint64(seed & 0xFFFFFFFF), np.uint64((seed >> 32) & 0xFFFFFFFF)
    a, b = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    for _ in range(rounds):
        prod_b, prod_a = b * c[2], a * c[0]  # below 2**64: exact
        c = [((prod_b >> np.uint64(32)) ^ c[1] ^ k0) & mask, prod_b & mask,
             ((prod_a >> np.uint64(32)) ^ c[3] ^ k1) & mask, prod_a & mask]
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & mask, (k1 + np.uint64(0xBB67AE85)) & mask
    return c


def _expected_keep(words, p, bh, q, k):
    """Whether dropout keeps (q, k) of batch x head bh = b * H + h (numpy int arrays that broadcast), as
    runtime.helpers documents it, from a call's two words: (q, k) = (16A + 8a + x, 16C + 8c + 2y + e) takes
    half e of word 2a + c of the Philox4x32-7 draw at counter (4C + y, 8A + x, b * H + h, offset) under key
    seed, and is kept when that half is at least round(float32(p) * 2**16)."""
    seed, offset = (int(w) % 2**64 for w in words.tolist())
    bh, q, k = np.broadcast_arrays(bh, q, k)
    drawn = _philox4x32(seed, (k // 16) * 4 + (k % 8) // 2, (q // 16) * 8 + q % 8, bh,
                        np.full(bh.shape, offset % 2**32), rounds=7)
    word = np.select([(q // 8 % 2 == a) & (k // 8 % 2 == c) for a in (0, 1) for c in (0, 1)], drawn)
    half = np.where(k % 2 == 1, word >> np.uint64(16), word & np.uint64(0xFFFF))
    threshold = min(int(np.float32(p) * np.float32(2**16) + np.float32(0.5)), 65535)
    return torch.from_numpy(half >= threshold)


def _expected_mask(words, p, B, H, Q_LEN, KV_LEN):
    b, h, q, k = np.meshgrid(np.arange(B), np.arange(H), np.arange(Q_LEN), np.arange(KV_LEN), indexing="ij")
    return _expected_keep(words, p, b * H + h, q, k)


@CPU_CALLS
def test_the_mask_is_the_documented_philox_draw_of_the_generators_words(causal):
    q, k, v = _qkv(N=40, M=37)
    g = _generator(11)
    state = g.get_state()
    mask = causal.dropout_mask(q, k, v, dropout_p=0.3, generator=g)
    after = g.get_state()
    # A call draws the words (seed, offset) as one randint of the generator, and nothing else.
    g.set_state(state)
    words = torch.randint(0, 2**62, (2,), dtype=torch.int64, device=DEVICE, generator=g)
    assert torch.equal(g.get_state(), after)
    g.set_state(state)
    causal(q, k, v, dropout_p=0.3, generator=g)
    assert torch.equal(g.get_state(), after)
    assert torch.equal(mask.cpu(), _expected_mask(words.cpu(), 0.3, 2, 4, 40, 37))


@triton.jit
def _keep_three_ways(Rng, Elements, Tiles, Transposed, p, bh, q0, k0, BQ: tl.constexpr, BK: tl.constexpr):
    # One tile's keep-mask element by element (the definition), by the kernels' tile evaluation, and by it on
    # the transposed tile.
    seed, offset, threshold, _ = _dropout_state(Rng, p, True)
    q = q0 + tl.arange(0, BQ)
    k = k0 + tl.arange(0, BK)
    at = tl.arange(0, BQ)[:, None] * BK + tl.arange(0, BK)[None, :]
    tl.store(Elements + at, _dropout_keep(seed, offset, threshold, bh, q[:, None], k[None, :]).to(tl.int8))
    tl.store(Tiles + at, _dropout_keep_tile(seed, offset, threshold, bh, q[:, None], k[None, :], False).to(tl.int8))
    tl.store(Transposed + tl.arange(0, BK)[:, None] * BQ + tl.arange(0, BQ)[None, :],
             _dropout_keep_tile(seed, offset, threshold, bh, q[None, :], k[:, None], True).to(tl.int8))


@CPU_CALLS
def test_the_tile_evaluation_is_the_element_by_element_definition():
    # The kernels draw once for eight (or four) elements and place the words by reshapes (_dropout_keep_tile), in the
    # forward's (q, k) tiles and the backward's (k, q) ones; the Hopper kernels too: all must be the definition.
    kernel = _keep_three_ways
    words = torch.tensor([-0x1234567890ABCDE, 0x7FFFFFFF0000FFFF], dtype=torch.int64)
    for BQ, BK, q0, k0, bh in [(16, 16, 0, 0, 0), (32, 64, 48, 16, 5), (64, 32, 128, 96, 65534)]:
        elements, tiles = (torch.empty(BQ, BK, dtype=torch.int8) for _ in range(2))
        transposed = torch.empty(BK, BQ, dtype=torch.int8)
        kernel[(1,)](words, elements, tiles, transposed, 0.45, bh, q0, k0, BQ=BQ, BK=BK)
        assert torch.equal(tiles, elements) and torch.equal(transposed.T, elements)
        want = _expected_keep(words, 0.45, bh, np.arange(q0, q0 + BQ)[:, None], np.arange(k0, k0 + BK)[None, :])
        assert torch.equal(elements.bool(), want)


def _binomial_bound(n, p, sigmas=5.0):
    return sigmas * math.sqrt(p * (1 - p) / n)


@CPU_CALLS
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_the_keep_fraction_lies_within_binomial_bounds(causal, p):
    q, k, v = _qkv(B=2, H=3, HKV=3, N=100, M=130)
    mask = causal.dropout_mask(q, k, v, dropout_p=p, generator=_generator(3)).cpu()
    kept = 1 - p
    assert abs(mask.float().mean().item() - kept) <= _binomial_bound(mask.numel(), kept)
    # Each of a draw's four words, each head and each key residue mod 16 keeps its share too, and two
    # neighbours (one draw's words, or two draws) are kept together as independent ones would be.
    rows, columns = torch.arange(mask.shape[2]) // 8 % 2, torch.arange(mask.shape[3]) // 8 % 2
    for a, c in itertools.product((0, 1), repeat=2):
        part = mask[:, :, rows == a][..., columns == c]
        assert abs(part.float().mean().item() - kept) <= _binomial_bound(part.numel(), kept)
    for h in range(3):
        assert abs(mask[:, h].float().mean().item() - kept) <= _binomial_bound(mask[:, h].numel(), kept)
    for pair in (mask[..., :, :-8] & mask[..., :, 8:], mask[..., :-8, :] & mask[..., 8:, :],
                 mask[..., :, :-1] & mask[..., :, 1:]):
        assert abs(pair.float().mean().item() - kept ** 2) <= _binomial_bound(pair.numel(), kept ** 2, sigmas=6.0)


@CPU_CALLS
def test_the_mask_of_a_packed_call_is_per_sequence(causal):
    q, k, v, packed = _packed()
    g = _generator(4)
    mask = causal.dropout_mask(q, k, v, dropout_p=0.5, generator=g, **packed)
    assert mask.shape == (6, 4, 37, 20)
    # Sequence b's (b, h, q, k) as a dense call of B sequences of the longest lengths has it.
    dense = [t.new_zeros(6, t.shape[1], 37 if t is q else 20, t.shape[2]) for t in (q, k, v)]
    assert torch.equal(mask, causal.dropout_mask(*dense, dropout_p=0.5, generator=_generator(4)))


# --- the kernels against the reference -------------------------------------------------------------

# The default run takes half precision at a high rate (the keep-scale's rounding shows most); the slow tier
# float32 at a low one.
@CPU_CALLS
@pytest.mark.parametrize("dtype, p", tiered([(torch.float32, 0.2), (torch.float16, 0.75)],
                                             fast=[(torch.float16, 0.75)]))
def test_training_calls_match_the_reference_with_their_mask(bias, dtype, p):
    q, k, v = _qkv(dtype=dtype)
    inputs = testing.random_inputs(bias.spec, 2, 4, 2, 37, 45, device=DEVICE)
    testing.check_against_reference(bias.spec, bias, q, k, v, inputs, seed=3, dropout_p=p)


@CPU_CALLS
@pytest.mark.parametrize("name", ["causal", "document_causal", "full"])
def test_catalog_specs_match_the_reference_with_dropout(name, build_small):
    # A top-left mask (closed-form tile ranges), a tile-table mask and no mask; lengths across tiles.
    attn = build_small(name)
    q, k, v = _qkv(N=33, M=50, D=24, DV=16, dtype=torch.float16)
    inputs = testing.random_inputs(attn.spec, 2, 4, 2, 33, 50, device=DEVICE)
    testing.check_against_reference(attn.spec, attn, q, k, v, inputs, seed=1, dropout_p=0.3)


@CPU_CALLS
def test_a_sink_with_dropout_matches_the_reference():
    attn = attngen.build(SINK)
    q, k, v = _qkv(N=21, M=21)
    inputs = testing.random_inputs(attn.spec, 2, 4, 2, 21, 21, device=DEVICE)
    testing.check_against_reference(attn.spec, attn, q, k, v, inputs, seed=2, dropout_p=0.4)


def _packed(lengths_q=(5, 0, 1, 37, 18, 3), lengths_k=(9, 3, 1, 20, 0, 20), H=4, HKV=2, D=16):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lengths_q), H, D, generator=g).to(DEVICE)
    k, v = (torch.randn(sum(lengths_k), HKV, D, generator=g).to(DEVICE) for _ in range(2))

    def offsets(lengths):
        return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=DEVICE)
    return q, k, v, dict(cu_seqlens_q=offsets(lengths_q), cu_seqlens_k=offsets(lengths_k),
                         max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k))


@CPU_CALLS
def test_packed_calls_match_the_reference_of_each_sequence_with_its_mask(bias):
    q, k, v, packed = _packed()
    inputs = testing.random_inputs(bias.spec, 6, 4, 2, 37, 20, device=DEVICE)
    testing.check_against_reference(bias.spec, bias, q, k, v, inputs, packed=packed, seed=5, dropout_p=0.35)


@CPU_CALLS
def test_calls_without_grad_drop_too(causal):
    q, k, v = _qkv()
    mask = causal.dropout_mask(q, k, v, dropout_p=0.5, generator=_generator(7))
    with torch.no_grad():
        out = causal(q, k, v, dropout_p=0.5, generator=_generator(7))
    want = reference.evaluate(causal.spec, q.double(), k.double(), v.double(), dropout_p=0.5, dropout_mask=mask)[0]
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_the_check_fails_when_a_call_drops_other_weights_than_its_mask_says(causal):
    # The reference comparison sees the mask: a call whose dropout_mask is not the one it applied fails.
    class Lying:
        spec = causal.spec

        def __call__(self, *args, **kwargs):
            return causal(*args, **kwargs)

        def dropout_mask(self, *args, **kwargs):
            mask = causal.dropout_mask(*args, **kwargs)
            return mask ^ (torch.arange(mask.shape[-1], device=mask.device) == 3)

    q, k, v = _qkv(N=20, M=20)
    with pytest.raises(AssertionError, match="out: max error"):
        testing.check_against_reference(causal.spec, Lying(), q, k, v, {}, seed=1, dropout_p=0.3)


# --- reproducibility -------------------------------------------------------------------------------

def _step(attn, q, k, v, inputs, **kwargs):
    """Out, LSE and every gradient of one training call, from fresh leaves."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, *inputs.values())]
    named = dict(zip(inputs, leaves[3:]))
    out, lse = attn(*leaves[:3], return_lse=True, **named, **kwargs)
    grads = torch.autograd.grad(out.square().sum() + torch.where(lse.isfinite(), lse, 0.0).sum(), leaves)
    return (out, lse, *grads)


@CPU_CALLS
def test_a_seed_repeats_output_and_gradients_bitwise_and_another_seed_does_not(bias):
    q, k, v = _qkv(B=1, H=2, HKV=1, N=20, M=24)
    inputs = testing.random_inputs(bias.spec, 1, 2, 1, 20, 24, device=DEVICE)
    first, again, other = (_step(bias, q, k, v, inputs, dropout_p=0.3, generator=_generator(s)) for s in (1, 1, 2))
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], other[0]) and not torch.equal(first[2], other[2])
    assert torch.equal(first[1], other[1])  # LSE keeps every P, whatever the mask
    # The default generator: torch.manual_seed repeats a run, and consecutive calls draw other masks.
    torch.manual_seed(5)
    a, b = _step(bias, q, k, v, inputs, dropout_p=0.3), _step(bias, q, k, v, inputs, dropout_p=0.3)
    torch.manual_seed(5)
    assert torch.equal(_step(bias, q, k, v, inputs, dropout_p=0.3)[0], a[0]) and not torch.equal(a[0], b[0])


@CPU_CALLS
def test_dropout_p_zero_is_the_call_without_dropout_and_draws_nothing(causal):
    q, k, v = _qkv(B=1, H=2, HKV=1, N=20, M=24)
    g = _generator(3)
    state = g.get_state()
    with_zero = _step(causal, q, k, v, {}, dropout_p=0.0, generator=g)
    assert torch.equal(g.get_state(), state)
    assert all(torch.equal(a, b) for a, b in zip(with_zero, _step(causal, q, k, v, {})))
    assert causal.dropout_mask(q, k, v, dropout_p=0.0, generator=g).all() and torch.equal(g.get_state(), state)


# --- the calls' errors -----------------------------------------------------------------------------

@CPU_CALLS
@pytest.mark.parametrize("kwargs, message", [
    (dict(dropout_p=1.0), r"dropout_p must be a number in \[0, 1\) .*, got 1.0"),
    (dict(dropout_p=-0.1), r"dropout_p must be a number in \[0, 1\) .*, got -0.1"),
    (dict(dropout_p=float("nan")), r"dropout_p must be a number in \[0, 1\) .*, got nan"),
    (dict(dropout_p=True), r"dropout_p must be a number in \[0, 1\) .*, got True"),
    (dict(dropout_p=torch.tensor(0.1)), r"dropout_p must be a number in \[0, 1\)"),
    (dict(dropout_p=0.1, generator=3), "generator must be a torch.Generator or None, got int"),
])
def test_bad_dropout_arguments_are_refused(causal, kwargs, message):
    q, k, v = _qkv(N=8, M=8)
    with pytest.raises(ValueError, match=message):
        causal(q, k, v, **kwargs)
    with pytest.raises(ValueError, match=message):
        causal.dropout_mask(q, k, v, **kwargs)


@CPU_CALLS
def test_cache_calls_refuse_dropout_and_the_decode_family_never_sees_it(causal):
    q, k, v = _qkv(N=2, M=40)
    kv_len = torch.tensor([40, 30], dtype=torch.int32, device=DEVICE)
    with torch.no_grad(), pytest.raises(ValueError, match="dropout_p must be 0 in a call with kv_len, q_offset or "
                                                          "page_table, got 0.1: cache calls are inference"):
        causal(q, k, v, kv_len=kv_len, dropout_p=0.1)
    # A short call without a cache goes to the decode family, unless it drops weights (its kernel cannot).
    assert causal.forward_family(q, k, v) == "decode"
    assert causal.forward_family(q, k, v, dropout_p=0.1) == "portable"
    mask = causal.dropout_mask(q, k, v, dropout_p=0.5, generator=_generator(1))
    with torch.no_grad():
        out = causal(q, k, v, dropout_p=0.5, generator=_generator(1))
    want = reference.evaluate(causal.spec, q.double(), k.double(), v.double(), dropout_p=0.5, dropout_mask=mask)[0]
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


# --- the fuzz --------------------------------------------------------------------------------------

def test_cases_draw_dropout_on_plain_calls_and_print_it():
    case = strategies.Case.parse("B=1,H=2,HKV=1,Q_LEN=17,KV_LEN=5,D=24,DV=8,dtype=f32,seed=3,dropout=30")
    assert case.dropout == 30 and strategies.Case.parse(str(case)) == case
    assert "dropout" not in str(strategies.Case.parse("B=1,H=2,HKV=1,Q_LEN=17,KV_LEN=5,D=24,DV=8,dtype=f32,seed=3"))
    for bad in ("dropout=100", "dropout=10,cache=contiguous", "dropout=-1"):
        with pytest.raises(ValueError, match="dropout must"):
            strategies.Case.parse(f"B=1,H=2,HKV=1,Q_LEN=17,KV_LEN=5,D=24,DV=8,dtype=f32,seed=3,{bad}")
    from hypothesis import given, settings

    seen = []

    @settings(max_examples=60, derandomize=True, database=None)
    @given(case=strategies.cases(caches=("none", "contiguous")))
    def draw(case):
        seen.append(case)
    draw()
    assert {c.dropout for c in seen if c.cache == "none"} >= {0, 15, 60}
    assert all(c.dropout == 0 for c in seen if c.cache != "none")


@CPU_CALLS
def test_a_drawn_dropout_case_checks_against_the_reference(bias):
    case = strategies.Case.parse("B=2,H=2,HKV=1,Q_LEN=31,KV_LEN=17,D=12,DV=20,dtype=f16,seed=9,dropout=60,"
                                 "layout=transposed")
    strategies.check_case(bias.spec, bias, case, device=DEVICE)


# --- torch.compile -----------------------------------------------------------------------------------

@CPU_CALLS
@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["dense", "packed"])
def test_compiled_calls_draw_in_the_graph_and_equal_eager(bias, fresh_dynamo, packed):
    # The words are drawn by an op of the traced graph (aot_eager runs it as eager does), so a compiled run
    # repeats under torch.manual_seed, equals eager bitwise, and draws anew on every call.
    if packed:
        q, k, v, call = _packed((5, 0, 17), (9, 3, 12), H=2, HKV=1)
        inputs = testing.random_inputs(bias.spec, 3, 2, 1, 17, 12, device=DEVICE)
    else:
        q, k, v = _qkv(B=1, H=2, HKV=1, N=20, M=24)
        inputs, call = testing.random_inputs(bias.spec, 1, 2, 1, 20, 24, device=DEVICE), {}

    def loss(q, k, v, table):
        out, lse = bias(q, k, v, return_lse=True, table=table, dropout_p=0.4, **call)
        return out.square().sum() + torch.where(lse.isfinite(), lse, 0.0).sum()  # empty sequences: -inf

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    results = []
    for fn in (loss, compiled, compiled):
        torch.manual_seed(8)
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, inputs["table"])]
        value = fn(*leaves)
        results.append((value, *torch.autograd.grad(value, leaves)))
    assert all(torch.equal(a, b) for want, got in zip(results, results[1:]) for a, b in zip(want, got))
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, inputs["table"])]
    assert not torch.equal(compiled(*leaves), compiled(*leaves))


def test_a_cuda_generator_without_an_index_is_on_the_current_device(monkeypatch):
    # torch.Generator(device="cuda") reports device "cuda" with no index and draws on the current device:
    # it must pass beside q on cuda:0 (the current one) and fail beside q on another.
    from attngen.runtime.dropout import _device_index
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert _device_index(torch.device("cuda")) == _device_index(torch.device("cuda:1")) == ("cuda", 1)
    assert _device_index(torch.device("cuda")) != _device_index(torch.device("cuda:0"))
    assert _device_index(torch.device("cpu")) != _device_index(torch.device("cuda"))


@CPU_CALLS
def test_a_generator_under_torch_compile_is_refused_clearly(causal, fresh_dynamo):
    q, k, v = _qkv(N=8, M=8)
    g = _generator(0)

    def call(q, k, v):
        return causal(q, k, v, dropout_p=0.1, generator=g)
    with pytest.raises(ValueError, match="generator must be None under torch.compile"):
        torch.compile(call, backend="aot_eager", fullgraph=True)(q, k, v)


@CPU_CALLS
def test_opcheck_of_the_operators_with_dropout(bias):
    q, k, v = _qkv(B=1, H=2, HKV=1, N=12, M=12)
    inputs = testing.random_inputs(bias.spec, 1, 2, 1, 12, 12, device=DEVICE)
    _, forward_op, backward_op, _, packed_op, packed_backward_op = bias.module.OPERATORS[:6]
    words = torch.randint(0, 2**62, (2,), dtype=torch.int64, device=DEVICE)
    tensors = [inputs["table"]]
    torch.library.opcheck(forward_op, (q, k, v, tensors, [], [], [words], 0.3),
                          test_utils=("test_schema", "test_faketensor"))
    out, lse = forward_op(q, k, v, tensors, [], [], [words], 0.3)
    torch.library.opcheck(backward_op, (q, k, v, out, lse, torch.randn_like(out), torch.randn_like(lse), tensors, [],
                                        [words], 0.3), test_utils=("test_schema", "test_faketensor"))
    q, k, v, packed = _packed((5, 0, 9), (4, 3, 9), H=2, HKV=1)
    tensors = [testing.random_inputs(bias.spec, 3, 2, 1, 9, 9, device=DEVICE)["table"]]
    args = tuple(packed.values())
    torch.library.opcheck(packed_op, (q, k, v, tensors, *args, [], [words], 0.3),
                          test_utils=("test_schema", "test_faketensor"))
    out, lse = packed_op(q, k, v, tensors, *args, [], [words], 0.3)
    torch.library.opcheck(packed_backward_op, (q, k, v, out, lse, torch.randn_like(out), torch.randn_like(lse), tensors,
                                               *args, [words], 0.3), test_utils=("test_schema", "test_faketensor"))


# --- on the GPU ------------------------------------------------------------------------------------

ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


# (spec, (B, H, HKV, Q_LEN, KV_LEN, D)): every spec at the FA3 tile's D = 128 with GQA, ragged lengths at
# D = 64, and the split head-dim backward at D = 256.
HOPPER_CASES = [(name, (2, 8, 2, 1000, 1000, 128))
                for name in ("causal", "full", "learned_rel_bias", "document_causal", "gpt_oss_sinks")]
HOPPER_CASES += [("causal", (1, 4, 4, 257, 700, 64)), ("learned_rel_bias", (1, 4, 4, 257, 700, 64)),
                 ("full", (1, 4, 2, 300, 300, 256)), ("learned_rel_bias", (1, 4, 2, 300, 300, 256))]
# Sigmoid attention's weights dropped (no row sum; dS = P * (1 - P) * dP' from the undropped P), unsplit and split.
HOPPER_CASES += [("sigmoid_alibi", (2, 8, 2, 1000, 1000, 128)), ("sigmoid_alibi", (1, 4, 2, 300, 300, 256))]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name, shape", HOPPER_CASES, ids=lambda x: x if isinstance(x, str) else "x".join(map(str, x)))
def test_dropout_through_the_hopper_family_on_gpu(name, dtype, shape):
    """The Hopper forward drops P after its softmax sum (or its sigmoid) and its backward regenerates the mask
    (256: the split head-dim backward): out, LSE and every gradient against the float64 reference with the
    call's mask."""
    B, H, HKV, N, M, D = shape
    attn = attngen.build(f"specs/{name}.attn")
    q, k, v = testing.random_qkv(B, H, HKV, N, M, D, D, dtype, device="cuda")
    inputs = testing.random_inputs(attn.spec, B, H, HKV, N, M, device="cuda")
    if "slopes" in inputs:  # ALiBi's own slopes, 2^(-8 (h + 1) / H): positive, as a model uses them
        inputs["slopes"] = 2.0 ** (-8.0 * torch.arange(1, H + 1, device="cuda") / H)
    assert attn.forward_family(q, k, v, dropout_p=0.2, **inputs) == "hopper"
    assert attn.backward_family(q, k, v, **inputs) == "hopper"
    testing.check_against_reference(attn.spec, attn, q, k, v, inputs, seed=1, dropout_p=0.2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", ["causal", "learned_rel_bias"])
def test_dropout_through_the_portable_family_on_gpu(name, dtype):
    # D = 40 is below the Hopper family's head dims: the portable kernels, forward and backward.
    attn = attngen.build(f"specs/{name}.attn")
    q, k, v = testing.random_qkv(2, 8, 2, 600, 517, 40, 40, dtype, device="cuda")
    inputs = testing.random_inputs(attn.spec, 2, 8, 2, 600, 517, device="cuda")
    assert attn.forward_family(q, k, v, dropout_p=0.1, **inputs) == "portable"
    assert attn.backward_family(q, k, v, **inputs) == "portable"
    testing.check_against_reference(attn.spec, attn, q, k, v, inputs, seed=2, dropout_p=0.1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [128, 40])
def test_packed_calls_with_dropout_on_gpu(dtype, head_dim):
    attn = attngen.build("specs/learned_rel_bias.attn")
    lengths = [300, 1, 0, 700, 77, 129]
    g = torch.Generator().manual_seed(1)
    q = torch.randn(sum(lengths), 8, head_dim, generator=g).to("cuda", dtype)
    k, v = (torch.randn(sum(lengths), 2, head_dim, generator=g).to("cuda", dtype) for _ in range(2))
    offsets = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
    packed = dict(cu_seqlens_q=offsets, cu_seqlens_k=offsets, max_seqlen_q=700, max_seqlen_k=700)
    inputs = testing.random_inputs(attn.spec, 6, 8, 2, 700, 700, device="cuda")
    testing.check_against_reference(attn.spec, attn, q, k, v, inputs, packed=packed, seed=3, dropout_p=0.25)


def _same_run(a, b):
    """Two runs' (out, dq, dk, dv, d_table) from the same generator state: out, dK and dV bit for bit (the
    Hopper kernels form them in a fixed order); dQ and the table's gradient are summed by atomics in an order
    that varies from run to run, so they agree to rounding."""
    out, dq, dk, dv, dt = a
    assert torch.equal(out, b[0]) and torch.equal(dk, b[2]) and torch.equal(dv, b[3])
    torch.testing.assert_close(dq, b[1], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dt, b[4], rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
def test_inductor_compiles_dropout_calls_on_gpu(fresh_dynamo):
    """Inductor lowers the words' draw to its own generator: with fallback_random the compiled step drops the
    weights eager drops; without, it repeats under torch.manual_seed, and another seed drops others."""
    attn = attngen.build("specs/learned_rel_bias.attn")
    q, k, v = testing.random_qkv(2, 8, 2, 512, 512, 128, 128, torch.bfloat16, device="cuda")
    table = testing.random_inputs(attn.spec, 2, 8, 2, 512, 512, device="cuda")["table"]
    dout = torch.randn_like(q)

    def step(q, k, v, table):
        return attn(q, k, v, table=table, dropout_p=0.1)

    def run(fn, seed=3):
        torch.manual_seed(seed)
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, table)]
        out = fn(*leaves)
        return (out, *torch.autograd.grad(out, leaves, dout))

    compiled = torch.compile(step, fullgraph=True)
    first = run(compiled)
    assert all(t.isfinite().all() for t in first)
    _same_run(first, run(compiled))
    assert not torch.equal(first[0], run(compiled, seed=4)[0])
    with torch._inductor.config.patch(fallback_random=True):
        torch._dynamo.reset()
        _same_run(run(torch.compile(step, fullgraph=True)), run(step))


@pytest.mark.gpu
def test_a_cuda_graph_draws_new_words_on_every_replay():
    attn = attngen.build("specs/causal.attn")
    q, k, v = testing.random_qkv(1, 8, 8, 256, 256, 128, 128, torch.bfloat16, device="cuda")
    with torch.no_grad():
        attn(q, k, v, dropout_p=0.3)  # builds and warms the kernels outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = attn(q, k, v, dropout_p=0.3)
    graph.replay()
    first = out.clone()
    graph.replay()
    assert not torch.equal(first, out)
    torch.cuda.manual_seed(4)
    graph.replay()
    again = out.clone()
    torch.cuda.manual_seed(4)
    graph.replay()
    assert torch.equal(again, out)
