"""Planner and targets: tiles fit their budgets, lookups pad head dims, targets resolve."""

import itertools

import pytest
import torch

from attngen.plan import DTYPES, HEAD_DIMS, KERNELS, KernelPlan, Plan, Tiles, plan
from attngen.plan.targets import PRESETS, Target, detect_target, get_target

GPU_PRESETS = [name for name, t in PRESETS.items() if not t.interpreter]
HEADROOM = 8 * 1024


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    return {name: plan(target) for name, target in PRESETS.items()}


def footprint(kernel: str, t: Tiles, d: int, dv: int, dtype: str) -> int:
    """The shared-memory model of DESIGN.md, written out again so the planner is checked, not echoed."""
    elt = 4 if dtype == "f32" else 2
    bm, bn, s = t.block_m, t.block_n, t.num_stages
    if kernel == "fwd":  # Q resident; K and V pipelined
        return elt * (bm * d + s * (bn * d + bn * dv))
    if kernel == "bwd_dkdv":  # K and V resident; Q and dO pipelined
        return elt * (bn * d + bn * dv + s * (bm * d + bm * dv))
    return elt * (bm * (d + dv) + s * bn * (d + dv))  # bwd_dq: Q and dO resident; K and V pipelined


def tiles_of(entry: KernelPlan):
    return [(kernel, getattr(entry, kernel)) for kernel in KERNELS]


@pytest.mark.parametrize("name", list(PRESETS))
def test_plan_covers_every_head_dim_pair_and_dtype(plans, name):
    keys = [(e.head_dim_pad, e.head_dim_v_pad, e.dtype) for e in plans[name].entries]
    assert sorted(keys) == sorted(itertools.product(HEAD_DIMS, HEAD_DIMS, DTYPES))
    assert plans[name].target == name


@pytest.mark.parametrize("name", GPU_PRESETS)
def test_every_entry_fits_the_shared_memory_budget(plans, name):
    budget = PRESETS[name].smem_per_block - HEADROOM
    for entry in plans[name].entries:
        for kernel, t in tiles_of(entry):
            used = footprint(kernel, t, entry.head_dim_pad, entry.head_dim_v_pad, entry.dtype)
            assert used <= budget, (name, entry.head_dim_pad, entry.head_dim_v_pad, entry.dtype, kernel, t)


@pytest.mark.parametrize("name", list(PRESETS))
def test_blocks_are_powers_of_two_at_least_16(plans, name):
    for entry in plans[name].entries:
        for _, t in tiles_of(entry):
            for block in (t.block_m, t.block_n):
                assert block >= 16 and block & (block - 1) == 0, t
            assert t.num_warps in (1, 2, 4, 8) and t.num_stages >= 1, t


@pytest.mark.parametrize("head_dim, padded", [(1, 16), (8, 16), (16, 16), (17, 32), (80, 128), (256, 256)])
def test_lookup_rounds_head_dims_up(plans, head_dim, padded):
    entry = plans["interpreter"].lookup(head_dim, 64, "bf16")
    assert (entry.head_dim_pad, entry.head_dim_v_pad, entry.dtype) == (padded, 64, "bf16")
    assert plans["interpreter"].lookup(64, head_dim, "f16").head_dim_v_pad == padded


@pytest.mark.parametrize("dims, widths", [((17, 8), (64, 64)), ((40, 23), (64, 64)), ((65, 8), (128, 64)),
                                          ((65, 130), (128, 256)), ((64, 8), (64, 64)), ((64, 16), (64, 16)), ((128, 128), (128, 128)),
                                          ((16, 256), (16, 256))])
def test_gpu_widths_raise_masked_head_dims_to_the_floor(plans, dims, widths):
    """Padded (masked) head dims get tiles at least 64 wide on a GPU (plan.MASKED_WIDTH_FLOOR says
    why); powers of two keep their width, and the interpreter pads only to 16."""
    assert plans["h200"].widths(*dims) == widths
    assert plans["h200"].lookup(*dims, "bf16").head_dim_v_pad == widths[1]
    assert plans["interpreter"].widths(17, 8) == (32, 16)


def test_block_constant_masks_keep_key_tiles_a_block_long():
    """A block layout of 128x128 blocks: the forward keeps 128-key tiles and drops to 2 stages
    (0.606 ms on an H200, against 0.678 ms for 128x64 with 3 stages: benchmarks/tune_tiles.py); other masks
    with the same gathers shrink the key tile first, which full attention prefers."""
    blocks = plan(PRESETS["h200"], gather_bytes=1, mask_blocks={"q": 128, "k": 128}).lookup(128, 128, "bf16")
    assert blocks.fwd == Tiles(block_m=128, block_n=128, num_warps=8, num_stages=2)
    assert any("constant on blocks of 128" in r for r in blocks.reasons)
    plain = plan(PRESETS["h200"], gather_bytes=1).lookup(128, 128, "bf16")
    assert plain.fwd == Tiles(block_m=128, block_n=64, num_warps=8, num_stages=3)
    small = plan(PRESETS["h200"], gather_bytes=1, mask_blocks={"q": 16, "k": 16}).lookup(128, 128, "bf16")
    assert small.fwd == plain.fwd  # blocks shorter than the tile: nothing to keep


