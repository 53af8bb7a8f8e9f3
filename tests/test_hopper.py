"""The Hopper family (attngen/families/hopper): which specs and targets get it, what its module holds, and,
on a Hopper GPU, its forward against the float64 reference with the portable backward behind it.

Its kernels are Gluon (TMA, mbarriers, asynchronous wgmma, warp specialization): they compile for
sm_90 on a CPU (test_every_catalog_spec_compiles_for_sm90_with_wgmma) but run only on the GPU."""

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attngen
from attngen import api, testing
from attngen.analysis import analyze
from attngen.plan import families
from attngen.plan.targets import get_target
from attngen.families.hopper import runtime as hopper
from attngen.runtime import launching

SPECS = Path(__file__).parent.parent / "specs"
# The shared memory one block may hold on the Hopper targets (227 KiB): a kernel needing more fails to launch.
SM90_SHARED_BYTES = get_target("h200").smem_per_block
ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


CATALOG = sorted(path.stem for path in SPECS.glob("*.attn"))


@pytest.mark.parametrize("target", ["h100", "h200"])
def test_hopper_targets_get_the_family_for_every_catalog_spec(target):
    for spec in CATALOG:
        chosen, why = families.choose_families(analyze(attngen.load_spec(SPECS / f"{spec}.attn")[0]), get_target(target))
        assert tuple(f.name for f in chosen[-2:]) == ("hopper", "portable"), (spec, why)
        assert f"hopper (fwd/bwd_dkdv/bwd_dq for {families.by_name('hopper').per_call})" in why


def test_other_targets_do_not_get_the_family():
    for target in ("a100", "interpreter"):
        chosen, why = families.choose_families(analyze(attngen.load_spec(SPECS / "causal.attn")[0]), get_target(target))
        assert families.by_name("hopper") not in chosen
        assert f"not hopper: its kernels need a Hopper GPU (sm_90: TMA, wgmma, setmaxnreg); the target is {target}" in why


def test_the_module_for_hopper_holds_the_gluon_kernels():
    hopper = attngen.compile_source(SPECS / "causal.attn", target="h200")
    assert "from triton.experimental import gluon" in hopper and "def _hopper_fwd_kernel(" in hopper
    assert "forward_families=('decode', 'hopper')," in hopper
    assert "def _hopper_bwd_kernel(" in hopper
    assert "backward_families=(('hopper', 'hopper_bwd'),)," in hopper
    assert "fp8_families=('hopper',)," in hopper  # FP8 calls: the Hopper forward, never the decode family's
    assert "'hopper': dict(forward_kernel=_hopper_fwd_kernel, backward_kernel=_hopper_bwd_kernel" in hopper
    ampere = attngen.compile_source(SPECS / "causal.attn", target="a100")
    assert "gluon" not in ampere and "_hopper_" not in ampere


def _hopper_step(source: str) -> str:
    """The Gluon softmax step of a module's source, where the spec's score and mask run."""
    start = source.index("def _hopper_softmax_step(")
    return source[start:source.index("\n\n\n", start)]


def test_the_spec_runs_in_the_gluon_step():
    step = _hopper_step(attngen.compile_source(SPECS / "gemma2_local.attn", target="h200"))
    # The score's tanh is the one-instruction approximation; the mask's comparisons are the forward's.
    assert "# score: softcap(score, cap)" in step and "_tanh_approx(" in step and "_tanh(" not in step
    assert "# mask: (q >= k) and (q - k < window)" in step or "# mask: " in step
    assert "allowed = " in step
    # A tanh in a mask stays exact: a mask's decisions must not move.
    masked = _hopper_step(attngen.compile_source("attention tanh_mask\nmask: tanh(q - k) > 0.5\n"
                                                 "score: tanh(score)\n", target="h200"))
    mask_code = masked[masked.index("# mask:"):]
    assert "_tanh(" in mask_code and "_tanh_approx(" not in mask_code
    assert "_tanh_approx(" in masked[:masked.index("# mask:")]
    # Inputs are read in the step as in the portable forward, by pointer, strides and sizes.
    alibi = _hopper_step(attngen.compile_source(SPECS / "alibi_causal.attn", target="h200"))
    assert "tl.load(slopes_ptr + " in alibi


def _hopper_backward_steps(source: str) -> str:
    start = source.index("def _hopper_bwd_steps(")
    return source[start:source.index("\n\n\n", start)]


def test_the_spec_runs_in_the_gluon_backward():
    # The score, its derivative and the mask on transposed (key, query) tiles, as in the portable dK/dV
    # kernel, with the forward's tanh (the scores must be those the forward's LSE normalised).
    steps = _hopper_backward_steps(attngen.compile_source(SPECS / "gemma2_local.attn", target="h200"))
    assert "# score: softcap(score, cap)" in steps and "_tanh_approx(" in steps
    assert "# d score'/d score = " in steps and "dsT = dsT * " in steps
    assert "offs_m[None, :]" in steps and "offs_n[:, None]" in steps and "allowed = " in steps
    # A derivative may be inf where the mask is off: dS is masked again after it.
    assert "dsT = gl.where(allowed, dsT, 0.0)" in steps
    # Without one, P = 0 has zeroed dS already: no second mask, no `allowed` kept alive across the wgmmas.
    plain = _hopper_backward_steps(attngen.compile_source(SPECS / "causal.attn", target="h200"))
    assert "dsT = gl.where(allowed, dsT, 0.0)" not in plain
    # A learnable input's gradient is scattered from dS^T, reduced along the axis its index does not vary
    # on: a bias per key (varies along rows, the keys) is summed over the columns (axis 1).
    learned = _hopper_backward_steps(attngen.compile_source(
        "attention key_bias\ninput bias: f32[KV_LEN] learnable\nscore: score + bias[k]\n", target="h200"))
    assert "_grad_add(bias_grad, " in learned and "tl.sum(g0, 1)[:, None]" in learned
    per_query = _hopper_backward_steps(attngen.compile_source(
        "attention query_bias\ninput bias: f32[Q_LEN] learnable\nscore: score + bias[q]\n", target="h200"))
    assert "tl.sum(g0, 0)[None, :]" in per_query


