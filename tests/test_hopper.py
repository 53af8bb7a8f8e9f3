"""The Hopper family (plan.families.HOPPER): which specs and targets get it, what its module holds, and,
on a Hopper GPU, its forward against the float64 reference with the portable backward behind it.

Its kernels are Gluon (TMA, mbarriers, asynchronous wgmma, warp specialization): they compile for
sm_90 on a CPU (tests/test_hopper_prototype.py) but run only on the GPU."""

from pathlib import Path

import pytest
import torch

import attngen
from attngen import api, testing
from attngen.analysis import analyze
from attngen.plan import families
from attngen.plan.targets import get_target

SPECS = Path(__file__).parent.parent / "specs"
ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.parametrize("target", ["h100", "h200"])
def test_hopper_targets_get_the_family_for_plain_and_causal_specs(target):
    for spec in ("full", "causal"):
        chosen, why = families.choose_families(analyze(attngen.load_spec(SPECS / f"{spec}.attn")[0]), get_target(target))
        assert chosen == (families.DECODE, families.HOPPER, families.PORTABLE), why
        assert f"hopper (fwd for {families.HOPPER.per_call})" in why
    for spec in ("alibi_causal", "document_causal", "sliding_window"):
        chosen, why = families.choose_families(analyze(attngen.load_spec(SPECS / f"{spec}.attn")[0]), get_target(target))
        assert families.HOPPER not in chosen
        assert "not hopper: its kernels take no score expression, inputs or mask other than causal yet" in why


def test_other_targets_do_not_get_the_family():
    for target in ("a100", "interpreter"):
        chosen, why = families.choose_families(analyze(attngen.load_spec(SPECS / "causal.attn")[0]), get_target(target))
        assert families.HOPPER not in chosen
        assert f"not hopper: its kernels need a Hopper GPU (sm_90: TMA, wgmma, setmaxnreg); the target is {target}" in why


def test_the_module_for_hopper_holds_the_gluon_kernels():
    hopper = attngen.compile_source(SPECS / "causal.attn", target="h200")
    assert "from triton.experimental import gluon" in hopper and "def _hopper_fwd_kernel(" in hopper
    assert "HOPPER_CAUSAL = True" in hopper
    assert "('hopper', _hopper_serves, _hopper_forward)" in hopper
    assert "HOPPER_CAUSAL = False" in attngen.compile_source(SPECS / "full.attn", target="h100")
    ampere = attngen.compile_source(SPECS / "causal.attn", target="a100")
    assert "gluon" not in ampere and "_hopper_" not in ampere


def test_explain_names_the_family_and_its_tiles():
    text = api.explain(SPECS / "causal.attn", q_len=4096, kv_len=4096, head_dim=128, head_dim_v=128, dtype="bf16",
                       target="h200").text
    assert "kernel families: decode, hopper, portable" in text
    assert "hopper: 128x128 tiles, two 4-warp consumer warpgroups" in text


class _Tensor:
    """What the per-call rule reads of a tensor, without memory behind it (the rule's CPU test)."""

    def __init__(self, *shape, dtype=torch.bfloat16, contiguous=True):
        self.shape, self.dtype, self.is_cuda, self._contiguous = shape, dtype, True, contiguous

    def is_contiguous(self):
        return self._contiguous


def test_the_per_call_rule():
    serves = attngen.build(SPECS / "causal.attn", target="h200").module._hopper_serves
    q, k = _Tensor(2, 8, 1000, 128), _Tensor(2, 2, 1000, 128)
    assert serves(q, k, k, 2, 1000, False)
    assert not serves(q, k, k, 2, 1000, True)  # a cache call
    assert not serves(q, k, _Tensor(2, 2, 1000, 64), 2, 1000, False)  # DV != D
    assert not serves(_Tensor(2, 8, 1000, 96), _Tensor(2, 2, 1000, 96), _Tensor(2, 2, 1000, 96), 2, 1000, False)
    assert not serves(_Tensor(2, 8, 1000, 128, dtype=torch.float32), k, k, 2, 1000, False)
    assert not serves(q, k, k, 2, 999, False)  # Q_LEN != KV_LEN
    assert not serves(q, _Tensor(2, 2, 1000, 128, contiguous=False), k, 2, 1000, False)
    # Rows past int32 would wrap the kernels' TMA coordinates: those calls go elsewhere.
    assert serves(_Tensor(1, 16, 2**27 - 16, 128), _Tensor(1, 16, 2**27 - 16, 128), _Tensor(1, 16, 2**27 - 16, 128),
                  16, 2**27 - 16, False)
    big = _Tensor(1, 16, 2**27, 128)
    assert not serves(big, big, big, 16, 2**27, False)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("name", ["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("shape", [(2, 8, 2, 1000), (1, 4, 4, 129), (1, 2, 1, 1)], ids=lambda s: "x".join(map(str, s)))
def test_hopper_forward_matches_the_reference_on_gpu(name, dtype, head_dim, shape):
    B, H, HKV, N = shape
    attn = attngen.build(SPECS / f"{name}.attn")
    q, k, v = testing.random_qkv(B, H, HKV, N, N, head_dim, head_dim, dtype, device="cuda")
    assert attn.forward_family(q, k, v) == ("decode" if (H // HKV) * N <= 64 else "hopper")
    testing.check_against_reference(attn.spec, attn, q, k, v)  # out, LSE and gradients (portable backward)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
def test_calls_outside_the_rule_go_to_the_portable_forward():
    attn = attngen.build(SPECS / "causal.attn")
    q, k, v = testing.random_qkv(1, 4, 4, 300, 300, 128, 128, torch.bfloat16, device="cuda")
    assert attn.forward_family(q, k, v) == "hopper"
    strided = q.transpose(1, 2).contiguous().transpose(1, 2)  # (B, N, H, D) memory, as transformers passes it
    assert attn.forward_family(strided, k, v) == "portable"
    assert attn.forward_family(q.float(), k.float(), v.float()) == "portable"
    q96, k96, v96 = testing.random_qkv(1, 4, 4, 300, 300, 96, 96, torch.bfloat16, device="cuda")
    assert attn.forward_family(q96, k96, v96) == "portable"
    lengths = torch.full((1,), 300, dtype=torch.int32, device="cuda")
    assert attn.forward_family(q, k, v, kv_len=lengths) != "hopper"
    testing.check_against_reference(attn.spec, attn, strided, k, v)