def test_generated_module_pads_head_dims_as_the_plan_does():
    import attngen

    attn = attngen.build("attention plain\n", target="h200")
    for d, dv in itertools.product([1, 8, 16, 17, 40, 64, 65, 100, 128, 129, 256], repeat=2):
        assert attn.module._widths(d, dv) == attn.plan.widths(d, dv), (d, dv)


def test_lookup_rejects_bad_arguments(plans):
    with pytest.raises(ValueError, match=r"head_dim must be at most 256, got 257"):
        plans["h100"].lookup(257, 64, "bf16")
    with pytest.raises(ValueError, match=r"head_dim_v must be at most 256, got 512"):
        plans["h100"].lookup(64, 512, "bf16")
    with pytest.raises(ValueError, match=r"head_dim must be a positive integer, got 0"):
        plans["h100"].lookup(0, 64, "bf16")
    with pytest.raises(ValueError, match=r"dtype must be one of f16, bf16, f32, got 'f64'"):
        plans["h100"].lookup(64, 64, "f64")


def test_interpreter_plan_uses_16x16_tiles(plans):
    expected = Tiles(block_m=16, block_n=16, num_warps=4, num_stages=1)
    for entry in plans["interpreter"].entries:
        assert [t for _, t in tiles_of(entry)] == [expected] * 3
        assert any("interpreter" in r for r in entry.reasons)


def test_a100_tiles_are_no_larger_than_h100(plans):
    h100 = {(e.head_dim_pad, e.head_dim_v_pad, e.dtype): e for e in plans["h100"].entries}
    for a in plans["a100"].entries:
        h = h100[(a.head_dim_pad, a.head_dim_v_pad, a.dtype)]
        for (kernel, ta), (_, th) in zip(tiles_of(a), tiles_of(h)):
            if kernel == "bwd_dkdv":
                continue  # sm90's dK/dV starts smaller on purpose (measured, see plan._STARTS)
            args = (a.head_dim_pad, a.head_dim_v_pad, a.dtype)
            assert footprint(kernel, ta, *args) <= footprint(kernel, th, *args), (kernel, args)
            assert ta.block_m * ta.block_n <= th.block_m * th.block_n, (kernel, args)


def test_h100_and_h200_plan_alike(plans):
    assert plans["h100"].entries == plans["h200"].entries


def test_sm90_bf16_d128_follows_the_known_good_tiles(plans):
    """Dense masks: FlexAttention-like tiles and one backward launch; narrow masks (windows, chunks,
    documents): small tiles and two launches (the measurements are in plan/planner.py)."""
    dense = plans["h100"]
    entry = dense.lookup(128, 128, "bf16")
    assert entry.fwd == Tiles(block_m=128, block_n=64, num_warps=8, num_stages=3)
    assert entry.bwd_dkdv == Tiles(block_m=64, block_n=128, num_warps=8, num_stages=3)
    assert entry.bwd_dq == Tiles(block_m=128, block_n=64, num_warps=8, num_stages=3)
    assert dense.one_launch_backward and not dense.narrow
    narrow = plan(PRESETS["h100"], narrow=True)
    entry = narrow.lookup(128, 128, "bf16")
    assert entry.fwd == Tiles(block_m=64, block_n=64, num_warps=4, num_stages=3)
    assert entry.bwd_dkdv == Tiles(block_m=32, block_n=64, num_warps=4, num_stages=3)
    assert entry.bwd_dq == Tiles(block_m=128, block_n=64, num_warps=8, num_stages=3)
    assert not narrow.one_launch_backward and narrow.narrow
    assert plan(PRESETS["interpreter"], narrow=True).one_launch_backward  # one tiling: nothing to gain


@pytest.mark.parametrize("name", list(PRESETS))
def test_reasons_explain_every_kernel(plans, name):
    for entry in plans[name].entries:
        assert entry.reasons and all(r.strip() for r in entry.reasons)
        if not PRESETS[name].interpreter:
            for kernel in KERNELS:
                assert any(r.startswith(f"{kernel}: BLOCK_M=") for r in entry.reasons), kernel
                assert any(r.startswith(f"{kernel}: ~") and "registers" in r for r in entry.reasons)


def test_plan_is_frozen_and_round_trips_through_json(plans):
    p = plans["a100"]
    assert Plan.model_validate_json(p.model_dump_json()) == p
    with pytest.raises(Exception):
        p.entries[0].fwd.block_m = 32


def test_summary_has_a_row_per_entry(plans):
    lines = plans["h100"].summary().splitlines()
    assert len(lines) == 2 + len(plans["h100"].entries)
    assert "h100" in lines[0] and "128x64 8w/3s" in plans["h100"].summary()


def test_get_target_by_name_is_case_insensitive():
    assert get_target("H200") is PRESETS["h200"]
    assert get_target("a100").capability == (8, 0)


def test_get_target_rejects_unknown_names():
    with pytest.raises(ValueError) as info:
        get_target("x")
    assert str(info.value) == "target must be one of a100, h100, h200, interpreter, got 'x'"


def test_target_is_frozen_and_strict():
    with pytest.raises(Exception):
        PRESETS["h100"].sm_count = 1
    with pytest.raises(Exception):
        Target(name="t", capability=None, sm_count=1, smem_per_block=1, registers_per_sm=1, bogus=1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_detect_target_without_gpu_is_the_interpreter():
    assert detect_target() == PRESETS["interpreter"]
    assert get_target(None) == PRESETS["interpreter"]


def test_detect_target_honours_triton_interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert detect_target().interpreter
