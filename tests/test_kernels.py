"""The generated kernels against the float64 reference: forward, LSE and every gradient.

On the CPU these run through Triton's interpreter in fp32 and fp16, and on a GPU also in bf16 (the
interpreter's own bf16 dot is wrong, so there the kernels upcast bf16 dots to fp32: that path is
checked on a few specs in test_autograd_and_tables.py, to keep the catalog's CPU time down).
"""

from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

import attngen
from attngen.runtime import helpers
from attngen import testing
from conftest import tiered

SPECS = sorted(Path(__file__).parent.parent.joinpath("specs").glob("*.attn"))
# (B, H, HKV, Q_LEN, KV_LEN, D, DV): lengths that are not tile multiples, odd head dims,
# GQA, Q_LEN != KV_LEN both ways, D != DV.
SHAPES = [
    (1, 2, 1, 37, 45, 20, 24),
    (2, 4, 2, 33, 19, 16, 16),
    (1, 2, 2, 50, 50, 32, 8),
]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


# Every spec on every shape; the dtype turns with the spec and the shape, so each spec and each shape
# meets each dtype in the default run. The slow tier runs the rest of the cross product.
CATALOG_CASES = tiered(
    [(path, shape, dtype) for path in SPECS for shape in SHAPES for dtype in DTYPES],
    [(path, shape, DTYPES[(i + j) % len(DTYPES)]) for i, path in enumerate(SPECS) for j, shape in enumerate(SHAPES)],
    ids=lambda c: f"{c[0].stem}-{'x'.join(map(str, c[1]))}-{c[2]}")


@pytest.mark.parametrize("path, shape, dtype", CATALOG_CASES)
def test_catalog_matches_reference(path, shape, dtype, build_small):
    B, H, HKV, N, M, D, DV = shape
    attn = build_small(path)
    if attn.spec.name == "document_causal":
        M = N  # document ids are indexed by q and k: the spec needs Q_LEN == KV_LEN
    q, k, v = testing.random_qkv(B, H, HKV, N, M, D, DV, dtype, device=DEVICE)
    inputs = testing.random_inputs(attn.spec, B, H, HKV, N, M, device=DEVICE)
    testing.check_against_reference(attn.spec, attn, q, k, v, inputs)


def test_fully_masked_rows_give_zero_output_and_gradient():
    attn = attngen.build("attention padded\ninput lengths: i32[B]\nmask: k < lengths[b] and q < 20\n")
    q, k, v = testing.random_qkv(2, 2, 2, 40, 30, 16, 16, torch.float32, device=DEVICE)
    lengths = torch.tensor([0, 17], dtype=torch.int32, device=DEVICE)  # batch 0: no key at all
    testing.check_against_reference(attn.spec, attn, q, k, v, {"lengths": lengths})
    q.requires_grad_()
    out, lse = attn(q, k, v, lengths=lengths, return_lse=True)
    (out.sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()).backward()
    assert torch.all(out[0] == 0) and torch.all(lse[0] == float("-inf"))
    assert torch.all(out[1, :, 20:] == 0) and torch.all(lse[1, :, 20:] == float("-inf"))
    assert torch.all(q.grad[0] == 0) and torch.isfinite(q.grad).all()


def test_score_functions_and_their_gradients():
    spec = """
    attention zoo
    param t = 0.5
    input bias: f32[H] learnable
    input gate: f16[] learnable
    score: where(q > k, softcap(score, 3.0), sigmoid(score) * 2.0) + exp2(-abs(score)) * t \
           + max(bias[h], -0.2) * gate + (q - k) % 5 / 4 + min(score, 1.0) + clamp(score, -1, 1) ** 2
    mask: k <= q + 5 and not (q - k > 30)
    """
    attn = attngen.build(spec.replace("\\\n", "\n   "))
    q, k, v = testing.random_qkv(1, 2, 1, 40, 44, 24, 24, torch.float32, device=DEVICE)
    inputs = testing.random_inputs(attn.spec, 1, 2, 1, 40, 44, device=DEVICE)
    testing.check_against_reference(attn.spec, attn, q, k, v, inputs)


def test_trigonometry_sign_and_round_and_their_gradients():
    # FlexAttention's own test mods, a learnable argument of each function, and a mask the analysis
    # classifies through sin's bound (always below 2: the mask is `k <= q + 5`).
    spec = """
    attention trig
    input bias: f32[H] learnable
    score: sin(cos(score)) + tan(bias[h] * 0.5) + cos(score) * sin(score) + atan(score * 2.0 + bias[h]) \
           + erf(score - bias[h]) + sign(score) * 0.5 + round(score * 3.0) * 0.25 + sign(q - k) * 0.1
    mask: (k <= q + 5 or sin(q * 1.0) > 2.0) and round(atan(k * 0.1)) >= 0
    """
    attn = attngen.build(spec.replace("\\\n", "\n   "))
    q, k, v = testing.random_qkv(1, 2, 1, 40, 44, 24, 24, torch.float32, device=DEVICE)
    inputs = testing.random_inputs(attn.spec, 1, 2, 1, 40, 44, device=DEVICE)
    testing.check_against_reference(attn.spec, attn, q, k, v, inputs)


