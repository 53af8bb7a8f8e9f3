"""Packed calls: attn(q, k, v, cu_seqlens_q=..., cu_seqlens_k=..., max_seqlen_q=..., max_seqlen_k=...) in
FlashAttention's varlen layout, against the float64 reference of each sequence alone; the grid follows
the sequences (no program reads another's tokens); their errors; torch.compile."""

from pathlib import Path

import pytest
import torch

import attngen
from attngen import reference, testing
from attngen.families.hopper import runtime as runtime_hopper
from attngen.runtime import shared as runtime_shared
from conftest import SLOW_IN_INTERPRETER

SPECS = Path(__file__).parent.parent / "specs"
CATALOG = sorted(p.stem for p in SPECS.glob("*.attn"))
H, HKV, D = 4, 2, 16  # GQA
# On a GPU machine the same tests run the compiled kernels (there, CPU tensors are refused).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Query and key lengths of each sequence: empty ones on either side, single tokens, lengths across tiles.
LENGTHS_Q = [5, 0, 1, 37, 18, 3]
LENGTHS_K = [9, 3, 1, 37, 0, 20]


def _offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


def _case(attn, lengths_q=LENGTHS_Q, lengths_k=LENGTHS_K, seed=0):
    """Packed q (TOTAL_Q, H, D), k, v (TOTAL_K, HKV, D), the spec's inputs for the call and its keywords."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lengths_q), H, D, generator=g).to(DEVICE)
    k, v = (torch.randn(sum(lengths_k), HKV, D, generator=g).to(DEVICE) for _ in range(2))
    packed = dict(cu_seqlens_q=_offsets(lengths_q), cu_seqlens_k=_offsets(lengths_k),
                  max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k))
    inputs = testing.random_inputs(attn.spec, len(lengths_q), H, HKV, max(lengths_q), max(lengths_k), seed=seed,
                                   device=DEVICE)
    return q, k, v, inputs, packed


# By default (on the CPU) the specs whose masks or inputs read positions, lengths or the sequence (b), a tile table,
# a learnable table and no mask; the slow tier the three others (causal, chunked_causal, gemma2_local:
# a top-left mask, a chunk of positions and a softcap, each also reached by the ones by default).
PACKED_SLOW = ["causal", "chunked_causal", "gemma2_local"]


@pytest.mark.parametrize("name", [pytest.param(name, marks=SLOW_IN_INTERPRETER) if name in PACKED_SLOW else name
                                  for name in CATALOG])
def test_packed_calls_match_the_reference_of_each_sequence(name, build_small):
    attn = build_small(name)
    q, k, v, inputs, packed = _case(attn)
    assert attn.forward_family(q, k, v, **inputs, **packed) == "portable"
    assert attn.backward_family(q, k, v, **inputs, **packed) == "portable"
    testing.check_against_reference(attn.spec, attn, q, k, v, inputs, packed=packed)


def test_a_sequence_of_a_packed_call_is_the_call_of_that_sequence_alone(build_small):
    attn = build_small("alibi_causal")
    q, k, v, inputs, packed = _case(attn)
    out, lse = attn(q, k, v, return_lse=True, **inputs, **packed)
    b = 3
    start_q, start_k = sum(LENGTHS_Q[:b]), sum(LENGTHS_K[:b])
    alone = [t.transpose(0, 1).unsqueeze(0) for t in (q[start_q:start_q + LENGTHS_Q[b]],
                                                      k[start_k:start_k + LENGTHS_K[b]],
                                                      v[start_k:start_k + LENGTHS_K[b]])]
    want, want_lse = attn(*alone, return_lse=True, slopes=inputs["slopes"])
    torch.testing.assert_close(out[start_q:start_q + LENGTHS_Q[b]], want[0].transpose(0, 1))
    torch.testing.assert_close(lse[:, start_q:start_q + LENGTHS_Q[b]], want_lse[0])


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # the other sequences' own rows, in the interpreter
def test_no_program_reads_another_sequence(build_small):
    """Every other sequence's tokens are NaN: a program that loaded one would spread it."""
    attn = build_small("full")
    q, k, v, inputs, packed = _case(attn)
    b = 3
    keep_q = torch.zeros(q.shape[0], dtype=torch.bool, device=DEVICE)
    keep_k = torch.zeros(k.shape[0], dtype=torch.bool, device=DEVICE)
    keep_q[sum(LENGTHS_Q[:b]):sum(LENGTHS_Q[:b + 1])] = True
    keep_k[sum(LENGTHS_K[:b]):sum(LENGTHS_K[:b + 1])] = True
    q, k, v = (torch.where(keep[:, None, None], t, float("nan")).requires_grad_()
               for t, keep in ((q, keep_q), (k, keep_k), (v, keep_k)))
    out, lse = attn(q, k, v, return_lse=True, **packed)
    (out[keep_q].sum() + lse[:, keep_q].sum()).backward()
    for name, t in (("out", out[keep_q]), ("lse", lse[:, keep_q]), ("dq", q.grad[keep_q]), ("dk", k.grad[keep_k]),
                    ("dv", v.grad[keep_k])):
        assert torch.isfinite(t).all(), f"{name} of sequence {b} read another sequence's NaN"


