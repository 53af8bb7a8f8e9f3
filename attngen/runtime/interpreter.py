"""Triton's CPU interpreter, made fast where attngen's kernels need it: calls of @triton.jit helpers, and
reductions with a combine function of their own.

Every call of a helper inside a kernel (runtime.helpers' _grad_add, _index_bound, the spec's hooks) has
the interpreter patch triton.language anew: about 300 attributes found by inspect.getmembers and
replaced, some 0.2 ms a call, a fifth of a tile-table test's time. While a kernel runs they are patched
already (the kernel's launch patched them, and restores them when it ends), and a patch made again is the
same patch (one builder for the whole interpreter). `install` has a helper's call skip it then. And
the numpy dtype of a Triton dtype, which the interpreter asks for on most operations, is looked up in
one table instead of one built anew on every call (6% of a kernel's time in the interpreter).

The interpreter reduces tl.min, tl.max and tl.sum in numpy, but any other combine function (the tuple
reductions of a learnable input's gradient scatter, runtime.helpers._min_max_sum and _sum_pair) one
element at a time: a Python call of the combine per element, about 45 ms for a 16 x 16 tile, most of a
learnable bias's backward in the interpreter. `install` replaces that path by a tree of vectorised
combines: the elements along the axis paired as neighbours (0 with 1, 2 with 3, ...) and combined in one
call per level, log2(n) calls in all. A reduction's combine must be associative (as on the GPU, which
combines in a tree too); neighbours keep their order, so it need not commute. Anything the tree does not
cover (a reduction over every axis, a length that is not a power of two) goes the interpreter's own way.
"""


def _tree_reduce(original):
    """The interpreter's ReduceOps.generic_reduce, as a tree over the axis where it can be one."""

    def generic_reduce(self, input):
        axis = self.axis
        data = [arg.handle.data for arg in input]
        if axis is None or not data[0].shape:
            return original(self, input)
        n = data[0].shape[axis]
        if n < 1 or n & (n - 1):
            return original(self, input)
        dtypes = [arg.dtype for arg in input]
        while data[0].shape[axis] > 1:
            pairs = [d.reshape(d.shape[:axis] + (d.shape[axis] // 2, 2) + d.shape[axis + 1:]) for d in data]
            left = [self.to_tensor(p.take(0, axis=axis + 1), t) for p, t in zip(pairs, dtypes)]
            right = [self.to_tensor(p.take(1, axis=axis + 1), t) for p, t in zip(pairs, dtypes)]
            combined = self.combine_fn.fn(*left, *right)
            combined = combined if isinstance(combined, tuple) else (combined,)
            results = [getattr(getattr(c, "handle", None), "data", None) for c in combined]
            if any(r is None or r.shape != half.handle.data.shape for r, half in zip(results, left)):
                return original(self, input)  # a combine that returns a constant: the interpreter's own way
            # Each level's results in the inputs' dtypes, as the interpreter's accumulators keep them.
            data = [r.astype(d.dtype) for r, d in zip(results, data)]
        return [self.to_tensor(d if self.keep_dims else d.squeeze(axis), t) for d, t in zip(data, dtypes)]

    generic_reduce.original = original
    return generic_reduce


def _dtype_table(original, tl):
    """The interpreter's _get_np_dtype from a table made once by asking it about each scalar dtype."""
    names = ("int1", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16",
             "bfloat16", "float32", "float64", "float8e5", "float8e5b16", "float8e4nv", "float8e4b8", "float8e4b15")
    table = {}
    for name in names:
        dtype = getattr(tl, name, None)
        if dtype is not None:
            table[dtype] = original(dtype)

    def _get_np_dtype(tt_dtype):
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        found = table.get(scalar) if not isinstance(scalar, tl.pointer_type) else None
        return found if found is not None else original(tt_dtype)

    _get_np_dtype.original = original
    return _get_np_dtype


def _patched(fn, tl):
    """Whether the language modules fn's helper call would patch are patched now: their builtins (arange
    stands for every attribute one _patch_lang sets, as it sets and restores them together) and the
    tensor descriptors' (which every call patches too)."""
    langs = [value for value in fn.__globals__.values() if value is tl or value is tl.core]
    checked = [(lang, "arange") for lang in langs]
    descriptors = getattr(tl.core, "tensor_descriptor_base", None)  # Triton 3.6's; not every version's
    if descriptors is not None:
        checked.append((descriptors, "atomic_add"))
    return bool(langs) and not any(tl.core.is_builtin(getattr(obj, name, None)) for obj, name in checked)


def _patch_lang_once(original, empty_scope, tl):
    """The interpreter's _patch_lang, a no-op for a helper's call while its modules are patched."""

    def _patch_lang(fn):
        if _HELPER_CALLS[0] and _patched(fn, tl):
            return empty_scope()
        return original(fn)

    _patch_lang.original = original
    return _patch_lang


_HELPER_CALLS = [0]  # helper calls in progress (InterpretedFunction.__call__): their _patch_lang may skip


def _counted_helper_call(original):
    def call(self, *args, **kwargs):
        _HELPER_CALLS[0] += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            _HELPER_CALLS[0] -= 1

    call.original = original
    return call


def _fp8_rounding(original, tl):
    """The interpreter's create_fp_to_fp with a narrowing to float8e4nv rounded as the GPU rounds it: to the
    nearest, ties to even, saturating at +-448 (PTX cvt.rn.satfinite.e4m3x2.f32). The interpreter's own
    shifts the mantissa and adds the cut-off bit without carrying it into the exponent (1.97 became 1.0),
    and an FP8 call's P, rounded so before its product with V, took that error."""
    import torch

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if dst_type.scalar != tl.float8e4nv or src.dtype.scalar not in (tl.float32, tl.float16, tl.bfloat16):
            return original(self, src, dst_type, rounding_mode)
        wide = torch.from_numpy(src.data.astype("float32"))  # the interpreter's values are numpy arrays
        narrow = wide.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return type(src)(narrow, dst_type.scalar)

    create_fp_to_fp.original = original
    return create_fp_to_fp


def install():
    """Puts the tree, the dtype table and the helper calls' fast path in the interpreter's place (once; a
    Triton whose interpreter lacks one of its functions keeps its own there)."""
    from triton import language as tl
    from triton.runtime import interpreter

    ops = getattr(interpreter, "ReduceOps", None)
    reduce = getattr(ops, "generic_reduce", None)
    if reduce is not None and not hasattr(reduce, "original"):
        ops.generic_reduce = _tree_reduce(reduce)
    np_dtype = getattr(interpreter, "_get_np_dtype", None)
    if np_dtype is not None and not hasattr(np_dtype, "original"):
        interpreter._get_np_dtype = _dtype_table(np_dtype, tl)
    builder = getattr(interpreter, "InterpreterBuilder", None)
    to_fp = getattr(builder, "create_fp_to_fp", None)
    if to_fp is not None and not hasattr(to_fp, "original"):
        builder.create_fp_to_fp = _fp8_rounding(to_fp, tl)
    patch_lang = getattr(interpreter, "_patch_lang", None)
    function = getattr(interpreter, "InterpretedFunction", None)
    scope = getattr(interpreter, "_LangPatchScope", None)
    if None in (patch_lang, function, scope) or hasattr(patch_lang, "original"):
        return
    interpreter._patch_lang = _patch_lang_once(patch_lang, scope, tl)
    function.__call__ = _counted_helper_call(function.__call__)