def test_tile_table_specs_follow_tables_of_the_family_s_tiles():
    module = attngen.build(SPECS / "document_causal.attn", target="h200").module
    assert module.FACTS.table_families == ("hopper",)
    assert attngen.build(SPECS / "causal.attn", target="h200").module.FACTS.table_families == ("hopper",)
    assert attngen.build(SPECS / "causal.attn", target="a100").module.FACTS.table_families == ()
    q = torch.zeros(1, 2, 300, 128, dtype=torch.bfloat16)
    assert module._table_key(q, q, "hopper") == (True, 128, 128)
    # The backward walks query tiles of 64 rows for each key tile of 128, as dK/dV does.
    assert module._table_key(q, q, "hopper_bwd") == (False, 64, 128)
    assert "hopper_bwd" in module._table_kernels(True) and "hopper_bwd" not in module._table_kernels(False)


def test_explain_names_the_family_and_its_tiles():
    text = api.explain(SPECS / "causal.attn", q_len=4096, kv_len=4096, head_dim=128, head_dim_v=128, dtype="bf16",
                       target="h200").text
    assert "kernel families: decode, hopper, portable" in text
    assert "hopper: 128x128 tiles, a persistent CTA an SM" in text and "2 Q tiles (192 KiB" in text
    assert "hopper backward: 64 queries x 128 keys" in text
    # Above head dim 128 the backward's tiles are 64 x 64, with two Q/dO stages only where they fit.
    wide = api.explain(SPECS / "causal.attn", q_len=4096, kv_len=4096, head_dim=256, head_dim_v=256,
                       dtype="bf16", target="h200").text
    assert "hopper backward: 64 queries x 64 keys" in wide and "1 Q/dO stage," in wide
    # The forward's second Q tile (a persistent CTA's next work item) fits up to head dim 128.
    assert "2 K/V stages, 1 Q tile (192 KiB" in wide
    narrower_v = api.explain(SPECS / "causal.attn", q_len=4096, kv_len=4096, head_dim=256, head_dim_v=128,
                             dtype="bf16", target="h200").text
    assert "hopper backward: 64 queries x 64 keys" in narrower_v and "2 Q/dO stages" in narrower_v


# A spec whose steps run no code of its own (plan.family.plain_steps) but a scale.
PLAIN_SCALED = "attention plain\nparam t = 0.5\nscale: t\n"


def _h200_tiles(source, head_dim, family):
    """(BLOCK_M, BLOCK_N) of `family`'s kernel ("hopper" or "hopper_bwd") for a bf16 call at D = DV = head_dim."""
    module = attngen.build(source, target="h200").module
    q = torch.zeros(1, 2, 300, head_dim, dtype=torch.bfloat16)
    return module._family_tiles(q, q, family)[:2]


def test_backward_tiles_widen_to_128_queries_only_for_plain_steps_at_head_dim_64():
    # At D <= 64 a spec whose backward step runs no mask, score or sink code walks 128 query rows a step
    # (FA3's D=64 tile); mask or score code would spill those registers, so such specs keep 64 rows, as
    # every spec does at wider head dims.
    def bwd_tiles(source, head_dim):
        return _h200_tiles(source, head_dim, "hopper_bwd")

    plain = PLAIN_SCALED
    assert bwd_tiles(SPECS / "full.attn", 64) == (128, 128) and bwd_tiles(plain, 64) == (128, 128)
    assert bwd_tiles(SPECS / "full.attn", 128) == (64, 128)
    for name in ("causal", "alibi_causal", "gpt_oss_sinks", "sigmoid_alibi"):
        assert bwd_tiles(SPECS / f"{name}.attn", 64) == (64, 128), name
    text = api.explain(SPECS / "full.attn", q_len=4096, kv_len=4096, head_dim=64, head_dim_v=64, dtype="bf16",
                       target="h200").text
    assert "hopper backward: 128 queries x 128 keys" in text


