"""`normalize: sigmoid` end to end: its errors, the reference's meaning (P = sigmoid(score') per allowed key, no
LSE), and the kernels' calls (training with learnable inputs, fully masked rows, tile tables, cache, paged and
packed calls) against the float64 reference."""

import itertools

import pytest
import torch

import attngen
from attngen import reference, testing
from attngen.errors import ArgumentError, SpecError
from attngen.frontend.printer import to_source
from attngen.testing import strategies
from conftest import CPU_CALLS, rows_case, tiered

SIGMOID_ALIBI = """
attention sigmoid_alibi
input slopes: f32[H]
normalize: sigmoid
mask: causal
score: score + slopes[h] * (k - q) - log(KV_LEN)
"""


# --- the language --------------------------------------------------------------------------------

def test_normalize_sigmoid_parses_prints_back_and_keeps_softmax_specs_as_they_were():
    spec = attngen.parse_spec(SIGMOID_ALIBI)
    assert spec.normalize == "sigmoid" and spec.sigmoid
    assert "normalize: sigmoid" in to_source(spec) and attngen.parse_spec(to_source(spec)) == spec
    plain = attngen.parse_spec("attention t\nmask: causal\n")
    written = attngen.parse_spec("attention t\nnormalize: softmax\nmask: causal\n")
    # Softmax is the default: saying it changes nothing, not even the fingerprint, and prints as nothing.
    assert plain == written and plain.fingerprint() == written.fingerprint() and "normalize" not in to_source(plain)
    assert "normalize" not in plain.model_dump_json(exclude={"normalize"})
    assert spec.fingerprint() != spec.model_copy(update={"normalize": "softmax"}).fingerprint()
    # An input may still be named `normalize`: the item's keyword is one only where an item begins.
    assert attngen.parse_spec("attention t\ninput normalize: f32[H]\nscore: score + normalize[h]\n").inputs[0].name \
        == "normalize"


@pytest.mark.parametrize("text, message, where", [
    ("normalize: sigmod", r"normalize must be softmax or sigmoid, got 'sigmod' \(did you mean 'sigmoid'\?\)", "2:12"),
    ("normalize: relu", "normalize must be softmax or sigmoid, got 'relu'\n", "2:12"),
    ("normalize: sigmoid\nnormalize: softmax", r"duplicate 'normalize:' \(the first is at line 2\)", "3:1"),
    ("normalize: sigmoid\nsink: 1.0", "a sink needs normalize: softmax, but line 2 says 'normalize: sigmoid'", "3:1"),
    ("sink: 1.0\nnormalize: sigmoid", r"normalize: sigmoid cannot have a sink \(line 2\)", "3:1"),
    ("normalize: 3", "unexpected '3'; expected a name", "2:12"),
])
def test_bad_normalize_items_are_refused_where_they_are(text, message, where):
    with pytest.raises(SpecError, match=message) as e:
        attngen.parse_spec(f"attention t\n{text}\n", "t.attn")
    assert str(e.value).startswith(f"t.attn:{where}:")


def test_a_spec_built_in_python_with_a_sink_and_sigmoid_is_refused():
    spec = attngen.parse_spec("attention t\nsink: 1.0\n")
    with pytest.raises(ArgumentError, match="a sink needs normalize: softmax, got normalize: sigmoid"):
        attngen.load_spec(spec.model_copy(update={"normalize": "sigmoid"}))


def test_explain_shows_sigmoid_only_for_a_sigmoid_spec():
    from attngen import api
    sizes = dict(q_len=32, kv_len=32, head_dim=16, head_dim_v=16, dtype="f32")
    assert "  normalize: sigmoid (" in api.explain(SIGMOID_ALIBI, **sizes).text
    assert "normalize" not in api.explain("attention t\nmask: causal\n", **sizes).text


# --- the reference ---------------------------------------------------------------------------------

