"""Cache calls: attn(q, k, v, kv_len=..., q_offset=...) against the float64 reference, which puts
query i of row b at position q_offset[b] + i and makes KV_LEN row b's kv_len[b]; and their errors.

Both forward families serve them: the decode kernels when (H / HKV) * Q_LEN fits one tile, the
portable forward otherwise (chunked prefill)."""

from pathlib import Path

import pytest
import torch

import attngen
from attngen import reference, testing
from attngen.testing import strategies
from conftest import tiered

SPECS = Path(__file__).parent.parent / "specs"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (B, H, HKV, Q_LEN, MAX_KV, D): decode (GQA, one and several queries) and chunked prefill.
SHAPES = [(3, 8, 2, 1, 150, 16), (2, 4, 2, 6, 90, 32), (2, 2, 1, 40, 100, 16)]
CATALOG = sorted(p.stem for p in SPECS.glob("*.attn"))


def _case(attn, shape, dtype=torch.float32, seed=0):
    B, H, HKV, N, M, D = shape
    torch.manual_seed(seed)
    q, k, v = testing.random_qkv(B, H, HKV, N, M, D, D, dtype, device=DEVICE)
    inputs = testing.random_inputs(attn.spec, B, H, HKV, N, M, device=DEVICE, query_positions=M + 17 + N)
    kv_len = torch.randint(N, M + 1, (B,), dtype=torch.int32, device=DEVICE)
    kv_len[0] = M  # one row uses the whole cache
    return q, k, v, inputs, kv_len


def _assert_matches(attn, q, k, v, inputs, **cache):
    with torch.no_grad():
        if attn.spec.sigmoid:  # no LSE
            out, lse = attn(q, k, v, **inputs, **cache), None
        else:
            out, lse = attn(q, k, v, return_lse=True, **inputs, **cache)
    want, want_lse = reference.evaluate(attn.spec, q.double(), k.double(), v.double(), inputs, **cache)
    tol = 1e-5 if q.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    if lse is not None:
        torch.testing.assert_close(lse.double(), want_lse, atol=tol, rtol=tol)


def _ids(case):
    return "-".join(c if isinstance(c, str) else "x".join(map(str, c)) if isinstance(c, tuple) else str(c)
                    for c in case)


# Each spec in chunked prefill (the portable forward) and in one of the two decode shapes, which turn
# with the spec; the slow tier runs the other decode shape.
CACHE_CASES = tiered([(name, shape) for name in CATALOG for shape in SHAPES],
                     [(name, shape) for i, name in enumerate(CATALOG) for shape in (SHAPES[i % 2], SHAPES[2])],
                     ids=_ids)


@pytest.mark.parametrize("name, shape", CACHE_CASES)
def test_cache_calls_match_the_reference(name, shape, build_small):
    attn = build_small(name)
    q, k, v, inputs, kv_len = _case(attn, shape)
    family = attn.forward_family(q, k, v, **inputs)
    # block_sparse's layout is per query head, which a decode tile mixes: the portable forward serves it.
    decodes = "decode" in attn.plan.families and shape[3] * shape[1] // shape[2] <= 64
    assert family == ("decode" if decodes else "portable")
    assert ("decode" in attn.plan.families) == (name != "block_sparse")
    _assert_matches(attn, q, k, v, inputs, kv_len=kv_len)  # the queries are the newest tokens
    q_offset = torch.tensor([0, 17, 3][:shape[0]], dtype=torch.int32, device=DEVICE)
    _assert_matches(attn, q, k, v, inputs, kv_len=kv_len, q_offset=q_offset)
    _assert_matches(attn, q, k, v, inputs, q_offset=q_offset)  # offsets alone: every key valid


def test_cache_calls_in_half_precision(build_small):
    attn = build_small("alibi_causal")
    q, k, v, inputs, kv_len = _case(attn, SHAPES[0], torch.float16)
    _assert_matches(attn, q, k, v, inputs, kv_len=kv_len)