def test_a_dropout_call_s_backward_walks_64_query_rows_in_every_box(monkeypatch):
    # full at D = 64 plans 128-query backward steps; a dropout call runs 64-row steps (the keep-mask spills the
    # wider step's registers): the kernel's BLOCK_M, the Q, dO and dQ boxes, the row terms' boxes and their
    # padding must all say 64, and 128 without dropout. Launches are recorded, not run (no GPU here).
    launches = []
    for module in (hopper, launching):  # the backward's launches and the row terms'
        monkeypatch.setattr(module, "_launch", lambda kernel, grid, *args, **options: launches.append((args, options)))
    rt = attngen.build(SPECS / "full.attn", target="h200").module.ATTENTION
    q, k, v, out, do = (torch.zeros(1, 2, 300, 64, dtype=torch.bfloat16) for _ in range(5))
    words = torch.zeros(2, dtype=torch.int64)
    for dropout, rows in ((None, 128), ((words, 0.1), 64)):
        launches.clear()
        rt.families["hopper"].backward(q, k, v, out, torch.zeros(1, 2, 300), do, None, [], (), dropout=dropout)
        row_terms, backward = launches[0], launches[1]
        assert backward[1]["BLOCK_M"] == rows and backward[1]["BLOCK_N"] == 128
        boxes = [tuple(a.block_shape) for a in backward[0] if hasattr(a, "block_shape")]
        assert boxes == [(1, 1, rows, 64), (1, 1, 128, 64), (1, 1, 128, 64), (1, 1, rows, 64), (1, rows), (1, rows),
                         (1, 1, rows, 64)]
        # delta and the base-2 LSE, padded to whole query tiles of the backward's rows
        padded = [tuple(a.shape) for a in row_terms[0] if isinstance(a, torch.Tensor) and a.dim() == 3
                  and a.dtype == torch.float32 and a.shape[-1] != 300]
        assert len(padded) >= 2 and set(padded) == {(1, 2, -(-300 // rows) * rows)}


@pytest.mark.parametrize("source, D, dropout, folds", [
    ("causal", 64, False, (True, True)),  # 64-row steps, the plain score: both row terms in the accumulators
    ("causal", 64, True, (False, False)),  # a dropout call scales dP before delta comes off
    ("alibi_causal", 128, False, (False, False)),  # a score of its own: slower folded (H100)
    ("full", 64, False, (False, False)),  # 128-row steps
    ("sigmoid_alibi", 128, False, (False, False)),  # no row terms
    ("attention zero\nscale: 0\nmask: causal\n", 128, False, (True, False)),  # -LSE / 0 is no number
    ("attention negative\nscale: -0.1\nmask: causal\n", 128, False, (True, True)),
])
def test_a_backward_launch_folds_the_row_terms_by_the_rule(monkeypatch, source, D, dropout, folds):
    # FOLD_ROWS starts each step's dP^T accumulator at -delta, FOLD_LSE its S^T accumulator at -LSE / qk_scale
    # (families/hopper/runtime.py's _hopper_folds); the GPU tests check each kind against the reference.
    launches = []
    for module in (hopper, launching):
        monkeypatch.setattr(module, "_launch", lambda kernel, grid, *args, **options: launches.append((args, options)))
    spec = SPECS / f"{source}.attn" if "\n" not in source else source
    rt = attngen.build(spec, target="h200").module.ATTENTION
    q, k, v, out, do = (torch.zeros(1, 2, 300, D, dtype=torch.bfloat16) for _ in range(5))
    words = torch.zeros(2, dtype=torch.int64)
    rt.families["hopper"].backward(q, k, v, out, torch.zeros(1, 2, 300), do, None, [], (),
                                   dropout=(words, 0.1) if dropout else None)
    backward = next(options for _, options in launches if "FOLD_ROWS" in options)
    assert (backward["FOLD_ROWS"], backward["FOLD_LSE"]) == folds


@pytest.mark.parametrize("source, one_loop", [
    ("natten_morton", True),  # 87 lines of mask code
    ("learned_rel_bias", False),  # 25 lines, but its score gathers table[h, clamp(q - k, ...)]
    ("causal", False),
    # random specs 44 (15 lines) and 36 (13) of benchmarks/random_variants.py, timed on an H100
    ("attention rv44\nparam w = 510\nparam t = 0.5\nmask: not not q - k < w\n"
     "score: sigmoid(rsqrt(1.0 + abs((k - q) * 0.1))) * (score * t)\n", True),
    ("attention rv36\nparam t = 0.5\nmask: k < KV_LEN - 2 or q >> 2 >= k >> 2\n"
     "score: log2(2.0 + abs(score * t))\n", False),
])
def test_long_forward_steps_run_in_one_loop(source, one_loop):
    # The emitter's rule (families/hopper/emit.py, HOPPER_ONE_LOOP_LINES), stated in the module as HOPPER_ONE_LOOP.
    spec = SPECS / f"{source}.attn" if "\n" not in source else source
    module = attngen.build(spec, target="h200").module
    assert bool(module.HOPPER_ONE_LOOP) is one_loop


def test_forward_tiles_hold_three_consumers_for_plain_specs_at_head_dim_64(monkeypatch):
    # At D <= 64 a spec whose steps run no mask, score or sink code runs 192-row forward tiles, three consumer
    # warpgroups of 64 rows (FA3's D=64 forward); mask or score code loses at 192 rows (160 registers a
    # consumer), so such specs keep 128, as every spec does at wider head dims.
    def fwd_tiles(source, head_dim):
        return _h200_tiles(source, head_dim, "hopper")

    plain = PLAIN_SCALED
    assert fwd_tiles(SPECS / "full.attn", 64) == (192, 128) and fwd_tiles(plain, 64) == (192, 128)
    assert fwd_tiles(SPECS / "full.attn", 128) == (128, 128)
    for name in ("causal", "alibi_causal", "sliding_window", "document_causal", "gpt_oss_sinks", "sigmoid_alibi"):
        assert fwd_tiles(SPECS / f"{name}.attn", 64) == (128, 128), name
    text = api.explain(SPECS / "full.attn", q_len=4096, kv_len=4096, head_dim=64, head_dim_v=64, dtype="bf16",
                       target="h200").text
    assert "hopper: 192x128 tiles" in text and "three 4-warp consumer warpgroups" in text
    # Each launch's consumers, their query boxes, and dropout and FP8 calls narrowed to 128 rows (two
    # consumers: the keep-mask spills 160 registers). Launches are recorded, not run (no GPU here).
    launches = []
    monkeypatch.setattr(hopper, "_launch", lambda kernel, grid, *args, **options: launches.append((args, options)))
    rt = attngen.build(SPECS / "full.attn", target="h200").module.ATTENTION
    q = torch.zeros(1, 2, 300, 64, dtype=torch.bfloat16)
    q8 = q.to(torch.float8_e4m3fn)
    scales = [torch.ones(1, 2)] * 3
    words = torch.zeros(2, dtype=torch.int64)
    for call, rows, consumers in ((dict(), 192, 3), (dict(dropout=(words, 0.1)), 128, 2),
                                  (dict(fp8=scales), 128, 2)):
        launches.clear()
        qkv = (q8, q8, q8) if "fp8" in call else (q, q, q)
        rt.families["hopper"].forward(*qkv, [], (), **call)
        (args, options), = [launch for launch in launches if "CONSUMERS" in launch[1]]  # (FP8: V^T's too)
        assert options["BLOCK_M"] == rows and options["CONSUMERS"] == consumers, call
        assert tuple(args[0].block_shape) == (1, 1, 64, 64)  # q_desc: one consumer's rows


def _compile_sm90(specs, head_dim):
    """tools/compile_sm90.py's facts of the Hopper family's kernels of `specs` at D = DV = head_dim."""
    if not specs:
        return {}
    # Triton compiles for sm_90 without a GPU; its interpreter must be off, so tools/compile_sm90.py runs
    # each module in a child process.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # The child imports the attngen this test imported (a checkout beside an editable install of
    # another one would otherwise compile that one's kernels).
    env["PYTHONPATH"] = os.pathsep.join([str(Path(attngen.__file__).parent.parent), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, str(SPECS.parent / "tools" / "compile_sm90.py"), "--family", "hopper",
                          "--head-dim", str(head_dim), "--only", *specs, "--json"],
                         capture_output=True, text=True, env=env, timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert sorted(results) == sorted(specs)
    return results


# Compiling is slow (seven kernels a spec, a few seconds each): the default run compiles every kernel of the
# two specs whose kernels differ most from plain attention's (a learnable table and its gradient; sigmoid
# attention, whose weights take rcp.approx); the slow tier compiles every kernel of the rest of the catalog
# (among them a tile table, a softcap and a sink) and head dim 256, the backward's split layout (SPLIT_D),
# for a plain mask, a learnable table, a softcap and sigmoid.
SM90_DEFAULT = ["learned_rel_bias", "sigmoid_alibi"]


@pytest.mark.parametrize("specs, wide", [
    pytest.param(SM90_DEFAULT, [], id="default"),
    pytest.param([name for name in CATALOG if name not in SM90_DEFAULT],
                 ["causal", "gemma2_local", "sigmoid_alibi", "learned_rel_bias"], id="rest", marks=pytest.mark.slow)])
def test_every_catalog_spec_compiles_for_sm90_with_wgmma(specs, wide):
    # The PTX must hold what the family exists for.
    for spec, kernels in _compile_sm90(specs, 128).items():
        facts = kernels["_hopper_fwd_kernel"]
        for instruction in ("wgmma", "tma", "setmaxnreg"):
            assert facts[instruction], f"{spec}: no {instruction} in the Hopper forward's PTX"
        softcapped = "softcap(" in (SPECS / f"{spec}.attn").read_text()
        assert facts["tanh_approx"] == softcapped, f"{spec}: tanh.approx {facts['tanh_approx']}"
        backward = kernels["_hopper_bwd_kernel"]
        for instruction in ("wgmma", "tma", "setmaxnreg"):
            assert backward[instruction], f"{spec}: no {instruction} in the Hopper backward's PTX"
        for kernel in ("_hopper_fwd_kernel", "_hopper_bwd_kernel"):  # else the launch fails: out of resources
            shared = kernels[kernel]["shared"]
            assert shared <= SM90_SHARED_BYTES, f"{spec}: {kernel} needs {shared} B of shared memory"
        assert backward["tanh_approx"] == softcapped, f"{spec}: backward tanh.approx {backward['tanh_approx']}"
        # With dropout too: its keep-mask lands on the accumulators' layout without moving data (the kernels
        # convert it with assert_trivial, so a conversion that moved data would not compile).
        sigmoid = "normalize: sigmoid" in (SPECS / f"{spec}.attn").read_text()
        dropped = ["_hopper_fwd_kernel_dropout", "_hopper_bwd_kernel_dropout"]
        assert {"_hopper_fwd_kernel_packed", "_hopper_bwd_kernel_packed"} <= set(kernels), spec
        for kernel in dropped:
            assert kernels[kernel]["wgmma"] and kernels[kernel]["shared"] <= SM90_SHARED_BYTES, (spec, kernel)
        # Sigmoid attention's weights take rcp.approx (_hopper_sigmoid2), forward and backward; softmax's none.
        for kernel in ("_hopper_fwd_kernel", "_hopper_bwd_kernel", *dropped):
            assert kernels[kernel]["rcp_approx"] == sigmoid, f"{spec}: {kernel}'s rcp.approx"
    for spec, kernels in _compile_sm90(wide, 256).items():
        for kernel in ("_hopper_bwd_kernel", "_hopper_bwd_kernel_dropout"):
            for instruction in ("wgmma", "tma", "setmaxnreg"):
                assert kernels[kernel][instruction], f"{spec}: no {instruction} in the D=256 {kernel}"
            assert kernels[kernel]["shared"] <= SM90_SHARED_BYTES, spec


@pytest.mark.slow
def test_the_three_consumer_forward_compiles_without_spills_at_head_dim_64():
    # full at D = 64 plans 192-row forward tiles: three consumer warpgroups of 160 registers. The rule rests on
    # their step fitting those registers (a spilling step ran 2x slower on an H100: sliding_window, BENCHMARKS.md),
    # so the plain forward's SASS must hold no spill store (tools/compile_sm90.py counts them with nvdisasm).
    kernels = _compile_sm90(["full"], 64)["full"]
    forward = kernels["_hopper_fwd_kernel"]
    assert forward["wgmma"] and forward["setmaxnreg"] and forward["shared"] <= SM90_SHARED_BYTES
    assert forward["spill_stores"] == 0, forward


class _Tensor:
    """What the per-call rule reads of a tensor, without memory behind it (the rule's CPU test): dense
    strides unless given."""

    def __init__(self, *shape, dtype=torch.bfloat16, strides=None, address=1 << 20, device="cuda:7"):
        self.shape, self.dtype, self.is_cuda, self._address, self.device = shape, dtype, True, address, device
        self._strides = strides or tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))

    def stride(self, dim=None):
        return self._strides if dim is None else self._strides[dim]

    def dim(self):
        return len(self.shape)

    def element_size(self):
        return torch.empty(0, dtype=self.dtype).element_size()

    def data_ptr(self):
        return self._address


def _transposed(B, heads, length, D, **kwargs):
    """A (B, heads, length, D) stand-in for the transpose(1, 2) of a dense (B, length, heads, D) tensor."""
    return _Tensor(B, heads, length, D, strides=(length * heads * D, D, heads * D, 1), **kwargs)


def test_the_per_call_rule():
    module = attngen.build(SPECS / "causal.attn", target="h200").module
    serves = module.families["hopper"].serves
    # Stand-in devices: "cuda:7" is a Hopper GPU, "cuda:8" an A100 (a module built for --target h200 may
    # run on any GPU; the family's kernels compile for sm_90 only).
    hopper._HOPPER_DEVICES.update({"cuda:7": True, "cuda:8": False})
    assert not serves(*[_Tensor(2, 8, 1000, 128, device="cuda:8")] * 3, 8, 1000, False)
    q, k = _Tensor(2, 8, 1000, 128), _Tensor(2, 2, 1000, 128)
    assert serves(q, k, k, 2, 1000, False)
    assert not serves(q, k, k, 2, 1000, True)  # a cache call
    assert serves(q, k, _Tensor(2, 2, 1000, 64), 2, 1000, False)  # DV != D
    assert serves(_Tensor(2, 8, 1000, 96), _Tensor(2, 2, 1000, 96), _Tensor(2, 2, 1000, 96), 2, 1000, False)
    assert serves(_Tensor(2, 8, 1000, 256), _Tensor(2, 2, 1000, 256), _Tensor(2, 2, 1000, 256), 2, 1000, False)
    narrow = _Tensor(2, 8, 1000, 48)
    assert not serves(narrow, narrow, narrow, 2, 1000, False)  # below 64: half the tile would be padding
    odd = _Tensor(2, 8, 1000, 100)
    assert not serves(odd, odd, odd, 2, 1000, False)  # rows of 200 bytes: TMA needs 16-byte multiples
    assert not serves(_Tensor(2, 8, 1000, 128, dtype=torch.float32), k, k, 2, 1000, False)
    assert serves(_Tensor(2, 8, 999, 128), k, k, 2, 1000, False)  # Q_LEN != KV_LEN
    assert not serves(q, _Tensor(2, 2, 1000, 128, address=(1 << 20) + 8), k, 2, 1000, False)  # TMA: 16-byte bases
    # Layouts: TMA descriptors take each tensor's own strides, if they are 16-byte multiples and D is dense.
    assert serves(_transposed(2, 8, 1000, 128), _transposed(2, 2, 1000, 128), _transposed(2, 2, 1000, 64), 2, 1000,
                  False)  # as transformers passes them
    assert serves(_Tensor(1, 8, 1000, 128, strides=(3, 128, 1024, 1)), k, k, 2, 1000, False)  # size 1: never stepped
    sliced = _Tensor(2, 2, 1000, 128, strides=(2 * 1000 * 132, 1000 * 132, 132, 1))  # rows of 264 bytes
    assert not serves(q, sliced, k, 2, 1000, False)
    assert not serves(q, _Tensor(2, 2, 1000, 128, strides=(0, 128000, 128, 1)), k, 2, 1000, False)  # an expand
    assert not serves(q, _Tensor(2, 2, 1000, 128, strides=(2 * 1000 * 256, 1000 * 256, 256, 2)), k, 2, 1000, False)
    # TMA coordinates are int32 per dim of the (B, heads, length, D) tensors: a head's rows, and a tile's
    # overhang past them, must stay below 2**31; many heads of long rows are fine.
    assert serves(_Tensor(1, 16, 2**27, 128), _Tensor(1, 16, 2**27, 128), _Tensor(1, 16, 2**27, 128), 16, 2**27,
                  False)
    long = _Tensor(1, 1, 2**31 - 128, 128)
    assert not serves(long, long, long, 1, 2**31 - 128, False)
    assert not serves(_Tensor(1, 1, 16, 128), long, long, 1, 2**31 - 128, False)  # the keys' rows count too
    # The backward: the forward's rule, every head dim included (above 128 on tiles of its own).
    backward = module.families["hopper"].backward_serves
    assert backward(q, k, k) and backward(_Tensor(2, 8, 1000, 80), _Tensor(2, 2, 1000, 80), _Tensor(2, 2, 1000, 128))
    wide = _Tensor(2, 2, 1000, 136)
    assert backward(_Tensor(2, 8, 1000, 136), wide, k) and backward(q, k, wide)
    assert backward(_Tensor(2, 8, 1000, 256), _Tensor(2, 2, 1000, 256), _Tensor(2, 2, 1000, 256))
    assert not backward(_Tensor(2, 8, 1000, 264), _Tensor(2, 2, 1000, 264), k)
    assert backward(_transposed(2, 8, 1000, 128), _transposed(2, 2, 1000, 128), _transposed(2, 2, 1000, 128))
    assert not backward(q, sliced, k)
    assert not backward(*[_Tensor(2, 8, 1000, 128, device="cuda:8")] * 3)
    # Never a deterministic call: its key tiles add their dQ tiles concurrently.
    assert not backward(q, k, k, deterministic=True)


@pytest.mark.parametrize("spec", ["learned_rel_bias", "causal", "sigmoid_alibi"])
def test_deterministic_calls_run_the_portable_backward_after_the_hopper_forward(spec):
    # The dispatcher picks each call's backward family apart from its forward's: a deterministic call the
    # Hopper forward serves gets the portable backward (whose dQ pass writes each tile once), dense or packed.
    rt = attngen.build(SPECS / f"{spec}.attn", target="h200").module.ATTENTION
    hopper._HOPPER_DEVICES["cuda:7"] = True  # a stand-in Hopper GPU
    q, k = _Tensor(2, 8, 1000, 128), _Tensor(2, 2, 1000, 128)
    assert rt._forward_family(q, k, k, 2, 1000, False)[0] == "hopper"
    assert rt._backward_family(q, k, k)[:2] == ("hopper", "hopper_bwd")
    assert rt._backward_family(q, k, k, deterministic=True) == ("portable", "portable", None)
    assert rt._backward_family(q, k, k, deterministic=True, dropout=True)[0] == "portable"
    views = _Tensor(1, 8, 3000, 128), _Tensor(1, 2, 3000, 128)
    assert rt._backward_family(views[0], views[1], views[1], packed=True)[0] == "hopper"
    assert rt._backward_family(views[0], views[1], views[1], packed=True, deterministic=True)[0] == "portable"
    # Its backward refuses one outright (a ValueError, which python -O keeps), before it reads any tensor.
    with pytest.raises(ValueError, match="backward_serves declines deterministic calls"):
        rt.families["hopper"].backward(q, k, k, None, None, None, None, [], (), deterministic=True)


@pytest.mark.parametrize("dims", [(64, 64), (72, 136), (128, 128), (256, 256)], ids=lambda d: "x".join(map(str, d)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_the_family_s_descriptors_pass_tensor_descriptor_s_checks(dims, dtype):
    # _HopperDescriptor skips TensorDescriptor's checks: every descriptor the forward and the backward
    # build, of tensors the per-call rule admits (or the family allocates), must pass them.
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    module = attngen.build(SPECS / "causal.attn", target="h200").module
    D, DV = dims
    d_pad, dv_pad = module._widths(D, DV)
    layouts = {"dense": lambda heads, length, width: torch.zeros(2, heads, length, width, dtype=dtype),
               "transposed": lambda heads, length, width: torch.zeros(2, length, heads, width, dtype=dtype)
               .transpose(1, 2),  # as transformers passes them
               # a stride TMA could not take, on a dim of size 1 (which TMA never steps)
               "odd stride of size 1": lambda heads, length, width: torch.zeros(heads * length * width, dtype=dtype)
               .as_strided((1, heads, length, width), (3, length * width, width, 1))}
    for (layout, make), Q_LEN in itertools.product(layouts.items(), (1, 17, 1000)):
        q, k, v = (make(heads, Q_LEN, width) for heads, width in ((8, D), (2, D), (2, DV)))
        assert all(hopper._hopper_addressable(t) for t in (q, k, v)), layout
        block_m, block_n = module._family_tiles(q, v, "hopper")[:2]
        bwd_m, bwd_n = module._family_tiles(q, v, "hopper_bwd")[:2]
        rows = -(-Q_LEN // bwd_m) * bwd_m
        made = [hopper._hopper_descriptor(q, hopper.HOPPER_CONSUMER_ROWS, d_pad), hopper._hopper_descriptor(k, block_n, d_pad),
                hopper._hopper_descriptor(v, block_n, dv_pad), hopper._hopper_descriptor(q, bwd_m, d_pad),
                hopper._hopper_descriptor(k, bwd_n, d_pad),
                hopper._hopper_descriptor(torch.zeros(2, 8, Q_LEN, D, dtype=torch.float32), bwd_m, d_pad),
                hopper._hopper_row_descriptor(torch.zeros(2, 8, rows, dtype=torch.float32), bwd_m)]
        for descriptor in made:
            assert isinstance(descriptor, hopper._HopperDescriptor)
            TensorDescriptor.__post_init__(descriptor)  # raises AssertionError on a descriptor TMA cannot take


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("name", CATALOG)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", [(2, 8, 2, 1000, 1000), (1, 4, 4, 129, 300), (1, 4, 2, 257, 700)],
                         ids=lambda s: "x".join(map(str, s)))
def test_hopper_family_matches_the_reference_on_gpu(name, dtype, shape):
    B, H, HKV, Q_LEN, KV_LEN = shape
    attn = attngen.build(SPECS / f"{name}.attn")
    q, k, v = testing.random_qkv(B, H, HKV, Q_LEN, KV_LEN, 128, 128, dtype, device="cuda")
    inputs = testing.random_inputs(attn.spec, B, H, HKV, Q_LEN, KV_LEN, device="cuda")
    assert attn.forward_family(q, k, v, **inputs) == "hopper"
    assert attn.backward_family(q, k, v, **inputs) == "hopper"
    out = attn(q, k, v, **inputs)
    assert not out.isnan().any()
    # out, LSE, dq, dk, dv and the learnable inputs' gradients, all from the family's kernels.
    testing.check_against_reference(attn.spec, attn, q, k, v, inputs)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("name", CATALOG)
def test_hopper_wide_backward_runs_every_catalog_spec_on_gpu(name):
    # Above head dim 128 the backward's warpgroups split the head dims and pass P^T and dS^T through
    # shared memory: every spec's score, mask, derivative and learnable gradients must hold on that layout.
    attn = attngen.build(SPECS / f"{name}.attn")
    q, k, v = testing.random_qkv(1, 4, 2, 257, 700, 256, 256, torch.bfloat16, device="cuda")
    inputs = testing.random_inputs(attn.spec, 1, 4, 2, 257, 700, device="cuda")
    assert attn.forward_family(q, k, v, **inputs) == "hopper"
    assert attn.backward_family(q, k, v, **inputs) == "hopper"
    testing.check_against_reference(attn.spec, attn, q, k, v, inputs)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("name", ["causal", "gemma2_local", "document_causal"])
@pytest.mark.parametrize("dims", [(64, 64), (96, 96), (80, 128), (128, 64), (256, 256), (192, 128), (136, 200),
                                  (128, 256)],
                         ids=lambda d: f"D{d[0]}-DV{d[1]}")
def test_hopper_head_dims_on_gpu(name, dims):
    D, DV = dims
    attn = attngen.build(SPECS / f"{name}.attn")
    q, k, v = testing.random_qkv(2, 4, 2, 333, 333, D, DV, torch.bfloat16, device="cuda")
    inputs = testing.random_inputs(attn.spec, 2, 4, 2, 333, 333, device="cuda")
    assert attn.forward_family(q, k, v, **inputs) == "hopper"
    assert attn.backward_family(q, k, v, **inputs) == "hopper"
    testing.check_against_reference(attn.spec, attn, q, k, v, inputs)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("name", ["causal", "document_causal"])
def test_work_items_in_groups_of_heads_cover_every_tile_on_gpu(name):
    # The forward numbers its work items in groups of the heads whose K and V fit the L2 budget (device.py's
    # _hopper_head_group and _hopper_grouped_item). At D=256 (K and V: 1 KiB a row) over 2048 rows ten
    # (batch, head) pairs make several groups, the last one short: every item must still run exactly once.
    from attngen.families.hopper import device
    B, H, N, D = 2, 5, 2048, 256
    group = device.HOPPER_L2_GROUP_BYTES.value // (4 * D) // N
    assert 1 < group < B * H and B * H % group != 0
    attn = attngen.build(SPECS / f"{name}.attn")
    q, k, v = testing.random_qkv(B, H, H, N, N, D, D, torch.bfloat16, device="cuda")
    inputs = testing.random_inputs(attn.spec, B, H, H, N, N, device="cuda")
    assert attn.forward_family(q, k, v, **inputs) == "hopper"
    assert attn.backward_family(q, k, v, **inputs) == "hopper"
    testing.check_against_reference(attn.spec, attn, q, k, v, inputs)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("D", [64, 128])
def test_gated_diagonal_masks_follow_closed_form_ranges_on_gpu(D):
    # A chunk mask with a gate on the rows and a bound on the columns: the analysis proves its spans exact
    # (the gate's implied bound added), so the Hopper kernels compute them instead of following a table.
    attn = attngen.build("attention gated_chunks\nparam c = 425\nmask: q >= 3 and k > 5 and q // c == k // c\n")
    assert attn.module.FACTS.tile_table is False
    q, k, v = testing.random_qkv(2, 4, 2, 1000, 1100, D, D, torch.bfloat16, device="cuda")
    assert attn.forward_family(q, k, v) == "hopper" and attn.backward_family(q, k, v) == "hopper"
    testing.check_against_reference(attn.spec, attn, q, k, v, {})


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", [(2, 8, 2, 1000, 1000), (1, 4, 4, 129, 300), (1, 4, 2, 257, 700), (1, 2, 1, 1, 5)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dropout_p", [0.0, 0.2], ids=["plain", "dropout"])
def test_hopper_128_query_backward_of_plain_specs_on_gpu(dtype, shape, dropout_p):
    # full at D = 64 takes the 128-query backward (test_backward_tiles_widen_...): ragged query and key
    # lengths, grouped heads, dropout, against the float64 reference.
    B, H, HKV, Q_LEN, KV_LEN = shape
    attn = attngen.build(SPECS / "full.attn")
    q, k, v = testing.random_qkv(B, H, HKV, Q_LEN, KV_LEN, 64, 64, dtype, device="cuda")
    assert attn.module._family_tiles(q, v, "hopper_bwd")[:2] == (128, 128)
    assert attn.backward_family(q, k, v) == "hopper"
    testing.check_against_reference(attn.spec, attn, q, k, v, {}, seed=4, dropout_p=dropout_p)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
def test_hopper_128_query_backward_of_packed_calls_on_gpu():
    # The packed kernels of full at D = 64: sequences shorter than, across and many times the 128-row tile.
    attn = attngen.build(SPECS / "full.attn")
    lengths = [300, 1, 0, 700, 77, 129]
    g = torch.Generator().manual_seed(5)
    fused = torch.randn(sum(lengths), 8 + 2 * 2, 64, generator=g).to("cuda", torch.bfloat16)
    q, k, v = fused.split([8, 2, 2], dim=1)
    offsets = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
    packed = dict(cu_seqlens_q=offsets, cu_seqlens_k=offsets, max_seqlen_q=max(lengths), max_seqlen_k=max(lengths))
    assert attn.backward_family(q, k, v, **packed) == "hopper"
    testing.check_against_reference(attn.spec, attn, q, k, v, {}, packed=packed)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("q_len", [1, 17, 64, 65])
def test_hopper_backward_of_short_query_calls_on_gpu(q_len):
    # Fewer queries than one 64-row tile: TMA's zero rows and +inf LSE past Q_LEN keep P = 0 there. The
    # forward of the shortest calls is the decode family's; the backward is this family's all the same.
    attn = attngen.build(SPECS / "prefix_lm.attn")
    q, k, v = testing.random_qkv(2, 8, 2, q_len, 300, 128, 128, torch.bfloat16, device="cuda")
    inputs = testing.random_inputs(attn.spec, 2, 8, 2, q_len, 300, device="cuda")
    assert attn.backward_family(q, k, v, **inputs) == "hopper"
    testing.check_against_reference(attn.spec, attn, q, k, v, inputs)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("scale", ["0.05", "-0.1", "0"])
def test_hopper_spec_scales_on_gpu(scale):
    # A positive scale takes FA3's order (row max of the raw products, DEFER_SCALE); a negative one may
    # not (the max of the raw products is then the scaled minimum) and takes the scaled-first path. The
    # backward's 64-row steps start S^T at -LSE / qk_scale for any scale but 0 (FOLD_LSE), negative ones too.
    attn = attngen.build(f"attention scaled\nscale: {scale}\nmask: causal\n")
    q, k, v = testing.random_qkv(1, 4, 2, 300, 300, 128, 128, torch.bfloat16, device="cuda")
    assert attn.forward_family(q, k, v) == "hopper"
    testing.check_against_reference(attn.spec, attn, q, k, v)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_hopper_scores_of_transcendental_functions_on_gpu(dtype):
    # log2, log, tanh (one MUFU op in the family's scores), exp and sigmoid in a score, forward and
    # backward: logs of numbers near 1 scaled up, exps of large and very negative scores, sigmoids
    # saturating both ways, and one of a position-only rsqrt.
    attn = attngen.build("attention transcendental\nmask: causal\n"
                         "score: score + log2(2.0 + abs(score)) * 4.0 - log(1.0 + abs(score * 0.01)) * 30.0"
                         " + tanh(score * 0.3) + exp(score * 0.2) - sigmoid(score) * 3.0"
                         " + sigmoid(rsqrt(1.0 + abs((k - q) * 0.1)))\n")
    q, k, v = testing.random_qkv(2, 4, 2, 300, 300, 64, 64, dtype, device="cuda")
    assert (attn.forward_family(q, k, v), attn.backward_family(q, k, v)) == ("hopper", "hopper")
    testing.check_against_reference(attn.spec, attn, q, k, v)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
def test_every_forward_launch_finds_its_work_counter_zero_on_gpu():
    # The persistent forward takes its work items from a counter kept per stream (_hopper_work_counter),
    # which its last CTA sets back to zero. A counter left above zero would skip work items and leave rows
    # of O unwritten: calls of other grids in a row, on a second stream, and a captured CUDA graph replayed
    # between eager calls must all give the first eager call's bits (the forward is deterministic: one CTA
    # computes a work item whole).
    attn = attngen.build(SPECS / "causal.attn")
    cases = [testing.random_qkv(B, 4, 2, n, n, 64, 64, torch.bfloat16, device="cuda", seed=n)
             for B, n in ((1, 100), (3, 700), (2, 300), (8, 2000))]
    testing.check_against_reference(attn.spec, attn, *cases[0], grads=False)
    with torch.no_grad():
        first = [attn(*case) for case in cases]
        for _ in range(3):
            assert all(torch.equal(attn(*case), out) for case, out in zip(cases, first))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            on_stream = [attn(*case) for case in cases]
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                captured = attn(*cases[1])
        torch.cuda.current_stream().wait_stream(stream)
        assert all(torch.equal(out, ref) for out, ref in zip(on_stream, first))
        for _ in range(3):
            graph.replay()
            assert torch.equal(attn(*cases[3]), first[3])
            torch.cuda.synchronize()
            assert torch.equal(captured, first[1])


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
def test_a_ragged_tile_reads_nothing_of_the_next_head_on_gpu():
    # The last key tile of head 0 overhangs its 200 rows. Those rows must be TMA's zeros, not head 1's
    # first rows: an inf there would give 0 * inf = NaN in head 0's P @ V, where the reference is finite.
    attn = attngen.build(SPECS / "causal.attn")
    q, k, v = testing.random_qkv(2, 2, 2, 200, 200, 128, 128, torch.bfloat16, device="cuda")
    v[:, 1, :56] = float("inf")
    v[1, :, :56] = float("inf")  # and batch 1's rows, after batch 0's last head
    assert attn.forward_family(q, k, v) == "hopper"
    out = attn(q, k, v)
    assert not out[0, 0].isnan().any()
    head = (slice(0, 1), slice(0, 1))
    testing.check_against_reference(attn.spec, attn, q[head], k[head], v[head], grads=False)
    torch.testing.assert_close(out[head], attn(q[head], k[head], v[head]), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
def test_hopper_rows_without_keys_and_user_tables_on_gpu():
    # Rows no key is allowed to: O = 0, LSE = -inf, no NaN (a block layout with empty rows).
    attn = attngen.build(SPECS / "block_sparse.attn")
    q, k, v = testing.random_qkv(1, 2, 2, 512, 512, 128, 128, torch.bfloat16, device="cuda")
    layout = torch.rand(2, 4, 4, device="cuda") < 0.5
    layout[:, 1] = False
    assert attn.forward_family(q, k, v, layout=layout) == "hopper"
    out, lse = attn(q, k, v, layout=layout, return_lse=True)
    assert (out[:, :, 128:256] == 0).all() and (lse[:, :, 128:256] == float("-inf")).all()
    testing.check_against_reference(attn.spec, attn, q, k, v, {"layout": layout})
    # Tables built once by the user serve the family's forward too.
    tables = attn.tile_tables(q, k, v, layout=layout)
    assert torch.equal(attn(q, k, v, layout=layout, tile_tables=tables), out)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
def test_hopper_under_torch_compile_on_gpu():
    attn = attngen.build(SPECS / "document_causal.attn")
    q, k, v = testing.random_qkv(1, 4, 4, 1000, 1000, 128, 128, torch.bfloat16, device="cuda")
    inputs = testing.random_inputs(attn.spec, 1, 4, 4, 1000, 1000, device="cuda")
    compiled = torch.compile(lambda q, k, v, doc: attn(q, k, v, doc=doc), fullgraph=True)
    assert torch.equal(compiled(q, k, v, inputs["doc"]), attn(q, k, v, **inputs))
    # The backward operator runs the family's backward too, with the table it builds at run time.
    assert attn.backward_family(q, k, v, **inputs) == "hopper"
    traced = torch.compile(lambda q, k, v, return_lse, doc: attn(q, k, v, return_lse=return_lse, doc=doc),
                           fullgraph=True)
    testing.check_against_reference(attn.spec, traced, q, k, v, inputs)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
def test_calls_outside_the_rule_go_to_the_portable_forward():
    attn = attngen.build(SPECS / "causal.attn")
    q, k, v = testing.random_qkv(1, 4, 4, 300, 300, 128, 128, torch.bfloat16, device="cuda")
    assert attn.forward_family(q, k, v) == "hopper"
    # A layout TMA cannot address: rows of 264 bytes (D = 128 of 132), not a multiple of 16.
    strided = torch.zeros(1, 4, 300, 132, dtype=q.dtype, device="cuda")[..., :128].copy_(q)
    assert attn.forward_family(strided, k, v) == "portable"
    assert attn.forward_family(q.float(), k.float(), v.float()) == "portable"
    q48, k48, v48 = testing.random_qkv(1, 4, 4, 300, 300, 48, 48, torch.bfloat16, device="cuda")
    assert attn.forward_family(q48, k48, v48) != "hopper"
    lengths = torch.full((1,), 300, dtype=torch.int32, device="cuda")
    assert attn.forward_family(q, k, v, kv_len=lengths) != "hopper"
    testing.check_against_reference(attn.spec, attn, strided, k, v)


class _GradInTransposedLayout(torch.autograd.Function):
    """The identity, whose backward hands the gradient on as the transpose(1, 2) of a dense (B, N, H, D)
    tensor: the layout dO has when the model reads O through such a view, as transformers does."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("name", ["causal", "document_causal", "learned_rel_bias", "alibi_causal"])
@pytest.mark.parametrize("shape", [(2, 8, 2, 1000, 1000, 128, 128), (1, 4, 4, 257, 700, 72, 136),
                                   (1, 4, 2, 300, 300, 256, 256)], ids=lambda s: "x".join(map(str, s)))
def test_transposed_views_run_the_hopper_kernels_on_gpu(name, shape):
    # q, k, v as transformers passes them: transposes of dense (B, N, heads, D) projections. TMA reads them
    # in place, forward and backward, and the gradients reach the strided leaves.
    B, H, HKV, Q_LEN, KV_LEN, D, DV = shape
    attn = attngen.build(SPECS / f"{name}.attn")
    dense = testing.random_qkv(B, H, HKV, Q_LEN, KV_LEN, D, DV, torch.bfloat16, device="cuda")
    q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in dense)
    inputs = testing.random_inputs(attn.spec, B, H, HKV, Q_LEN, KV_LEN, device="cuda")
    assert not q.is_contiguous() and not k.is_contiguous()
    assert attn.forward_family(q, k, v, **inputs) == "hopper" and attn.backward_family(q, k, v, **inputs) == "hopper"
    # The same tiles in the same order as for dense tensors: the same bits.
    assert torch.equal(attn(q, k, v, **inputs), attn(*dense, **inputs))
    testing.check_against_reference(attn.spec, attn, q, k, v, inputs)

    def transposed_do(*args, **kwargs):
        out, lse = attn(*args, **kwargs)
        return _GradInTransposedLayout.apply(out), lse
    testing.check_against_reference(attn.spec, transposed_do, q, k, v, inputs, seed=1)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("name", ["global_band", "natten_2d", "block_diffusion", "sliding_tiles_text"])
def test_published_masks_follow_kept_tables_in_the_hopper_kernels_on_gpu(name):
    """The published masks the benchmarks time (benchmarks/published, at their N = 4096 sizes) read no input:
    the Hopper forward and backward follow tables of their own tiles, built on the first call and kept, and
    match the float64 reference."""
    attn = attngen.build(Path(__file__).parent.parent / "benchmarks" / "published" / f"{name}.attn")
    assert attn.module.FACTS.static_tables is not None
    q, k, v = testing.random_qkv(1, 2, 2, 4096, 4096, 128, 128, torch.bfloat16, device="cuda")
    assert attn.forward_family(q, k, v) == "hopper" and attn.backward_family(q, k, v) == "hopper"
    testing.check_against_reference(attn.spec, attn, q, k, v, {})
    built = attn.module.TABLE_STATS["built"]
    assert built == 2  # the family's forward and backward tilings
    testing.check_against_reference(attn.spec, attn, q, k, v, {})
    assert attn.module.TABLE_STATS["built"] == built


@pytest.mark.parametrize("shape", [(2, 3, 70, 64), (1, 2, 33, 96), (1, 1, 130, 256)], ids=str)
def test_an_fp8_calls_v_is_transposed_with_its_keys_innermost(shape):
    """V^T for the FP8 forward's PV wgmma (8-bit B operands are read K-major only): from V in any strides, its
    bytes transposed, the keys of each chunk of 32 in the order the wgmma's threads hold P's keys as their A
    operand (position 16 h + 4 c + 2 a + b holds key 16 h + 8 a + 2 c + b: a thread's own accumulator pairs,
    four to a register), zeros past KV_LEN to the last chunk's end."""
    from attngen.families.hopper import runtime as hopper_runtime
    B, HKV, KV_LEN, DV = shape
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter's launch, or the GPU's
    v = torch.randn(B, KV_LEN, HKV, DV, device=device).to(torch.float8_e4m3fn).transpose(1, 2)  # BSHD strides
    descriptor = hopper_runtime._hopper_transposed_descriptor(v, DV, 128)
    v = v.cpu()
    KV_PAD = -(-KV_LEN // 32) * 32
    assert list(descriptor.shape) == [B, HKV, DV, KV_PAD] and descriptor.base.stride(2) % 16 == 0
    order = [32 * chunk + 16 * h + 8 * a + 2 * c + b for chunk in range(KV_PAD // 32)
             for h in range(2) for c in range(4) for a in range(2) for b in range(2)]
    keys = torch.tensor(order)
    want = torch.zeros(B, HKV, DV, KV_PAD, dtype=torch.uint8)
    inside = keys < KV_LEN
    want[..., inside] = v.view(torch.uint8).transpose(2, 3)[..., keys[inside]]
    assert sorted(order) == list(range(KV_PAD))  # a permutation of each chunk
    assert torch.equal(descriptor.base.view(torch.uint8).cpu(), want)