def test_the_reference_weighs_each_allowed_key_by_its_own_sigmoid_and_has_no_lse():
    spec = attngen.parse_spec(SIGMOID_ALIBI)
    q, k, v = testing.random_qkv(2, 4, 2, 9, 13, 8, 6, torch.float64)
    inputs = testing.random_inputs(spec, 2, 4, 2, 9, 13)
    out, lse = reference.evaluate(spec, q, k, v, inputs)
    assert lse is None
    score = reference.modified_scores(spec, q, k, v, inputs)
    allowed = torch.isfinite(score)
    weights = torch.where(allowed, torch.sigmoid(score), 0.0)
    torch.testing.assert_close(out, weights @ v.repeat_interleave(2, dim=1))
    torch.testing.assert_close(reference.probabilities(spec, q, k, v, inputs), weights)
    # No normalisation: a row's weights need not sum to 1.
    assert (weights.sum(-1) - 1).abs().max() > 0.1


def test_dropout_drops_the_sigmoid_weights_and_their_gradient_uses_the_undropped_p():
    # P = sigmoid(score'), P' = keep * P / (1 - p): O = P' V, and the score's gradient is
    # dS = P * (1 - P) * dP' with dP' = keep * (dO V^T) / (1 - p), the undropped P's derivative (not P''s).
    spec = attngen.parse_spec(SIGMOID_ALIBI)
    q, k, v = testing.random_qkv(2, 4, 2, 9, 13, 8, 6, torch.float64)
    inputs = testing.random_inputs(spec, 2, 4, 2, 9, 13)
    keep = torch.rand(2, 4, 9, 13, generator=torch.Generator().manual_seed(0)) < 0.7
    q.requires_grad_()
    out, lse = reference.evaluate(spec, q, k, v, inputs, dropout_p=0.3, dropout_mask=keep)
    assert lse is None
    score = reference.modified_scores(spec, q, k, v, inputs)
    p = torch.where(torch.isfinite(score), torch.sigmoid(score), 0.0)
    torch.testing.assert_close(out, (p * keep / 0.7) @ v.repeat_interleave(2, dim=1))
    dout = torch.randn_like(out)
    (dq,) = torch.autograd.grad(out, q, dout)
    with torch.no_grad():
        dp = keep * (dout @ v.repeat_interleave(2, dim=1).transpose(-1, -2)) / 0.7
        ds = p * (1 - p) * dp
        # score' = score + terms without q, score = scale * q . k: dQ = dS K scale.
        want = ds @ k.repeat_interleave(2, dim=1) * reference.scale_value(spec, 8)
    torch.testing.assert_close(dq, want)
    # The dropped P's derivative would be another number.
    dropped = p * keep / 0.7
    assert not torch.allclose(dq, (dropped * (1 - dropped) * dp) @ k.repeat_interleave(2, dim=1)
                              * reference.scale_value(spec, 8))


# --- the kernels' calls ----------------------------------------------------------------------------

# A learnable relative bias, a mask that leaves the last rows of a square call without a key (k > q + 2) and
# cuts each batch row's keys at lens[b].
ROWS = """
attention sigmoid_rows
input table: f32[H, 9] learnable
input lens: i32[B]
normalize: sigmoid
mask: k > q + 2 and k < lens[b]
score: score + table[h, clamp(q - k, -4, 4) + 4]
"""
# Tile tables: a document mask reads an input at q and k.
DOCUMENT = """
attention sigmoid_document
input doc: i32[KV_LEN]
normalize: sigmoid
mask: doc[q] == doc[k] and causal
"""


@pytest.fixture(scope="module")
def alibi():
    return attngen.build(SIGMOID_ALIBI)


@pytest.fixture(scope="module")
def rows():
    return attngen.build(ROWS)


@CPU_CALLS
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
def test_training_calls_match_the_reference(alibi, dtype):
    # GQA, Q_LEN != KV_LEN, lengths off the tiles, DV != D: out, dq, dk, dv.
    q, k, v = testing.random_qkv(2, 4, 2, 37, 29, 16, 24, dtype)
    inputs = testing.random_inputs(alibi.spec, 2, 4, 2, 37, 29)
    testing.check_against_reference(alibi.spec, alibi, q, k, v, inputs)