def test_bit_operations_are_exact_on_ints_and_logical_on_bools():
    # int64 operands (an i64 input past 2**32), negative ones, a count past 31 on an int32 (computed as
    # 31 there), a count read from k, and `&`, `|`, `^`, `~` on bools.
    spec = """
    attention bits
    input off: i64[B]
    input bias: f32[H] learnable
    mask: (((q ^ k) & 7) != 5 and (q >> 1) >= (k >> 2) - 3 and (~k | 1) < 0 and ((q < 30) ^ (k > 20) | ~(q == k))
           and (off[b] >> 33) >= 0 and (q - 20) >> 40 <= 0)
    score: score + ((q << 3) ^ (k | 5)) * 0.01 + bias[h] * ((q & k) >> 1) * 0.1 + (off[b] >> 30) * 0.001 \
           + (q >> clamp(k, 0, 63)) * 0.1 + ((k - q) >> 2) * 0.1 + ((k - 9) | -16) * 0.1 + (off[b] & 4294967295) * 1e-10
    """
    attn = attngen.build(spec.replace("\\\n", "\n   "))
    assert ">> 31" in attn.path.read_text()  # (q - 20) >> 40 in int32
    q, k, v = testing.random_qkv(2, 2, 1, 40, 44, 16, 16, torch.float32, device=DEVICE)
    inputs = {"off": torch.tensor([2 ** 35 + 12345, -(2 ** 40) - 7], device=DEVICE),
              "bias": torch.randn(2, device=DEVICE)}
    testing.check_against_reference(attn.spec, attn, q, k, v, inputs)


