"""The decode family (split-KV forward, attngen/families/decode) against the float64 reference, and the
per-call choice between it and the portable family.

Calls whose (H / HKV) * Q_LEN fits one tile go to the decode kernels; in Triton's interpreter the
host counts 4 SMs and the kernels use 16-key tiles, so the lengths below split the keys into several
shares, some of them empty (narrow masks), and the merge of the shares is exercised."""

from pathlib import Path

import pytest
import torch

import attngen
from attngen import api, testing
from attngen.families.decode import family as decode_family
from attngen.plan import families
from attngen.families.decode import runtime as decode
from attngen.families.hopper import runtime as hopper
from attngen.runtime import arguments
from conftest import tiered

SPECS = Path(__file__).parent.parent / "specs"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# (B, H, HKV, Q_LEN, KV_LEN, D, DV): one query over a long cache with GQA 4:1, speculative decoding's
# few queries, a full 64-row tile, odd head dims, one key/value head per query head.
SHAPES = [
    (2, 8, 2, 1, 300, 32, 32),
    (1, 6, 2, 3, 170, 24, 40),
    (1, 4, 1, 16, 130, 16, 16),
    (3, 2, 2, 5, 61, 64, 16),
]


def _decoded(attn, shape, dtype):
    B, H, HKV, N, M, D, DV = shape
    q, k, v = testing.random_qkv(B, H, HKV, N, M, D, DV, dtype, device=DEVICE)
    inputs = testing.random_inputs(attn.spec, B, H, HKV, N, M, device=DEVICE)
    assert attn.module.forward_family(q, k, v, **inputs) == "decode"
    return q, k, v, inputs


def _serves_decode(attn):
    # The plan for this machine: decode and portable on the CPU, the Hopper family too on an H200.
    return attn.plan.families[0] == "decode" and attn.plan.families[-1] == "portable"


SERVED = ["full", "causal", "causal_bottom_right", "sliding_window", "alibi_causal", "prefix_lm", "gemma2_local",
          "chunked_causal", "learned_rel_bias", "document_causal"]


# fp32 on every shape; the 16-bit dtypes on the first two (their path differs only in the loads). The
# default run takes each spec on the second shape, in a dtype that turns with the spec, and on one of the
# last two, turning too; and the long cache (the first shape, whose backward is the costliest case in
# the interpreter) for the masks that leave some of its key shares empty and one that reads an input.
# The slow tier runs the rest.
LONG_CACHE = ["sliding_window", "gemma2_local", "chunked_causal", "document_causal"]
CASES = tiered(
    [(name, shape, dtype) for name in SERVED for n, shape in enumerate(SHAPES) for dtype in DTYPES
     if n < 2 or dtype == torch.float32],
    [(name, SHAPES[1], DTYPES[i % len(DTYPES)]) for i, name in enumerate(SERVED)]
    + [(name, SHAPES[2 + i % 2], torch.float32) for i, name in enumerate(SERVED)]
    + [(name, SHAPES[0], DTYPES[(i + 1) % len(DTYPES)]) for i, name in enumerate(LONG_CACHE)],
    ids=lambda c: f"{c[0]}-{'x'.join(map(str, c[1]))}-{c[2]}")


@pytest.mark.parametrize("name, shape, dtype", CASES)
def test_decode_matches_reference(name, shape, dtype, build_small):
    attn = build_small(name)
    assert _serves_decode(attn)
    q, k, v, inputs = _decoded(attn, shape, dtype)
    # The gradients come from the portable backward kernels, fed the decode forward's out and LSE.
    testing.check_against_reference(attn.spec, attn, q, k, v, inputs)


def test_decode_splits_keys_and_merges_empty_shares(build_small):
    attn = build_small("sliding_window", window=3)
    q, k, v, inputs = _decoded(attn, (1, 4, 1, 2, 400, 16, 16), torch.float32)
    # 25 key tiles of 16: 7 shares of 4 tiles in the interpreter's count of SMs, but the window
    # reaches 1 tile, so all shares but one are empty and weigh nothing in the merge.
    assert decode._decode_splits(25, 1, q.device) > 1
    testing.check_against_reference(attn.spec, attn, q, k, v, inputs, grads=False)


@pytest.mark.parametrize("name", ["full", "sliding_window", "gpt_oss_sinks", "sigmoid_alibi"])
def test_the_merge_takes_the_shares_in_steps(name, build_small, monkeypatch):
    """The merge loads COMBINE_SPLIT_BLOCK shares a step and rescales between steps; at two a step, 7 shares
    take four steps, the last one part empty: with every share full (full), most of them empty (a window of
    one tile), a sink as the merge's first part, and sigmoid's sums."""
    monkeypatch.setattr(decode, "COMBINE_SPLIT_BLOCK", 2)
    attn = build_small(name, window=3)
    q, k, v, inputs = _decoded(attn, (1, 4, 1, 2, 400, 16, 16), torch.float32)
    assert decode._decode_splits(25, 1, q.device) == 7
    testing.check_against_reference(attn.spec, attn, q, k, v, inputs, grads=False)