@CPU_CALLS
@pytest.mark.parametrize("dtype", tiered([(torch.float32,), (torch.float16,)], [(torch.float32,)],
                                         ids=lambda case: str(case[0]).removeprefix("torch.")))
def test_learnable_inputs_and_rows_without_keys_match_the_reference(rows, dtype):
    q, k, v, inputs = rows_case(rows, dtype=dtype)
    testing.check_against_reference(rows.spec, rows, q, k, v, inputs)
    empty = ~torch.isfinite(reference.modified_scores(rows.spec, q, k, v, inputs)).any(-1)
    assert empty.any() and (~empty).any()
    leaves = [x.clone().requires_grad_() for x in (q, k, v, inputs["table"])]
    out = rows(*leaves[:3], table=leaves[3], lens=inputs["lens"])
    assert (out[empty] == 0).all() and not out.isnan().any()
    grads = torch.autograd.grad(out.square().sum(), leaves)
    assert not any(g.isnan().any() for g in grads) and grads[3].abs().sum() > 0
    assert (grads[0][empty] == 0).all()  # a row with no key has no gradient


@CPU_CALLS
@pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")  # the interpreter's numpy, as meant
def test_scores_far_past_exp2_s_range_saturate_without_nan():
    # Scores of hundreds: 2^-s2 overflows to inf (weight 0) or underflows to 0 (weight 1), and the gradient
    # P * (1 - P) is 0 there, never NaN.
    attn = attngen.build("attention sigmoid_steep\nnormalize: sigmoid\nscale: 64.0\nmask: causal\n")
    q, k, v = testing.random_qkv(1, 2, 2, 19, 19, 16, 16, torch.float32)
    testing.check_against_reference(attn.spec, attn, q, k, v)
    scores = reference.modified_scores(attn.spec, q.double(), k.double(), v.double())
    finite = scores[torch.isfinite(scores)]
    assert finite.min() < -200 and finite.max() > 200


@pytest.fixture(scope="module")
def document():
    return attngen.build(DOCUMENT)


def _document_case(attn, N=40):
    q, k, v = testing.random_qkv(2, 2, 1, N, N, 16, 16, torch.float32)
    doc = torch.tensor([0] * 13 + [1] * 20 + [2] * (N - 33), dtype=torch.int32)
    return q, k, v, {"doc": doc}


@CPU_CALLS
def test_tile_table_masks_match_the_reference_and_skip_the_tiles_softmax_skips(document):
    q, k, v, inputs = _document_case(document)
    assert document.module.FACTS.tile_table
    testing.check_against_reference(document.spec, document, q, k, v, inputs)
    softmax = attngen.build(DOCUMENT.replace("normalize: sigmoid\n", "").replace("sigmoid_document", "softmax_doc"))
    # Tables built once and passed give the same call.
    tables = document.tile_tables(q, k, v, **inputs)
    with torch.no_grad():
        assert torch.equal(document(q, k, v, tile_tables=tables, **inputs), document(q, k, v, **inputs))
    counts, softmax_counts = document.visit_counts(q, k, v, **inputs), softmax.visit_counts(q, k, v, **inputs)
    assert counts.keys() == softmax_counts.keys()
    for kernel, visits in counts.items():
        assert torch.equal(visits, softmax_counts[kernel]), kernel
        assert (visits == 0).any(), kernel  # some tiles are skipped


@CPU_CALLS
def test_cache_calls_match_the_reference(alibi):
    q, k, v = testing.random_qkv(2, 8, 2, 6, 70, 16, 16, torch.float32)
    inputs = testing.random_inputs(alibi.spec, 2, 8, 2, 6, 70)
    kv_len = torch.tensor([70, 41], dtype=torch.int32)
    for n in (1, 6):  # a decoding step and a chunk of prefill, both by the decode family's split-KV shares
        assert alibi.forward_family(q[:, :, :n], k, v, kv_len=kv_len, **inputs) == "decode"
        cache = {"kv_len": kv_len}
        testing.check_against_reference(alibi.spec, alibi, q[:, :, :n], k, v, inputs, grads=False, cache=cache)
        cache["q_offset"] = torch.tensor([2, 0], dtype=torch.int32)
        testing.check_against_reference(alibi.spec, alibi, q[:, :, :n], k, v, inputs, grads=False, cache=cache)