def test_the_reference_cache_semantics():
    spec = attngen.parse_spec("attention c\nmask: k <= q\n")
    q, k, v = testing.random_qkv(2, 2, 2, 3, 10, 8, 8, torch.float64)
    kv_len = torch.tensor([10, 6], dtype=torch.int32)
    out, lse = reference.evaluate(spec, q, k, v, kv_len=kv_len)
    # Row 1: the first 6 keys, queries at positions 3, 4, 5 (the newest tokens): bottom-right causal.
    sliced = attngen.parse_spec("attention c\nmask: k <= q + 3\n")
    want, want_lse = reference.evaluate(sliced, q[1:], k[1:, :, :6], v[1:, :, :6])
    torch.testing.assert_close(out[1:], want)
    torch.testing.assert_close(lse[1:], want_lse)
    # No kv_len and no offset: the training semantics.
    plain, _ = reference.evaluate(spec, q, k, v)
    torch.testing.assert_close(reference.evaluate(spec, q, k, v, q_offset=torch.zeros(2, dtype=torch.int32))[0], plain)


def _bottom_right_by_hand(q, k, v, kv_len):
    """O of `causal_bottom_right` in a cache call, written out: row i of batch b sees the keys
    k <= i + kv_len[b] - Q_LEN below kv_len[b], wherever q_offset places the row; a row with no
    such key gives 0."""
    B, H, N, D = q.shape
    M = k.shape[2]
    k, v = (x.repeat_interleave(H // x.shape[1], dim=1) for x in (k, v))
    row, key = torch.arange(N).view(N, 1), torch.arange(M).view(1, M)
    n = kv_len.long().view(B, 1, 1, 1).cpu()
    allowed = ((key <= row + n - N) & (key < n)).to(q.device)
    scores = (q @ k.transpose(-2, -1) / D ** 0.5).masked_fill(~allowed, float("-inf"))
    p = torch.where(allowed.any(-1, keepdim=True), scores.softmax(-1), 0.0)
    return p.to(v.dtype) @ v


def test_the_reference_aligns_causal_bottom_right_by_row_in_cache_calls():
    spec = attngen.parse_spec("attention c\nmask: causal_bottom_right\n")
    q, k, v = testing.random_qkv(3, 4, 2, 5, 12, 8, 8, torch.float64)
    kv_len = torch.tensor([12, 7, 3], dtype=torch.int32)  # row 2's first two queries see no key
    want = _bottom_right_by_hand(q, k, v, kv_len)
    for q_offset in (None, torch.tensor([0, 30, 5], dtype=torch.int32)):
        out, _ = reference.evaluate(spec, q, k, v, kv_len=kv_len, q_offset=q_offset)
        torch.testing.assert_close(out, want)
    # With the default offset the queries sit at positions kv_len - Q_LEN + i: it is `causal`.
    causal = attngen.parse_spec("attention c\nmask: causal\n")
    torch.testing.assert_close(reference.evaluate(causal, q, k, v, kv_len=kv_len)[0], want)
    # A training call is the cache call whose every row uses the whole cache.
    full = torch.full((3,), 12, dtype=torch.int32)
    torch.testing.assert_close(reference.evaluate(spec, q, k, v)[0], _bottom_right_by_hand(q, k, v, full))


@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_causal_bottom_right_cache_calls_align_rows(shape, page_size, build_small):
    # Decoding (one query) and chunked prefill (several), by the decode family and the portable forward:
    # a cache call is the plain call on the row's keys, whatever q_offset says, and never sees a later
    # token of its own chunk.
    attn = build_small("causal_bottom_right")
    *sizes, M, D = shape
    M = M if page_size is None else -(-M // page_size) * page_size
    q, k, v, _, kv_len = _case(attn, (*sizes, M, D))
    kc, vc, paging = k, v, {}
    if page_size is not None:
        kc, vc, table = strategies.paged(k, v, page_size, seed=1)
        paging["page_table"] = table
    plain = [attn(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], return_lse=True) for b, n in enumerate(kv_len)]
    plain_out, plain_lse = (torch.cat(parts) for parts in zip(*plain))
    q_offset = torch.tensor([0, 17, 3][:shape[0]], dtype=torch.int32, device=DEVICE)
    for cache in ({"kv_len": kv_len}, {"kv_len": kv_len, "q_offset": q_offset}):
        with torch.no_grad():
            out, lse = attn(q, kc, vc, return_lse=True, **paging, **cache)
        want, want_lse = reference.evaluate(attn.spec, q.double(), k.double(), v.double(), **cache)
        torch.testing.assert_close(want, _bottom_right_by_hand(q.double(), k.double(), v.double(), kv_len))
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out, plain_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, plain_lse, atol=1e-5, rtol=1e-5)


def test_rows_with_no_key_give_zero_and_minus_infinity(build_small):
    attn = build_small("causal")
    q, k, v = testing.random_qkv(2, 4, 2, 1, 40, 16, 16, torch.float32, device=DEVICE)
    kv_len = torch.tensor([0, 20], dtype=torch.int32, device=DEVICE)
    q_offset = torch.tensor([0, 5], dtype=torch.int32, device=DEVICE)
    out, lse = attn(q, k, v, kv_len=kv_len, q_offset=q_offset, return_lse=True)
    assert torch.all(out[0] == 0) and torch.all(lse[0] == float("-inf"))
    _assert_matches(attn, q, k, v, {}, kv_len=kv_len, q_offset=q_offset)


def test_cache_call_errors(build_small):
    attn = build_small("causal")
    q, k, v = testing.random_qkv(2, 4, 2, 3, 40, 16, 16, torch.float32, device=DEVICE)
    lengths = torch.tensor([40, 10], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"kv_len must be an int32 tensor of shape \(2,\)"):
        attn(q, k, v, kv_len=lengths.long())
    with pytest.raises(ValueError, match=r"kv_len must lie in \[0, 40\]"):
        attn(q, k, v, kv_len=lengths + 1, check_values=True)
    with pytest.raises(ValueError, match=r"q_offset \(by default kv_len - Q_LEN\) ranges over \[-1, 37\]"):
        attn(q, k, v, kv_len=torch.tensor([40, 2], dtype=torch.int32, device=DEVICE), check_values=True)
    with pytest.raises(ValueError, match="has no backward pass"):
        attn(q.requires_grad_(), k, v, kv_len=lengths)
    documents = attngen.build(SPECS / "document_causal.attn")
    doc = torch.zeros(40, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="tile_tables must be None in a call with kv_len"):
        documents(q.detach(), k, v, kv_len=lengths, doc=doc, tile_tables=documents.tile_tables(q.detach(), k, v, doc=doc))


def test_cache_values_are_checked_again_after_a_write(build_small):
    """The layers of one decoding step pass the same kv_len and page table: values that passed the host check
    are not read again until they change (an in-place write, as a decoding loop advances kv_len)."""
    attn = build_small("causal")
    q, k, v, _, kv_len = _case(attn, SHAPES[1])
    k_pages, v_pages, table = strategies.paged(k, v, 16, seed=1)
    with torch.no_grad():
        attn(q, k_pages, v_pages, page_table=table, kv_len=kv_len, check_values=True)
        table[0, 0] = 100  # a page past the cache, for a page row 0 uses
        with pytest.raises(ValueError, match=r"page_table must name pages in \[0, 13\)"):
            attn(q, k_pages, v_pages, page_table=table, kv_len=kv_len, check_values=True)
        table[0, 0] = 0
        attn(q, k_pages, v_pages, page_table=table, kv_len=kv_len, check_values=True)
        kv_len += 1000  # past the cache
        with pytest.raises(ValueError, match=r"kv_len must lie in \[0, 96\]"):
            attn(q, k_pages, v_pages, page_table=table, kv_len=kv_len, check_values=True)


def _bad_rows(out, lse):
    """Which batch rows are NaN in every element of O and LSE, after checking no other row has a NaN."""
    bad = out.isnan().flatten(1).all(1)
    assert torch.equal(bad, out.isnan().flatten(1).any(1)), "a row is NaN in part"
    if lse is not None:
        assert torch.equal(bad, lse.isnan().flatten(1).all(1)) and torch.equal(bad, lse.isnan().flatten(1).any(1))
    return bad.tolist()


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2]], ids=["decode", "prefill"])
def test_cache_values_out_of_range_give_nan_rows_without_a_host_check(build_small, shape):
    """By default a cache call's values are checked on the device (no sync): each batch row whose kv_len,
    query positions or used pages lie outside the cache gets NaN in O and LSE; the other rows keep the
    reference's values. The host check (check_values=True) refuses the same call with a message."""
    attn = build_small("alibi_causal")
    q, k, v, inputs, kv_len = _case(attn, shape)
    B, N, M = q.shape[0], q.shape[2], k.shape[2]
    good = kv_len.clone()
    with torch.no_grad():
        for bad_len, want in (([M + 1] + good.tolist()[1:], [True] + [False] * (B - 1)),
                              (good.tolist()[:-1] + [-1], [False] * (B - 1) + [True])):
            bad = torch.tensor(bad_len, dtype=torch.int32, device=DEVICE)
            out, lse = attn(q, k, v, kv_len=bad, return_lse=True, **inputs)
            assert _bad_rows(out, lse) == want, bad_len
            with pytest.raises(ValueError, match="must lie in"):  # kv_len's range, or the positions' it gives
                attn(q, k, v, kv_len=bad, check_values=True, **inputs)
        # A query position past the spec's longest (q_offset given) or before 0 (kv_len below Q_LEN).
        offsets = torch.zeros(B, dtype=torch.int32, device=DEVICE)
        offsets[1] = attn.module.FACTS.max_length - N + 1
        out, lse = attn(q, k, v, kv_len=good, q_offset=offsets, return_lse=True, **inputs)
        assert _bad_rows(out, lse) == [i == 1 for i in range(B)]
        if N > 1:
            short = good.clone()
            short[0] = N - 1
            out, lse = attn(q, k, v, kv_len=short, return_lse=True, **inputs)
            assert _bad_rows(out, lse) == [i == 0 for i in range(B)]
        # The good rows of a call with a bad one hold the reference's values.
        out = attn(q, k, v, kv_len=bad, **inputs)
    want, _ = reference.evaluate(attn.spec, q.double(), k.double(), v.double(), inputs, kv_len=good)
    torch.testing.assert_close(out[:-1].double(), want[:-1], atol=1e-5, rtol=1e-5)