@triton.jit
def _helpers_kernel(x_ptr, atan_ptr, tan_ptr, round_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(atan_ptr + offs, helpers._atan(x), mask=offs < n)
    tl.store(tan_ptr + offs, helpers._tan(x), mask=offs < n)
    tl.store(round_ptr + offs, helpers._round(x), mask=offs < n)


def test_atan_tan_and_round_helpers_match_torch():
    # Reductions' edges (tan(pi/8), tan(3pi/8)), halves (ties to even), just below -0.5 and 0, huge values.
    special = [0.0, -0.0, 0.41421356, 0.41421357, 2.4142135, 2.4142137, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5,
               -0.50000006, -0.49999997, -1e-8, 0.49999997, 8388607.5, 1e30, -1e30, float("inf"), float("-inf")]
    x = torch.cat([torch.tensor(special), torch.linspace(-40, 40, 4001), torch.randn(2000) * 1e3]).to(DEVICE)
    out = [torch.empty_like(x) for _ in range(3)]
    _helpers_kernel[(triton.cdiv(x.numel(), 1024),)](x, *out, x.numel(), BLOCK=1024)
    atan, tan, rounded = out
    torch.testing.assert_close(atan, torch.atan(x.double()).float(), rtol=4e-7, atol=0.0)
    assert torch.equal(rounded, torch.round(x))
    finite = x.abs() < 40  # tan of a float32 argument is ill-conditioned wherever it is large
    torch.testing.assert_close(tan[finite], torch.tan(x[finite].double()).float(), rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # 19 s on 2 cores; the catalog's learnable tables stay in the default tier
def test_learnable_gradients_scattered_from_tiles_that_are_mostly_at_one_address():
    # A clamp of +-4 on 16- and 32-wide tiles: most tiles lie wholly at a clamp (one load and one atomic for
    # the tile), tiles on the band's edge mix both clamps and the band, `bucket` saturates (abs, //, min) far
    # from the diagonal, and `grid` varies along both axes at once (no tile is at one entry).
    spec = """
    attention narrow_rel_bias
    input table: f32[H, 9] learnable
    input bucket: f32[H, 6] learnable
    input grid: f32[3, 5] learnable
    score: score + table[h, clamp(q - k, -4, 4) + 4] + bucket[h, min(abs(q - k) // 8, 5)] + grid[q % 3, k % 5]
    mask: k <= q + 40
    """
    attn = attngen.build(spec)
    source = attn.path.read_text()
    assert "glo0" in source and "glo2" in source  # the per-tile reduction runs where tiles are not points
    # Point loads of the table and the bucket, not of the grid: in the portable forward, dQ and dK/dV
    # kernels, and in the Hopper family's forward and backward.
    portable = attngen.compile_source(attn.spec, target="a100")
    assert portable.count("_entry = tl.load(table_ptr") == 3 and portable.count("_entry = tl.load(bucket_ptr") == 3
    hopper = attngen.compile_source(attn.spec, target="h200")
    assert hopper.count("_entry = tl.load(table_ptr") == 5 and hopper.count("_entry = tl.load(bucket_ptr") == 5
    assert "_entry = tl.load(grid_ptr" not in portable and "_entry = tl.load(grid_ptr" not in hopper
    q, k, v = testing.random_qkv(1, 2, 1, 100, 90, 16, 16, torch.float32, device=DEVICE)
    inputs = testing.random_inputs(attn.spec, 1, 2, 1, 100, 90, device=DEVICE)
    testing.check_against_reference(attn.spec, attn, q, k, v, inputs)
    if DEVICE == "cuda":
        # A GPU's portable tiles (fp32) are 64 and 128 wide: they reach single entries at longer lengths.
        # Without `grid`, whose gradient sums ~30000 terms an entry here in an order the float32
        # reference's error does not bound (1e-4 on 28, 4e-6 relative, on an H200).
        spec = spec.replace(" + grid[q % 3, k % 5]", "").replace("input grid: f32[3, 5] learnable", "")
        attn = attngen.build(spec)
        q, k, v = testing.random_qkv(1, 2, 1, 700, 650, 16, 16, torch.float32, device=DEVICE)
        inputs = testing.random_inputs(attn.spec, 1, 2, 1, 700, 650, device=DEVICE)
        testing.check_against_reference(attn.spec, attn, q, k, v, inputs)


def test_arguments_are_checked_by_name():
    attn = attngen.build(Path(__file__).parent.parent / "specs" / "alibi_causal.attn")
    q, k, v = testing.random_qkv(1, 4, 2, 16, 16, 16, 16, torch.float32, device=DEVICE)
    slopes = torch.ones(4, device=DEVICE)
    cases = [
        (dict(), "missing input(s): slopes: f32[H]"),
        (dict(slopes=slopes, extra=slopes), "unknown input(s) 'extra'"),
        (dict(slopes=torch.ones(3, device=DEVICE)), "input 'slopes' must have shape (4)"),
        (dict(slopes=slopes.half()), "input 'slopes' must have dtype torch.float32"),
        (dict(slopes=[1.0] * 4), "input 'slopes' must be a torch.Tensor"),
        (dict(slopes=slopes.to_sparse()), "input 'slopes' must be a dense tensor f32[H], got a torch.sparse_coo one"),
    ]
    for inputs, message in cases:
        with pytest.raises(ValueError, match=None) as err:
            attn(q, k, v, **inputs)
        assert message in str(err.value), str(err.value)
    with pytest.raises(ValueError, match="query heads"):
        attn(q[:, :3], k, v, slopes=slopes[:3])
    with pytest.raises(ValueError, match="must share a dtype"):
        attn(q.half(), k, v, slopes=slopes)
    with pytest.raises(ValueError, match="k must have head_dim 16"):
        attn(q, k[..., :8], v, slopes=slopes)
    with pytest.raises(ValueError, match="4 dims"):
        attn(q[0], k, v, slopes=slopes)
    with pytest.raises(ValueError, match="q must be a dense tensor, got a torch.sparse_coo one"):
        attn(q.to_sparse(), k, v, slopes=slopes)


@pytest.mark.gpu
def test_realistic_size_bf16_on_gpu():
    attn = attngen.build(Path(__file__).parent.parent / "specs" / "gemma2_local.attn", params={"window": 1024})
    q, k, v = testing.random_qkv(2, 16, 8, 2048, 2048, 128, 128, torch.bfloat16, device="cuda")
    testing.check_against_reference(attn.spec, attn, q, k, v)


@pytest.mark.gpu
@pytest.mark.parametrize("dims", [(17, 8), (17, 12), (40, 23), (65, 8), (65, 23), (71, 4)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_odd_head_dims_with_a_narrow_value_tile_on_gpu(dims, dtype):
    """Found by GPU fuzzing (tools/fuzz_device.py): with both head dims padded and the value tile
    narrower, 128-row forward tiles gave wrong outputs or an illegal address on an H200; the tile
    widths are now raised for masked head dims (plan.MASKED_WIDTH_FLOOR)."""
    attn = attngen.build("attention plain\n")
    q, k, v = testing.random_qkv(2, 2, 1, 300, 300, *dims, dtype, device="cuda", seed=1)
    testing.check_against_reference(attn.spec, attn, q, k, v)


@pytest.mark.parametrize("case", ["B=1,H=1,HKV=1,Q_LEN=1,KV_LEN=1,D=1,DV=1,dtype=f32,seed=0",
                                  "B=1,H=2,HKV=1,Q_LEN=37,KV_LEN=21,D=24,DV=8,dtype=f32,seed=3"])
def test_softcap_with_a_large_cap_is_accurate_in_fp32(case):
    """Found by `attngen check specs/gemma2_local.attn`: tanh from exp(-2|x|) lost digits for the small
    x = score / cap of a cap of 50 (LSE off by 7 ulp with one key); the kernel now uses a series there."""
    from attngen.testing import strategies

    attn = attngen.build(Path(__file__).parent.parent / "specs" / "gemma2_local.attn", params={"window": 9})
    strategies.check_case(attn.spec, attn, strategies.Case.parse(case), device="cpu" if DEVICE == "cpu" else "cuda")