@CPU_CALLS
def test_a_long_cache_chunk_runs_in_the_portable_forward(alibi):
    q, k, v = testing.random_qkv(2, 2, 1, 40, 48, 16, 16, torch.float32)
    inputs = testing.random_inputs(alibi.spec, 2, 2, 1, 40, 48)
    cache = {"kv_len": torch.tensor([48, 45], dtype=torch.int32)}
    assert alibi.forward_family(q, k, v, **cache, **inputs) == "portable"
    testing.check_against_reference(alibi.spec, alibi, q, k, v, inputs, grads=False, cache=cache)


@CPU_CALLS
def test_paged_cache_calls_match_the_reference(alibi):
    q, k, v = testing.random_qkv(2, 4, 2, 3, 32, 16, 16, torch.float32)
    inputs = testing.random_inputs(alibi.spec, 2, 4, 2, 3, 32)
    kv_len = torch.tensor([32, 23], dtype=torch.int32)
    k_pages, v_pages, table = strategies.paged(k, v, 16, seed=1)
    with torch.no_grad():
        out = alibi(q, k_pages, v_pages, page_table=table, kv_len=kv_len, **inputs)
    want, _ = reference.evaluate(alibi.spec, q.double(), k.double(), v.double(), inputs, kv_len=kv_len)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def _packed_case(attn, lengths_q=(5, 17, 0, 9), lengths_k=(7, 17, 3, 12), H=4, HKV=2, D=16):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lengths_q), H, D, generator=g)
    k, v = (torch.randn(sum(lengths_k), HKV, D, generator=g) for _ in range(2))

    def offsets(lengths):
        return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    packed = dict(cu_seqlens_q=offsets(lengths_q), cu_seqlens_k=offsets(lengths_k), max_seqlen_q=max(lengths_q),
                  max_seqlen_k=max(lengths_k))
    return q, k, v, testing.random_inputs(attn.spec, len(lengths_q), H, HKV, max(lengths_q), max(lengths_k)), packed


@CPU_CALLS
def test_packed_calls_match_the_reference_of_each_sequence(rows):
    # A learnable table, and each sequence's keys cut at lens[b] (KV_LEN is the sequence's own).
    q, k, v, inputs, packed = _packed_case(rows)
    testing.check_against_reference(rows.spec, rows, q, k, v, inputs, packed=packed)


@CPU_CALLS
@pytest.mark.parametrize("dtype, p", [(torch.float32, 0.3), (torch.float16, 0.6)], ids=["f32", "f16"])
def test_dropout_on_sigmoid_weights_matches_the_reference_with_the_call_s_mask(rows, dtype, p):
    # The kernels drop the sigmoid's weights after forming them (scaled by 1 / (1 - p) once, at the end) and the
    # backward forms dS = P * (1 - P) * dP' from the undropped P: out, dq, dk, dv and the learnable table's
    # gradient against the float64 reference with the mask dropout_mask gives; rows without keys stay 0.
    q, k, v, inputs = rows_case(rows, N=37, M=29, dtype=dtype)
    inputs["lens"] = torch.tensor([29, 20], dtype=torch.int32)
    testing.check_against_reference(rows.spec, rows, q, k, v, inputs, seed=3, dropout_p=p)


@CPU_CALLS
def test_dropout_on_packed_sigmoid_calls_matches_the_reference_of_each_sequence(rows):
    q, k, v, inputs, packed = _packed_case(rows)
    testing.check_against_reference(rows.spec, rows, q, k, v, inputs, packed=packed, seed=5, dropout_p=0.35)