def test_the_grid_visits_each_sequences_own_tiles_only(build_small):
    attn = build_small("full")
    q, k, v, inputs, packed = _case(attn)
    counts = attn.visit_counts(q, k, v, **packed)
    module = attn.module
    for kernel, number in {"fwd": 0, "dkdv": 1, "dq": 2}.items():
        block_m, block_n = module._tiles(runtime_shared._packed_view(q), runtime_shared._packed_view(v), number)[:2]
        block_rows, block_cols = (block_n, block_m) if kernel == "dkdv" else (block_m, block_n)
        for b, (n_q, n_k) in enumerate(zip(LENGTHS_Q, LENGTHS_K)):
            rows, cols = (n_k, n_q) if kernel == "dkdv" else (n_q, n_k)
            want = torch.zeros_like(counts[kernel][b])
            # A full mask: every tile of the sequence once, with mask code only where it runs past the end.
            want[:, :-(-rows // block_rows), :-(-cols // block_cols)] = 1 if rows and cols else 0
            assert torch.equal(counts[kernel][b] > 0, want > 0), f"{kernel}: sequence {b} visits other tiles"
            assert set(counts[kernel][b].unique().tolist()) <= {0, 1, 16}, f"{kernel}: a tile visited twice"


def test_the_packed_reference_is_the_batch_reference_for_equal_lengths(build_small):
    attn = build_small("prefix_lm")
    q, k, v, inputs, packed = _case(attn, [6, 6], [9, 9])
    out, lse = reference.evaluate_packed(attn.spec, q, k, v, inputs, **packed)
    batch = [t.view(2, -1, *t.shape[1:]).transpose(1, 2) for t in (q, k, v)]
    want, want_lse = reference.evaluate(attn.spec, *batch, inputs)
    torch.testing.assert_close(out, want.transpose(1, 2).reshape(out.shape))
    torch.testing.assert_close(lse, want_lse.transpose(0, 1).reshape(lse.shape))


def test_packed_call_errors(build_small):
    attn = build_small("document_causal")
    q, k, v, inputs, packed = _case(attn)

    def call(q=q, k=k, v=v, **changes):
        return attn(q, k, v, **inputs, **{**packed, **changes})

    with pytest.raises(ValueError, match=r"q must have 3 dims \(TOTAL, heads, head_dim\) in a packed call"):
        call(q=q[None])
    with pytest.raises(ValueError, match="cu_seqlens_q must be a 1-D int32 tensor"):
        call(cu_seqlens_q=packed["cu_seqlens_q"].long())
    with pytest.raises(ValueError, match="cu_seqlens_k must have 7 offsets like cu_seqlens_q"):
        call(cu_seqlens_k=packed["cu_seqlens_k"][:-1])
    with pytest.raises(ValueError, match="max_seqlen_q must be a Python int"):
        call(max_seqlen_q=torch.tensor(37))
    with pytest.raises(ValueError, match=r"max_seqlen_k must lie in \[1, "):
        call(max_seqlen_k=0)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must rise from 0 to TOTAL = 64 \(q.shape\[0\]\)"):
        call(cu_seqlens_q=packed["cu_seqlens_q"].flip(0))
    with pytest.raises(ValueError, match="max_seqlen_q must be at least every sequence's length, got 36"):
        call(max_seqlen_q=36)
    with pytest.raises(ValueError, match=r"input 'doc' must have shape \(37\) \(i32\[KV_LEN\]\), got \(20,\)"):  # KV_LEN is max_seqlen_k
        attn(q, k, v, doc=inputs["doc"][:20], **packed)
    with pytest.raises(ValueError, match="kv_len, q_offset and page_table must be None in a packed call"):
        call(kv_len=torch.ones(6, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="tile_tables must be None in a packed call"):
        call(tile_tables=object())
    # Any one of the four keywords makes a packed call, in attn and in the instrumentation alike: a lone
    # max_seqlen is an error, not ignored.
    for query in (attn, attn.forward_family, attn.backward_family, attn.visit_counts):
        with pytest.raises(ValueError, match="cu_seqlens_q must be a 1-D int32 tensor"):
            query(q, k, v, **inputs, max_seqlen_q=37)


def test_packed_calls_of_the_same_facts_share_a_plan(build_small, monkeypatch):
    """A packed call's checks and families are decided once per set of facts (the tensors', the offsets'
    and the longest lengths'): calls of other offsets of the same facts reuse the plan, and anything the
    checks read makes another key, so a call they would stop is still stopped."""
    attn = build_small("document_causal")
    q, k, v, inputs, packed = _case(attn)
    monkeypatch.setattr(attn.module.ATTENTION, "call_plans", {})
    attn(q, k, v, **inputs, **packed)
    shifted = packed["cu_seqlens_q"].clone()
    shifted[1:-1] = shifted[1:-1].clamp(max=shifted[-1] - 5)  # other lengths, still at most max_seqlen_q
    attn(q, k, v, **inputs, **{**packed, "cu_seqlens_q": shifted})
    assert len(attn.module.ATTENTION.call_plans) == 1
    with pytest.raises(ValueError, match="max_seqlen_q must be a Python int"):  # 37.0 == 37 as a dict key
        attn(q, k, v, **inputs, **{**packed, "max_seqlen_q": float(packed["max_seqlen_q"])})
    with pytest.raises(ValueError, match=r"input 'doc' must have shape"):
        attn(q, k, v, doc=inputs["doc"][:20], **packed)


def test_offsets_are_checked_again_after_a_write(build_small):
    """Offsets that passed the check are not read again on the host (a model passes them to every layer),
    until they change: an in-place write, through any view, and a new tensor at the same address are
    checked."""
    attn = build_small("document_causal")
    q, k, v, inputs, packed = _case(attn)
    cu = packed["cu_seqlens_q"].clone()
    attn(q, k, v, **inputs, **{**packed, "cu_seqlens_q": cu})
    cu[1:][:1].add_(100)  # a write through a view: the first sequence ends past the second
    with pytest.raises(ValueError, match="cu_seqlens_q must rise from 0 to TOTAL"):
        attn(q, k, v, **inputs, **{**packed, "cu_seqlens_q": cu})
    del cu
    bad = packed["cu_seqlens_q"].flip(0).contiguous()  # a new tensor, perhaps where the old one was
    with pytest.raises(ValueError, match="cu_seqlens_q must rise from 0 to TOTAL"):
        attn(q, k, v, **inputs, **{**packed, "cu_seqlens_q": bad})
    with torch.inference_mode():  # no version counter: checked every call
        good = packed["cu_seqlens_q"].clone()
        attn(q, k, v, **inputs, **{**packed, "cu_seqlens_q": good})
        good[1] += 100
        with pytest.raises(ValueError, match="cu_seqlens_q must rise from 0 to TOTAL"):
            attn(q, k, v, **inputs, **{**packed, "cu_seqlens_q": good})


@pytest.mark.parametrize("lengths", [[300, 1, 0, 700], [1, 256], [5, 3, 8, 0, 1]])
def test_hopper_row_terms_start_each_sequence_at_an_aligned_column(lengths):
    """TMA reads the backward's fp32 LSE and delta rows from 16-byte-aligned columns only (an unaligned
    one was an illegal instruction on the H200 for a sequence starting at row 301): the Hopper launch
    moves sequence b's rows to column 4 * (cu_seqlens_q[b] // 4 + b), where the kernel reads them, each
    row once, the gaps filled and no sequence overlapping the next."""
    cu = _offsets(lengths)
    total, block_m = sum(lengths), 64
    rows = torch.arange(2 * total, dtype=torch.float32).view(1, 2, total) + 1
    columns = runtime_hopper._hopper_sequence_columns((cu, cu, max(lengths), max(lengths), total), block_m,
                                                      store=False)
    moved = runtime_hopper._hopper_sequence_rows(rows, columns, -1.0)
    assert moved.shape[:2] == (1, 2) and moved.shape[2] % block_m == 0
    for b, n in enumerate(lengths):
        start = int(cu[b])
        column = 4 * (start // 4 + b)
        assert column % 4 == 0 and column + n <= moved.shape[2]
        assert torch.equal(moved[..., column:column + n], rows[..., start:start + n])
    assert int((moved == -1.0).sum()) == moved.numel() - rows.numel()  # every row once, the rest filled


# Inductor checks the packed operators' output strides against their fakes; aot_eager on the CPU does not.
COMPILERS = [dict(backend="aot_eager"),
             pytest.param(dict(backend="inductor"), marks=pytest.mark.gpu, id="inductor"),
             pytest.param(dict(backend="inductor", dynamic=True), marks=pytest.mark.gpu, id="inductor-dynamic")]


@pytest.mark.parametrize("compiler", COMPILERS)
def test_packed_calls_under_torch_compile(build_small, compiler):
    torch._dynamo.reset()
    attn = build_small("learned_rel_bias")
    q, k, v, inputs, packed = _case(attn, [5, 0, 17], [9, 3, 17])

    def loss(q, k, v, table):
        out, lse = attn(q, k, v, return_lse=True, table=table, **packed)
        return out.square().sum() + torch.where(lse.isfinite(), lse, 0).sum()

    grads = []
    for fn in (loss, torch.compile(loss, fullgraph=True, **compiler)):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, inputs["table"])]
        fn(*leaves).backward()
        grads.append([t.grad for t in leaves])
    for eager, compiled in zip(*grads):
        torch.testing.assert_close(compiled, eager)
    torch._dynamo.reset()


def test_opcheck_of_the_packed_operators(build_small):
    # The fakes torch.compile plans with must give the real operators' shapes, strides and dtypes.
    attn = build_small("learned_rel_bias")
    q, k, v, inputs, packed = _case(attn, [5, 0, 17], [9, 3, 17])
    forward_op, backward_op = attn.module.OPERATORS[4:6]
    args = (packed["cu_seqlens_q"], packed["cu_seqlens_k"], packed["max_seqlen_q"], packed["max_seqlen_k"])
    tensors = [inputs["table"]]
    torch.library.opcheck(forward_op, (q, k, v, tensors, *args, [], [], 0.0), test_utils=("test_schema", "test_faketensor"))
    out, lse = forward_op(q, k, v, tensors, *args, [], [], 0.0)
    torch.library.opcheck(backward_op, (q, k, v, out, lse, torch.randn_like(out), torch.randn_like(lse), tensors, *args,
                                        [], 0.0),
                          test_utils=("test_schema", "test_faketensor"))


ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _model_batch(lengths, heads, kv_heads, head_dim, dtype, seed=1):
    """A model's packed batch on the GPU: q, k, v views of one fused (TOTAL, heads + 2 * kv_heads, D)
    projection (not contiguous), and the call's keywords."""
    g = torch.Generator().manual_seed(seed)
    fused = torch.randn(sum(lengths), heads + 2 * kv_heads, head_dim, generator=g).to("cuda", dtype)
    q, k, v = fused.split([heads, kv_heads, kv_heads], dim=1)
    offsets = _offsets(lengths)
    return q, k, v, dict(cu_seqlens_q=offsets, cu_seqlens_k=offsets, max_seqlen_q=max(lengths),
                         max_seqlen_k=max(lengths))


# Sequences from 0 to 700 tokens: empty, single, ragged and several tiles long; windows that cut them.
MODEL_LENGTHS = [300, 1, 0, 700, 77, 129]
WINDOWS = {"sliding_window": {"window": 100}, "gemma2_local": {"window": 100, "cap": 20.0}}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", ["causal", "sliding_window", "alibi_causal", "learned_rel_bias", "gemma2_local"])
def test_packed_half_precision_on_gpu(name, dtype):
    """Head dim 128 on an H200: the Hopper family's kernels, against the float64 reference of each sequence."""
    attn = attngen.build(SPECS / f"{name}.attn", params=WINDOWS.get(name, {}))
    q, k, v, packed = _model_batch(MODEL_LENGTHS, 8, 8, 128, dtype)
    assert not q.is_contiguous()
    inputs = testing.random_inputs(attn.spec, len(MODEL_LENGTHS), 8, 8, max(MODEL_LENGTHS), max(MODEL_LENGTHS),
                                   seed=1, device="cuda")
    if ON_HOPPER:
        families = attn.forward_family(q, k, v, **inputs, **packed), attn.backward_family(q, k, v, **inputs, **packed)
        assert families == ("hopper", "hopper")
    testing.check_against_reference(attn.spec, attn, q, k, v, inputs, packed=packed)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 96, 256])