def test_paged_cache_pages_out_of_range_give_nan_rows(build_small):
    """A page number outside [0, NUM_PAGES) makes its row NaN only where the row uses that page (a page past
    the row's kv_len is never read); a sigmoid spec (no LSE) too."""
    for name in ("causal", "sigmoid_alibi"):
        attn = build_small(name)
        q, k, v, inputs, kv_len = _case(attn, SHAPES[1])
        k_pages, v_pages, table = strategies.paged(k, v, 16, seed=1)
        kv_len[1] = 20  # row 1 uses pages 0 and 1 of its table
        table[0, 1] = -1
        table[1, 2] = table.max() + 1  # past the cache, but row 1 never reads it
        with torch.no_grad():
            out = attn(q, k_pages, v_pages, page_table=table, kv_len=kv_len, **inputs)
            assert _bad_rows(out, None) == [True, False], name
            table[1, 1] = 10**6
            out = attn(q, k_pages, v_pages, page_table=table, kv_len=kv_len, **inputs)
            assert _bad_rows(out, None) == [True, True], name


def test_a_decode_step_checks_its_values_in_the_merge_and_launches_no_check_kernel(build_small, monkeypatch):
    """The decode family's merge checks a cache call's values (the NaN rows above), so a decoding step makes
    two launches, none of them the separate check kernel; a chunked prefill, which the portable forward
    runs, launches that kernel after its forward."""
    from attngen.runtime import kvcache
    attn = build_small("alibi_causal")
    runtime = attn.module.ATTENTION
    checks = []
    launch = kvcache._launch
    monkeypatch.setattr(kvcache, "_launch", lambda kernel, *args, **kw: checks.append(kernel) or launch(kernel, *args, **kw))
    with torch.no_grad():
        for shape, family, launched in ((SHAPES[0], "decode", []), (SHAPES[2], "portable", [kvcache._cache_values_check])):
            q, k, v, inputs, kv_len = _case(attn, shape)
            assert runtime._forward_family(q, k, v, k.shape[1], k.shape[2], True)[0] == family
            checks.clear()
            attn(q, k, v, kv_len=kv_len, **inputs)
            assert checks == launched, family