@CPU_CALLS
def test_return_lse_is_refused_in_every_kind_of_call(alibi):
    q, k, v = testing.random_qkv(1, 2, 2, 5, 5, 16, 16, torch.float32)
    inputs = testing.random_inputs(alibi.spec, 1, 2, 2, 5, 5)
    message = "return_lse=True needs a softmax spec, got one with normalize: sigmoid, which has no LSE"
    with pytest.raises(ValueError, match=message):
        alibi(q, k, v, return_lse=True, **inputs)
    with pytest.raises(ValueError, match=message), torch.no_grad():
        alibi(q, k, v, kv_len=torch.tensor([5], dtype=torch.int32), return_lse=True, **inputs)
    offsets = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        alibi(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu_seqlens_q=offsets,
              cu_seqlens_k=offsets, max_seqlen_q=5, max_seqlen_k=5, return_lse=True, **inputs)


def test_only_a_sigmoid_spec_s_kernels_go_without_row_terms():
    # A softmax spec's kernels keep their LSE and delta parameters (its module is unchanged); a sigmoid spec's
    # have none, in every family, and its decode merge adds the shares.
    sigmoid = attngen.build(SIGMOID_ALIBI, target="h200").module
    softmax = attngen.build(SIGMOID_ALIBI.replace("normalize: sigmoid\n", ""), target="h200").module
    kernels = {"_fwd_kernel": {"Lse"}, "_bwd_kernel": {"Lse", "Delta"}, "_decode_fwd_kernel": {"LsePart"},
               "_hopper_fwd_kernel": {"Lse"}, "_hopper_bwd_kernel": {"lse_desc", "delta_desc"}}
    for name, rows_of in kernels.items():
        assert rows_of <= set(getattr(softmax, name).arg_names), name
        assert not rows_of & set(getattr(sigmoid, name).arg_names), name
    assert sigmoid.FACTS.normalize == "sigmoid" and softmax.FACTS.normalize == "softmax"


@CPU_CALLS
def test_compiled_calls_equal_eager(rows, fresh_dynamo):
    # The custom operators carry a sigmoid spec: forward, backward (no row terms), packed and cache calls.
    q, k, v, inputs = rows_case(rows, N=17, M=17)

    def loss(q, k, v, table):
        return rows(q, k, v, table=table, lens=inputs["lens"]).square().sum()

    grads = []
    for fn in (loss, torch.compile(loss, backend="aot_eager", fullgraph=True)):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, inputs["table"])]
        grads.append(torch.autograd.grad(fn(*leaves), leaves))
    assert all(torch.equal(a, b) for a, b in zip(*grads)) and grads[0][3].abs().sum() > 0
    pq, pk, pv, packed_inputs, packed = _packed_case(rows)

    def packed_loss(q, k, v, table):
        return rows(q, k, v, table=table, lens=packed_inputs["lens"], **packed).square().sum()

    grads = []
    for fn in (packed_loss, torch.compile(packed_loss, backend="aot_eager", fullgraph=True)):
        leaves = [t.detach().clone().requires_grad_() for t in (pq, pk, pv, packed_inputs["table"])]
        grads.append(torch.autograd.grad(fn(*leaves), leaves))
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    kv_len = torch.tensor([17, 9], dtype=torch.int32)

    def step(q, k, v):
        return rows(q, k, v, kv_len=kv_len, **inputs)

    with torch.no_grad():
        assert torch.equal(torch.compile(step, backend="aot_eager", fullgraph=True)(q[:, :, :1], k, v),
                           step(q[:, :, :1], k, v))


@CPU_CALLS
def test_opcheck_of_the_operators_of_a_sigmoid_spec(rows):
    q, k, v, inputs = rows_case(rows, N=12, M=12)
    _, forward_op, backward_op, cache_op, packed_op, _ = rows.module.OPERATORS
    tensors = [inputs[i.name] for i in rows.spec.inputs]
    # Without dropout ([] and 0.0) and with it (a call's Philox words and p), as the operators' schemas take them.
    words = torch.randint(0, 2**62, (2,), dtype=torch.int64)
    for rng, p in (([], 0.0), ([words], 0.3)):
        torch.library.opcheck(forward_op, (q, k, v, tensors, [], [], rng, p), test_utils=("test_schema", "test_faketensor"))
        out, lse = forward_op(q, k, v, tensors, [], [], rng, p)
        do = torch.randn_like(out)
        torch.library.opcheck(backward_op, (q, k, v, out, lse, do, None, tensors, [], rng, p),
                              test_utils=("test_schema", "test_faketensor"))
        pq, pk, pv, packed_inputs, packed = _packed_case(rows)
        torch.library.opcheck(packed_op, (pq, pk, pv, [packed_inputs[i.name] for i in rows.spec.inputs],
                                          *packed.values(), [], rng, p), test_utils=("test_schema", "test_faketensor"))
    kv_len = torch.tensor([12, 7], dtype=torch.int32)
    torch.library.opcheck(cache_op, (q[:, :, :2], k, v, tensors, [kv_len], [kv_len - 2], [], []),
                          test_utils=("test_schema", "test_faketensor"))


