"""runtime/interpreter.py: reductions with a combine function of their own, as a tree in Triton's interpreter,
give what the interpreter's element-by-element path gives (which the tree replaces), in order."""

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from attngen.runtime import interpreter
from attngen.runtime.helpers import _min_max_sum
from attngen.runtime.launch import INTERPRETING

pytestmark = pytest.mark.skipif(not INTERPRETING, reason="Triton's CPU interpreter only")


def _installed(name):
    """The interpreter function `name` as install() left it, or a skip where this Triton's interpreter has none
    (install() then keeps the interpreter's own path: slower, not wrong)."""
    from triton.runtime import interpreter as triton_interpreter

    owner = getattr(triton_interpreter, "ReduceOps", None) if name == "generic_reduce" else triton_interpreter
    found = getattr(owner, name, None)
    if found is None:
        pytest.skip(f"this Triton's interpreter has no {name}")
    return found


@triton.jit
def _first_nonzero(a, b):
    # Associative, not commutative: the tree must keep the elements' order.
    return tl.where(a != 0, a, b)


@triton.jit
def _reductions(X, Lo, Hi, Sum, First, KEEP: tl.constexpr, AXIS: tl.constexpr, M: tl.constexpr, N: tl.constexpr):
    rows = tl.arange(0, M)[:, None]
    cols = tl.arange(0, N)[None, :]
    x = tl.load(X + rows * N + cols)
    lo, hi, total = tl.reduce((x, x, x), AXIS, _min_max_sum, keep_dims=KEEP)
    first = tl.reduce(x, AXIS, _first_nonzero, keep_dims=KEEP)
    if AXIS == 0:
        out = tl.arange(0, N)[None, :] if KEEP else tl.arange(0, N)
    else:
        out = tl.arange(0, M)[:, None] if KEEP else tl.arange(0, M)
    tl.store(Lo + out, lo)
    tl.store(Hi + out, hi)
    tl.store(Sum + out, total)
    tl.store(First + out, first)


@triton.jit
def _whole(X, Out, M: tl.constexpr, N: tl.constexpr):
    x = tl.load(X + tl.arange(0, M)[:, None] * N + tl.arange(0, N)[None, :])
    tl.store(Out, tl.reduce(x, None, _first_nonzero))


def _run(x, axis, keep):
    M, N = x.shape
    length = N if axis == 0 else M
    outs = [torch.empty(length, dtype=x.dtype) for _ in range(4)]
    _reductions[(1,)](x, *outs, KEEP=keep, AXIS=axis, M=M, N=N)
    return outs


def _expected(x, axis):
    a = x.numpy()
    nonzero = a != 0
    first_at = np.where(nonzero.any(axis), nonzero.argmax(axis), a.shape[axis] - 1)
    first = np.take_along_axis(a, np.expand_dims(first_at, axis), axis).squeeze(axis)
    return a.min(axis), a.max(axis), a.sum(axis), first


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("dtype", [torch.int32, torch.float32])
def test_tree_reductions_equal_numpy_in_order(axis, keep, dtype):
    torch.manual_seed(axis)
    x = torch.randint(-3, 4, (16, 32)).to(dtype)
    x[:, 5] = 0  # zeros, so "first non-zero" picks past the first element
    for got, want in zip(_run(x, axis, keep), _expected(x, axis)):
        assert np.array_equal(got.numpy(), want.astype(got.numpy().dtype))


def test_the_tree_replaced_the_element_by_element_path_and_keeps_it_for_a_whole_tensor():
    assert _installed("generic_reduce").original is not None  # installed when attngen runs in the interpreter
    interpreter.install()  # a second install keeps the first
    assert not hasattr(_installed("generic_reduce").original, "original")
    x = torch.zeros(4, 8, dtype=torch.int32)
    x[2, 3], x[3, 0] = 7, 9
    out = torch.empty(1, dtype=torch.int32)
    _whole[(1,)](x, out, M=4, N=8)  # axis=None: the interpreter's own path, over the flattened tensor
    assert out.item() == 7


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _helper_calls(X, Out, CALLS: tl.constexpr):
    x = tl.load(X + tl.arange(0, 16))
    for _ in tl.static_range(CALLS):
        x = _twice(x)
    tl.store(Out + tl.arange(0, 16), x)


def test_helper_calls_inside_a_kernel_do_not_patch_the_language_again(monkeypatch):
    from triton.runtime import interpreter as triton_interpreter

    patches = []
    original = _installed("_patch_lang").original  # the interpreter's own, under install's
    counting = interpreter._patch_lang_once(lambda fn: patches.append(fn.__name__) or original(fn),
                                             triton_interpreter._LangPatchScope, tl)
    monkeypatch.setattr(triton_interpreter, "_patch_lang", counting)
    x = torch.arange(16, dtype=torch.float32)
    out = torch.empty_like(x)
    _helper_calls[(2,)](x, out, CALLS=5)
    assert torch.equal(out, x * 32)
    assert patches == ["_helper_calls"]  # the kernel's launch patched; none of its ten helper calls did
    assert tl.core.is_builtin(tl.arange)  # and the launch restored the language when it ended


def test_the_dtype_table_answers_as_the_interpreter_does():
    table = _installed("_get_np_dtype")
    original = table.original
    for dtype in (tl.int1, tl.int32, tl.uint64, tl.float16, tl.bfloat16, tl.float32, tl.float64, tl.float8e4nv):
        for asked in (dtype, tl.block_type(dtype, [16, 32]), tl.pointer_type(dtype),
                      tl.block_type(tl.pointer_type(dtype), [16])):
            assert table(asked) == original(asked), asked
    with pytest.raises(KeyError):
        table(tl.void)  # what the interpreter has no numpy dtype for fails as it did


@triton.jit
def _to_e4m3(X, Y, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Y + offs, tl.load(X + offs).to(tl.float8e4nv))


def test_rounding_to_e4m3_is_the_gpus():
    # Ties to even, carries into the exponent (1.97 -> 2.0), subnormals, and saturation at 448, as PTX's
    # cvt.rn.satfinite.e4m3x2.f32 rounds; the interpreter's own path fails this (it rounded 37 of 1024
    # uniform values in [0.001, 0.9] otherwise, one of them to half its value).
    from triton.runtime import interpreter as triton_interpreter

    assert hasattr(triton_interpreter.InterpreterBuilder.create_fp_to_fp, "original")
    torch.manual_seed(0)
    x = torch.cat([torch.rand(960) * 2.0, torch.tensor([1.97, 1.0625, 1.1875, 0.0013, -0.0021, 500.0, -1e6, 0.0] * 8)])
    y = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    _to_e4m3[(1,)](x, y, x.numel())
    assert torch.equal(y.view(torch.uint8), x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8))