def test_decode_rows_with_no_key_give_zero_and_minus_infinity():
    attn = attngen.build("attention padded\ninput lengths: i32[B]\nmask: k < lengths[b]\n")
    q, k, v = testing.random_qkv(2, 4, 2, 1, 90, 16, 16, torch.float32, device=DEVICE)
    lengths = torch.tensor([0, 37], dtype=torch.int32, device=DEVICE)
    assert attn.module.forward_family(q, k, v, lengths=lengths) == "decode"
    out, lse = attn(q, k, v, lengths=lengths, return_lse=True)
    assert torch.all(out[0] == 0) and torch.all(lse[0] == float("-inf"))
    testing.check_against_reference(attn.spec, attn, q, k, v, {"lengths": lengths})


def test_the_host_picks_the_family_per_call(build_small):
    attn = build_small("causal")
    small = testing.random_qkv(1, 8, 2, 16, 40, 16, 16, torch.float32, device=DEVICE)  # 4 * 16 = 64 rows
    large = testing.random_qkv(1, 8, 2, 17, 40, 16, 16, torch.float32, device=DEVICE)  # 68 rows
    assert attn.module.forward_family(*small) == "decode"
    assert attn.module.forward_family(*large) == "portable"
    assert attn.module.DECODE_MAX_ROWS == decode_family.DECODE_MAX_ROWS == 64


def test_tile_table_masks_are_decided_in_the_decode_kernel(build_small):
    # Documents: the decode kernel reads no tile table, so a decoding call builds none; it decides the
    # mask key by key over the mask's closed-form hull (here, causal: every key up to the query).
    attn = build_small("document_causal")
    assert _serves_decode(attn)
    q, k, v, inputs = _decoded(attn, SHAPES[0], torch.float32)
    built = attn.module.TABLE_STATS["built"]
    testing.check_against_reference(attn.spec, attn, q, k, v, inputs, grads=False)
    assert attn.module.TABLE_STATS["built"] == built


# (B, Q_LEN, KV_LEN, the faster kernel on the H200) from `decode_bench.py --prefill` (bf16, D=128, GQA
# 32/8, causal): the split kernel wins where the portable forward's grid leaves SMs idle.
PREFILL = [(1, 256, 65536, "decode"), (1, 128, 16384, "decode"), (16, 64, 65536, "decode"),
           (1, 512, 16384, "portable"), (16, 128, 4096, "portable"), (4, 1024, 65536, "portable")]


@pytest.mark.parametrize("B, Q_LEN, KV_LEN, faster", PREFILL)
def test_chunked_prefill_goes_to_the_kernel_predicted_faster(B, Q_LEN, KV_LEN, faster, monkeypatch):
    # The H200's plan and SM count; the shapes alone decide (tensors on the meta device hold no data, so
    # the rule is asked directly, past the argument checks that want the call's device).
    attn = attngen.build(SPECS / "causal.attn", target="h200")
    for counting in (arguments, hopper, decode):  # each reads the SM count by its own imported name
        monkeypatch.setattr(counting, "_sm_count", lambda device: 132)
    q = torch.empty(B, 32, Q_LEN, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(B, 8, KV_LEN, 128, dtype=torch.bfloat16, device="meta")
    assert attn.module._forward_family(q, k, k, 8, KV_LEN, False)[0] == faster
    # A mask that follows tile tables keeps long calls on the portable forward, whose table the model does not see.
    documents = attngen.build(SPECS / "document_causal.attn", target="h200")
    assert documents.module._forward_family(q, k, k, 8, KV_LEN, False)[0] == "portable"


@pytest.mark.parametrize("spec, why", [
    ("attention per_head_window\nmask: k <= q and q - k <= 4 + h\n", "query head h"),
    ("attention per_head_layout\ninput layout: bool[H, *, *]\nmask: layout[h, q // 16, k // 16]\n", "query head h"),
])
def test_specs_the_decode_family_cannot_serve_stay_portable(spec, why):
    attn = attngen.build(spec)
    assert "decode" not in attn.plan.families and attn.plan.families[-1] == "portable"
    assert why in attn.plan.family_reason and "not decode" in attn.plan.family_reason
    B, H, HKV, N, M = 1, 4, 2, 1, 40
    q, k, v = testing.random_qkv(B, H, HKV, N, M, 16, 16, torch.float32, device=DEVICE)
    inputs = testing.random_inputs(attn.spec, B, H, HKV, N, M, device=DEVICE)
    assert attn.module.forward_family(q, k, v, **inputs) != "decode"
    assert all(name != "decode" for name, *_ in attn.module.forward_families)
    testing.check_against_reference(attn.spec, attn, q, k, v, inputs, grads=False)


def test_explain_states_the_families_and_their_rules():
    text = api.explain(SPECS / "causal.attn", q_len=1, kv_len=4096, head_dim=128, head_dim_v=128, dtype="bf16",
                       target="h200").text
    assert "kernel families: decode, hopper, portable" in text
    assert families.by_name("decode").per_call in text
    assert "decode: BLOCK_N=64, 4 warps, 3 stages" in text