def test_cache_calls_under_torch_compile(build_small):
    attn = build_small("sliding_window")
    q, k, v, inputs, kv_len = _case(attn, SHAPES[0])
    compiled = torch.compile(lambda q, k, v, n: attn(q, k, v, kv_len=n), backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(q, k, v, kv_len), attn(q, k, v, kv_len=kv_len))


def test_merge_of_two_halves_is_the_whole(build_small):
    attn = build_small("full")
    q, k, v = testing.random_qkv(2, 4, 2, 3, 50, 16, 16, torch.float32, device=DEVICE)
    whole, whole_lse = attn(q, k, v, return_lse=True)
    parts = [attn(q, k[:, :, s], v[:, :, s], return_lse=True) for s in (slice(0, 21), slice(21, 50))]
    out, lse = attngen.merge([p[0] for p in parts], [p[1] for p in parts])
    torch.testing.assert_close(out, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, whole_lse, atol=1e-5, rtol=1e-5)
    # A part whose rows saw no key weighs nothing; rows with no key anywhere stay 0 and -inf.
    empty_out, empty_lse = torch.zeros_like(out), torch.full_like(lse, float("-inf"))
    torch.testing.assert_close(attngen.merge([out, empty_out], [lse, empty_lse])[0], out)
    none_out, none_lse = attngen.merge([empty_out, empty_out], [empty_lse, empty_lse])
    assert torch.all(none_out == 0) and torch.all(none_lse == float("-inf"))
    with pytest.raises(ValueError, match="as many outputs as LSEs"):
        attngen.merge([out], [])
    with pytest.raises(ValueError, match=r"LSE 1 must be a float \(B, H, Q_LEN\)"):
        attngen.merge([out, out], [lse, lse[:, :1]])


