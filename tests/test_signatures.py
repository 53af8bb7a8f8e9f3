"""The runtime (attngen/runtime/) launches each kernel with the arguments its declared signature
(emit/signatures.py) names, in that order: the launches are recorded, not run, and every argument is
checked against what its parameter's name says it is."""

import dataclasses
from pathlib import Path

import pytest
import torch

import attngen
from attngen.analysis import analyze
from attngen.emit.signatures import Signature, kernel_signatures
from attngen.families.decode import runtime as decode_runtime
from attngen.testing import random_inputs, random_qkv

ROOT = Path(__file__).resolve().parent.parent
LAUNCH_OPTIONS = {"num_warps", "num_stages"}


class Recorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **kwargs)` is recorded, not run."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def _bound(signature: Signature, args: tuple, kwargs: dict) -> dict:
    """The launch's arguments by parameter name; every parameter given exactly once."""
    named = {k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS}
    assert len(args) + len(named) == len(signature.params), signature.name
    assert set(named) == set(signature.params[len(args):]), signature.name
    return {**dict(zip(signature.params, args)), **named}


def _check_tensor_args(bound: dict, tensors: dict) -> None:
    """Each tensor argument and its strides; the `(B, H, rows, cols)` strides follow the tensor."""
    for name, (tensor, letter) in tensors.items():
        assert bound[name] is tensor, name
        assert [bound[f"stride_{letter}{axis}"] for axis in ("z", "h", "m" if letter in ("q", "o", "do", "dq") else "n", "k")] \
            == list(tensor.stride()), name


def _check_inputs(bound: dict, spec: attngen.Spec, inputs: dict) -> None:
    for decl in spec.inputs:
        t = inputs[decl.name]
        assert bound[f"{decl.name}_ptr"].data_ptr() == t.data_ptr()
        for d in range(len(decl.dims)):
            assert bound[f"stride_{decl.name}_{d}"] == t.stride(d) and bound[f"size_{decl.name}_{d}"] == t.shape[d]


@pytest.mark.parametrize("name", ["alibi_causal", "document_causal", "learned_rel_bias", "block_sparse"])
def test_host_launches_follow_the_declared_signatures(name, monkeypatch):
    attn = attngen.build(ROOT / "specs" / f"{name}.attn")
    module, spec = attn.module, attn.spec
    signatures = kernel_signatures(spec, analyze(spec).tile_table)
    B, H, HKV, Q_LEN, KV_LEN, D = 2, 4, 2, 40, 33, 32
    q, k, v = random_qkv(B, H, HKV, Q_LEN, KV_LEN, D, D, torch.float32)
    inputs = random_inputs(spec, B, H, HKV, Q_LEN, KV_LEN)
    tensors = [inputs[n].contiguous() for n in module.FACTS.inputs]
    sizes = {"B": B, "H": H, "HKV": HKV, "Q_LEN": Q_LEN, "KV_LEN": KV_LEN}
    tables = [module._build_table(module._table_key(q, v, kernel), tuple(sizes.values()), q.device, tensors)
              for kernel in range(3)]

    fwd = Recorder()
    monkeypatch.setattr(module.ATTENTION, "kernels", dataclasses.replace(module.ATTENTION.kernels, forward=fwd))
    out, lse = module._forward(q, k, v, tensors, {0: tables[0]})
    bound = _bound(signatures["fwd_kernel"], *fwd.calls[0])
    _check_tensor_args(bound, {"Q": (q, "q"), "K": (k, "k"), "V": (v, "v"), "Out": (out, "o")})
    assert bound["Lse"] is lse and {n: bound[n] for n in sizes} == sizes
    assert bound["sm_scale"] == module.softmax_scale(D) and bound["HEAD_DIM"] == D
    _check_inputs(bound, spec, inputs)
    if module.FACTS.tile_table:
        assert bound["TblNum"] is tables[0][0] and bound["TblIdx"] is tables[0][1]

    bwd = Recorder()
    monkeypatch.setattr(module.ATTENTION, "kernels", dataclasses.replace(module.ATTENTION.kernels, backward=bwd))
    do = torch.randn_like(out)
    dq, dk, dv, _, _ = module._portable_backward(q, k, v, out, lse, do, None, tensors, tables[1:])
    for args, kwargs in bwd.calls:
        bound = _bound(signatures["bwd_kernel"], args, kwargs)
        _check_tensor_args(bound, {"Q": (q, "q"), "K": (k, "k"), "V": (v, "v"), "DO": (do, "do"),
                                   "DQ": (dq, "dq"), "DK": (dk, "dk"), "DV": (dv, "dv")})
        assert bound["Lse"] is lse and {n: bound[n] for n in sizes} == sizes
        _check_inputs(bound, spec, inputs)
        for decl in spec.learnable_inputs:
            assert bound[f"{decl.name}_grad"].shape == inputs[decl.name].shape
        if module.FACTS.tile_table:
            assert bound["kv_TblNum"] is tables[1][0] and bound["q_TblNum"] is tables[2][0]


def test_the_compiled_kernels_take_the_declared_parameters():
    attn = attngen.build(ROOT / "specs" / "document_causal.attn")
    signatures = kernel_signatures(attn.spec, True)
    for key, kernel in (("fwd_kernel", "_fwd_kernel"), ("bwd_kernel", "_bwd_kernel"),
                        ("table_by_query", "_table_by_query_classify")):
        assert tuple(getattr(attn.module, kernel).arg_names) == signatures[key].params
    decode = attngen.build(ROOT / "specs" / "alibi_causal.attn")
    signatures = kernel_signatures(decode.spec, False)
    assert tuple(decode.module._decode_fwd_kernel.arg_names) == signatures["decode_fwd"].params
    assert tuple(decode_runtime._decode_combine.arg_names) == signatures["decode_combine"].params  # every spec's


def test_decode_launches_follow_the_declared_signatures(monkeypatch):
    attn = attngen.build(ROOT / "specs" / "alibi_causal.attn")
    module, spec = attn.module, attn.spec
    signatures = kernel_signatures(spec, False)
    B, H, HKV, Q_LEN, KV_LEN, D = 2, 8, 2, 3, 300, 32
    q, k, v = random_qkv(B, H, HKV, Q_LEN, KV_LEN, D, D, torch.float32)
    inputs = random_inputs(spec, B, H, HKV, Q_LEN, KV_LEN)
    tensors = [inputs[n].contiguous() for n in module.FACTS.inputs]
    sizes = {"B": B, "H": H, "HKV": HKV, "Q_LEN": Q_LEN, "KV_LEN": KV_LEN}
    split, combine = Recorder(), Recorder()
    monkeypatch.setattr(module.families["decode"], "forward_kernel", split)
    monkeypatch.setattr(decode_runtime, "_decode_combine", combine)  # the family's own kernel, every spec's
    out, lse = module._forward(q, k, v, tensors, {})
    bound = _bound(signatures["decode_fwd"], *split.calls[0])
    _check_tensor_args(bound, {"Q": (q, "q"), "K": (k, "k"), "V": (v, "v")})
    assert {n: bound[n] for n in sizes} == sizes and bound["SPLITS"] > 1
    assert bound["OutPart"].shape == (bound["SPLITS"], B, H, Q_LEN, D) and bound["BLOCK_M"] == 16
    _check_inputs(bound, spec, inputs)
    merged = _bound(signatures["decode_combine"], *combine.calls[0])
    assert merged["OutPart"] is bound["OutPart"] and merged["LsePart"] is bound["LsePart"]
    assert merged["Out"] is out and merged["Lse"] is lse and merged["SPLITS"] == bound["SPLITS"]
    assert merged["n_rows"] == B * H * Q_LEN