# --- merge and Flex --------------------------------------------------------------------------------

@CPU_CALLS
def test_merge_adds_sigmoid_parts_over_disjoint_keys():
    # Without a KV_LEN term the weights do not depend on which keys a call sees: the parts add up to the whole.
    attn = attngen.build("attention sigmoid_full\nnormalize: sigmoid\n")
    q, k, v = testing.random_qkv(1, 2, 2, 7, 50, 16, 16, torch.float32)
    whole = attn(q, k, v)
    parts = [attn(q, k[:, :, s], v[:, :, s]) for s in (slice(0, 21), slice(21, 50))]
    torch.testing.assert_close(attngen.merge(parts, normalize="sigmoid"), whole, rtol=1e-5, atol=1e-5)
    with pytest.raises(ArgumentError, match="merge needs the parts' LSEs"):
        attngen.merge(parts)
    with pytest.raises(ArgumentError, match="lses must be None with normalize='sigmoid'"):
        attngen.merge(parts, [torch.zeros(1, 2, 7)] * 2, normalize="sigmoid")
    with pytest.raises(ArgumentError, match="normalize must be 'softmax' or 'sigmoid', got 'relu'"):
        attngen.merge(parts, normalize="relu")


def test_to_flex_refuses_sigmoid_attention():
    with pytest.raises(ArgumentError, match="must be softmax attention to run as FlexAttention, got 'normalize: "
                                            "sigmoid'"):
        attngen.to_flex(SIGMOID_ALIBI)


# --- on the GPU ------------------------------------------------------------------------------------

ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
# Through the Hopper family: ALiBi with the -log(n) bias, a plain score (the scale applied in exp2's argument,
# DEFER_SCALE), a learnable table with rows without keys, tile tables, and scores that saturate the sigmoid.
HOPPER_SPECS = {
    "sigmoid_alibi": SIGMOID_ALIBI,
    "plain_causal": "attention sigmoid_causal\nnormalize: sigmoid\nmask: causal\n",
    "rows": ROWS,
    "document": DOCUMENT,
    "steep": "attention sigmoid_steep\nnormalize: sigmoid\nscale: 1.5\nmask: causal\n",
}


def _gpu_inputs(attn, B, H, HKV, N, M):
    inputs = testing.random_inputs(attn.spec, B, H, HKV, N, M, device="cuda")
    if "slopes" in inputs:  # ALiBi's own slopes, 2^(-8 (h + 1) / H): positive, as a model uses them
        inputs["slopes"] = 2.0 ** (-8.0 * torch.arange(1, H + 1, device="cuda") / H)
    return inputs


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(HOPPER_SPECS))
@pytest.mark.parametrize("shape", [(2, 8, 2, 1000, 1000, 128), (1, 4, 4, 257, 700, 64), (1, 4, 2, 17, 300, 256)],
                         ids=lambda s: "x".join(map(str, s)))
def test_sigmoid_through_the_hopper_family_on_gpu(name, dtype, shape):
    """The Hopper forward's sigmoid weights (no row max, sum or rescaling) and its backward without row terms:
    out, dq, dk, dv and the learnable inputs' gradients against the float64 reference; a 17-query call puts
    rows past Q_LEN in every query tile, a head dim of 256 splits the backward's warpgroups."""
    B, H, HKV, N, M, D = shape
    attn = attngen.build(HOPPER_SPECS[name])
    q, k, v = testing.random_qkv(B, H, HKV, N, M, D, D, dtype, device="cuda")
    inputs = _gpu_inputs(attn, B, H, HKV, N, M)
    assert attn.backward_family(q, k, v, **inputs) == "hopper"
    if N > 64:  # the shortest calls' forward is the decode family's
        assert attn.forward_family(q, k, v, **inputs) == "hopper"
    out = attn(q, k, v, **inputs)
    assert not out.isnan().any()
    testing.check_against_reference(attn.spec, attn, q, k, v, inputs)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", ["sigmoid_alibi", "rows", "document"])