PAGED = ["causal", "alibi_causal", "sliding_window", "learned_rel_bias", "document_causal", "block_sparse"]
# Each spec on every shape; the page size turns with the spec and the shape, so each spec and each shape
# meets both page sizes in the default run. The slow tier runs the rest of the cross product.
PAGED_CASES = tiered([(name, shape, page) for name in PAGED for shape in SHAPES for page in (16, 32)],
                     [(name, shape, (16, 32)[(i + j) % 2]) for i, name in enumerate(PAGED)
                      for j, shape in enumerate(SHAPES)], ids=_ids)


@pytest.mark.parametrize("name, shape, page_size", PAGED_CASES)
def test_paged_cache_calls_match_the_reference(name, shape, page_size, build_small):
    attn = build_small(name)
    # A paged cache holds whole pages, and inputs sized KV_LEN (document ids) follow its length.
    *sizes, M, D = shape
    q, k, v, inputs, kv_len = _case(attn, (*sizes, -(-M // page_size) * page_size, D))
    k_pages, v_pages, table = strategies.paged(k, v, page_size, seed=1)
    # Entries past a row's used pages are never read: they may hold anything.
    used = torch.arange(table.shape[1], device=DEVICE) * page_size < kv_len[:, None].to(DEVICE)
    table = torch.where(used, table, -7)
    # Both families read pages: the same rule as for a contiguous cache picks one.
    assert (attn.forward_family(q, k_pages, v_pages, kv_len=kv_len, page_table=table, **inputs)
            == attn.forward_family(q, k, v, kv_len=kv_len, **inputs))
    for cache in ({"kv_len": kv_len}, {"kv_len": kv_len, "q_offset": torch.full_like(kv_len, 2)}):
        with torch.no_grad():
            out, lse = attn(q, k_pages, v_pages, page_table=table, return_lse=True, **inputs, **cache)
        want, want_lse = reference.evaluate(attn.spec, q.double(), k.double(), v.double(), inputs, **cache)
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)


def test_paged_cache_errors(build_small):
    attn = build_small("causal")
    q, k, v, _, kv_len = _case(attn, SHAPES[1])
    k_pages, v_pages, table = strategies.paged(k, v, 16, seed=1)
    with pytest.raises(ValueError, match="needs kv_len"):
        attn(q, k_pages, v_pages, page_table=table)
    with pytest.raises(ValueError, match="page size .* must be a multiple of 16, got 8"):
        attn(q, k_pages[:, :8], v_pages[:, :8], page_table=table, kv_len=kv_len)
    with pytest.raises(ValueError, match=r"page_table must be an int32 tensor of shape \(2, MAX_PAGES\)"):
        attn(q, k_pages, v_pages, page_table=table.long(), kv_len=kv_len)
    with pytest.raises(ValueError, match=r"page_table must name pages in \[0, 13\)"):
        attn(q, k_pages, v_pages, page_table=table + 100, kv_len=kv_len, check_values=True)
    with pytest.raises(ValueError, match=r"kv_len must lie in \[0, 96\] \(the cache's length, MAX_PAGES \* PAGE_SIZE\)"):
        attn(q, k_pages, v_pages, page_table=table, kv_len=kv_len + 100, check_values=True)


def test_paged_cache_calls_under_torch_compile(build_small):
    attn = build_small("alibi_causal")
    q, k, v, inputs, kv_len = _case(attn, SHAPES[0])
    k_pages, v_pages, table = strategies.paged(k, v, 16, seed=2)
    compiled = torch.compile(lambda q, k, v, n, t, s: attn(q, k, v, kv_len=n, page_table=t, slopes=s),
                             backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(q, k_pages, v_pages, kv_len, table, inputs["slopes"]),
                                   attn(q, k_pages, v_pages, kv_len=kv_len, page_table=table, **inputs))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
def test_cache_calls_replay_in_a_cuda_graph(layout, build_small):
    # A serving loop captures one decoding step and replays it: shapes are static, the lengths (and
    # so the positions) are tensors updated in place, and the call makes no host sync (which would
    # fail the capture). Every replay must match an eager call and the float64 reference.
    attn = build_small("alibi_causal")
    B, H, HKV, N, M, D = 4, 8, 2, 1, 512, 64
    q, k, v = testing.random_qkv(B, H, HKV, N, M, D, D, torch.bfloat16, device="cuda")
    inputs = testing.random_inputs(attn.spec, B, H, HKV, N, M, device="cuda")
    kv_len = torch.tensor([M, 1, 100, 300], dtype=torch.int32, device="cuda")
    kc, vc, call = k, v, {}
    if layout == "paged16":
        kc, vc, table = strategies.paged(k, v, 16, seed=3)
        call["page_table"] = table
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(stream):
        attn(q, kc, vc, kv_len=kv_len, **call, **inputs)  # compiles the kernels outside the capture
        with torch.cuda.graph(graph, stream=stream):
            out = attn(q, kc, vc, kv_len=kv_len, **call, **inputs)
    torch.cuda.current_stream().wait_stream(stream)
    for step, lengths in enumerate(([M, 1, 100, 300], [7, M - 3, 64, 1], [200, 16, 17, M])):
        kv_len.copy_(torch.tensor(lengths, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
        with torch.no_grad():
            eager = attn(q, kc, vc, kv_len=kv_len, **call, **inputs)
        assert torch.equal(out, eager), f"replay {step} differs from the eager call"
        want, _ = reference.evaluate(attn.spec, q.double(), k.double(), v.double(), inputs, kv_len=kv_len)
        torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
        if step == 2:  # the device check runs in the graph too: a length past the cache makes its row NaN
            kv_len.copy_(torch.tensor([M + 1, 1, 2, 3], dtype=torch.int32))
            graph.replay()
            torch.cuda.synchronize()
            assert _bad_rows(out, None) == [True, False, False, False]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
def test_an_eager_decoding_step_makes_no_host_sync(layout, build_small):
    """A decoding loop writes kv_len in place every step: the eager call checks it on the device, with no
    sync (torch's sync debug mode turns any into an error), and its rows match the reference; a bad length
    gives its row NaN, still with no sync."""
    attn = build_small("causal")
    B, H, HKV, N, M, D = 4, 8, 2, 1, 512, 64
    q, k, v = testing.random_qkv(B, H, HKV, N, M, D, D, torch.bfloat16, device="cuda")
    kv_len = torch.tensor([M, 2, 100, 300], dtype=torch.int32, device="cuda")
    kc, vc, call = k, v, {}
    if layout == "paged16":
        kc, vc, table = strategies.paged(k, v, 16, seed=3)
        call["page_table"] = table
    with torch.no_grad():
        attn(q, kc, vc, kv_len=kv_len, **call)  # compiles outside the checked region
        past = kv_len.clone()
        past[0] = M + 5
        kv_len -= 1
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = attn(q, kc, vc, kv_len=kv_len, **call)
            bad = attn(q, kc, vc, kv_len=past, **call)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    want, _ = reference.evaluate(attn.spec, q.double(), k.double(), v.double(), {}, kv_len=kv_len)
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
    assert _bad_rows(bad, None) == [True, False, False, False]
    want, _ = reference.evaluate(attn.spec, q.double(), k.double(), v.double(), {}, kv_len=past.clamp(max=M))
    torch.testing.assert_close(bad[1:].double(), want[1:], atol=2e-2, rtol=2e-2)