def test_packed_gqa_head_dims_on_gpu(head_dim):
    """Grouped-query heads (8 over 2) at head dims the Hopper family tiles differently; lengths across
    its 128-row tiles, one sequence of keys only (no queries) and one of queries with few keys."""
    attn = attngen.build(SPECS / "prefix_lm.attn")
    lengths_q, lengths_k = [130, 0, 257, 5, 64], [130, 3, 257, 200, 64]
    g = torch.Generator().manual_seed(2)
    q = torch.randn(sum(lengths_q), 8, head_dim, generator=g).to("cuda", torch.bfloat16)
    k, v = (torch.randn(sum(lengths_k), 2, head_dim, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    packed = dict(cu_seqlens_q=_offsets(lengths_q), cu_seqlens_k=_offsets(lengths_k), max_seqlen_q=max(lengths_q),
                  max_seqlen_k=max(lengths_k))
    inputs = testing.random_inputs(attn.spec, len(lengths_q), 8, 2, max(lengths_q), max(lengths_k), seed=2,
                                   device="cuda")
    if ON_HOPPER:
        families = attn.forward_family(q, k, v, **inputs, **packed), attn.backward_family(q, k, v, **inputs, **packed)
        assert families == ("hopper", "hopper")
    testing.check_against_reference(attn.spec, attn, q, k, v, inputs, packed=packed)


@pytest.mark.gpu
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_packed_model_batch_under_inductor_on_gpu(dynamic):
    """A compiled training step on a model's packed batch (the Hopper family on an H200) gives the eager
    step's numbers: Inductor checks the packed operators' strides against their fakes."""
    torch._dynamo.reset()
    attn = attngen.build(SPECS / "causal.attn")
    q, k, v, packed = _model_batch(MODEL_LENGTHS, 8, 2, 128, torch.bfloat16)

    def step(q, k, v):
        out = attn(q, k, v, **packed)
        return (out.float().square() * 0.5).sum() + out.float().sum()

    results = []
    for fn in (step, torch.compile(step, fullgraph=True, dynamic=dynamic)):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        loss = fn(*leaves)
        results.append((loss, torch.autograd.grad(loss, leaves)))
    (eager_loss, eager_grads), (loss, grads) = results
    torch.testing.assert_close(loss, eager_loss, rtol=1e-3, atol=1e-3)
    for got, want in zip(grads, eager_grads):
        assert not got.isnan().any()
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["causal", "document_causal", "learned_rel_bias"])
def test_a_training_step_never_waits_for_the_gpu(name):
    """Once a batch's offsets were checked, a packed forward+backward issues its kernels without reading
    anything back (a sync leaves the GPU idle while the host prepares the next launches: two of them,
    in the Hopper backward's row alignment, made a 16 x 1k step 2.2 ms of wall time for 0.97 ms of
    kernels); a dense call of the same tokens, once planned, never syncs either. torch's sync debug mode
    raises on any synchronizing call."""
    attn = attngen.build(SPECS / f"{name}.attn")
    lengths = [300, 1, 0, 700, 77, 129]
    q, k, v, packed = _model_batch(lengths, 8, 2, 128, torch.bfloat16)
    calls = {"packed": ((q, k, v), packed, len(lengths), max(lengths)),
             "dense": ([t.unsqueeze(0).transpose(1, 2) for t in (q, k, v)], {}, 1, sum(lengths))}
    for kind, (tensors, keywords, B, N) in calls.items():
        inputs = testing.random_inputs(attn.spec, B, 8, 2, N, N, seed=1, device="cuda")
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        leaves += [t for t in inputs.values() if t.requires_grad]

        def step():
            out = attn(*leaves[:3], **inputs, **keywords)
            torch.autograd.grad(out, leaves, torch.ones_like(out))
        step()  # the first call checks the offsets and plans: it may read them back
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
        except RuntimeError as error:
            raise AssertionError(f"the {kind} call synchronized: {error}") from error
        finally:
            torch.cuda.set_sync_debug_mode("default")