def test_sigmoid_through_the_portable_and_decode_families_on_gpu(name, dtype):
    # D = 48, which the Hopper family does not take: the portable backward (bf16 dots, which the interpreter
    # cannot check) and the forward the decode family's rule picks for these shapes on this GPU (its model may
    # predict the split kernel faster for a spec without tables); then a decoding step and a chunk of prefill
    # over the cache, by the decode family.
    attn = attngen.build(HOPPER_SPECS[name])
    B, H, HKV, N, D = 2, 8, 2, 300, 48
    q, k, v = testing.random_qkv(B, H, HKV, N, N, D, D, dtype, device="cuda")
    inputs = _gpu_inputs(attn, B, H, HKV, N, N)
    assert attn.forward_family(q, k, v, **inputs) in {"portable", "decode"}
    assert attn.backward_family(q, k, v, **inputs) == "portable"
    testing.check_against_reference(attn.spec, attn, q, k, v, inputs)
    kv_len = torch.tensor([N, N - 37], dtype=torch.int32, device="cuda")
    for n in (1, 4):
        family = attn.forward_family(q[:, :, :n], k, v, kv_len=kv_len, **inputs)
        assert family == ("decode" if "decode" in attn.plan.families else "portable")
        testing.check_against_reference(attn.spec, attn, q[:, :, :n], k, v, inputs, grads=False,
                                        cache={"kv_len": kv_len})


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", ["sigmoid_alibi", "rows"])
def test_packed_sigmoid_calls_through_the_hopper_family_on_gpu(name, dtype):
    # Sequences empty, single, ragged and several tiles long: rows past a sequence's end are the next one's,
    # which only the mask's bounds check keeps out of P (there is no LSE to pad with +inf).
    attn = attngen.build(HOPPER_SPECS[name])
    lengths = [300, 1, 0, 700, 77, 129]
    H, HKV, D = 8, 2, 128
    g = torch.Generator().manual_seed(1)
    q = torch.randn(sum(lengths), H, D, generator=g).to("cuda", dtype)
    k, v = (torch.randn(sum(lengths), HKV, D, generator=g).to("cuda", dtype) for _ in range(2))
    offsets = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
    packed = dict(cu_seqlens_q=offsets, cu_seqlens_k=offsets, max_seqlen_q=max(lengths), max_seqlen_k=max(lengths))
    inputs = _gpu_inputs(attn, len(lengths), H, HKV, max(lengths), max(lengths))
    assert attn.forward_family(q, k, v, **packed, **inputs) == "hopper"
    assert attn.backward_family(q, k, v, **packed, **inputs) == "hopper"
    testing.check_against_reference(attn.spec, attn, q, k, v, inputs, packed=packed)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("layout", ["dense", "transposed"])
def test_sigmoid_under_inductor_on_gpu(layout, fresh_dynamo):
    # The custom operators of a sigmoid spec (no LSE written, no row terms) under Inductor, which checks every
    # output's strides against the fakes': the compiled step gives the eager step's numbers.
    attn = attngen.build(SIGMOID_ALIBI)
    q, k, v = testing.random_qkv(2, 8, 8, 512, 512, 128, 128, torch.bfloat16, device="cuda", layout=layout)
    inputs = _gpu_inputs(attn, 2, 8, 8, 512, 512)

    def step(q, k, v):
        return attn(q, k, v, **inputs).float().square().sum()

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(step(*leaves), leaves)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    got = torch.autograd.grad(torch.compile(step, fullgraph=True)(*leaves), leaves)
    for a, b in zip(got, want):
        assert not a.isnan().any()
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
