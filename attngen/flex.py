"""Translates a spec into FlexAttention's mask_mod and score_mod, to cross-check and time attngen against Flex.

    flex = attngen.to_flex("specs/alibi_causal.attn")     # a path, spec text or Spec; params= as attngen.build
    mask_mod, score_mod = flex.mods(q, k, slopes=slopes)  # None where the spec has no mask / no score
    block_mask = flex.block_mask(q, k, slopes=slopes)     # create_block_mask of mask_mod; None without a mask
    out, lse = flex(q, k, v, slopes=slopes, return_lse=True, kernel=torch.compile(flex_attention))
    out = torch.compile(flex_attention)(q, k, v, **flex.kwargs(q, k, slopes=slopes))   # made once, called often

The mods mean what `attngen.reference` means, node for node: they apply the reference's own operator
and function tables to tensors of the dtypes the reference computes in (float inputs, params and
literals in the score's float dtype; `//` and `%` with Python's floor semantics; ints promoted to
float where mixed). Ints are exact as in attngen's kernels: each is computed in int32 where the
interval analysis (`attngen.intervals`) proves its range fits, in int64 otherwise, and lengths at
which some int would overflow even int64 are refused, as the kernels refuse them.

What a Flex user should know when comparing (torch 2.13; checked in tests/test_flex.py):

- Scale: Flex's score is `scale * dot(q, k)` with `scale=` as given; the call passes the spec's
  scale for D (`attngen.reference.scale_value`), `1/sqrt(D)` unless the spec sets one: the same score.
- GQA: Flex's `enable_gqa=True` maps query head h to kv head `h // (H // HKV)`, as attngen does;
  `b`, `h` in the mods are query heads, and `hkv` is derived from `h` as in the language.
- Empty rows: a query row with no allowed key gets O = 0 and LSE = -inf in both (Flex's eager path
  takes a safe softmax and sets such rows' LSE to -inf; its kernels leave them at 0 and -inf).
- LSE: both return the natural log (Flex computes in base 2 and converts back); float32 for half
  inputs, and float64 for float64 inputs in Flex's eager path.
- Arithmetic precision: Flex computes the score as `q.float() @ k.float()`; attngen's reference
  multiplies in the inputs' dtype. Equal in float32 and float64, within rounding in f16 and bf16.
- Indices: an input indexed outside its extent is an error in the reference and reads 0 in attngen's
  kernels; in Flex a negative index wraps and a too-large one fails or reads garbage. Keep them in range.
- A BlockMask is built from the inputs' values when it is made: rebuild it when the mask's inputs
  change (as with attngen's `tile_tables`). `__call__` builds one itself when none is passed.
- Positions: `q` and `k` are the row indices of the call (the training call of DSL.md).
- Sinks: a spec with a `sink:` item is refused: Flex's mods change the scores of keys, and a sink is a
  softmax term with no key.
- Dropout is an argument of attngen's calls (dropout_p), not of the spec; flex_attention has none, so a
  call here with dropout_p above 0 is refused.
- Sigmoid attention: a spec with `normalize: sigmoid` is refused: Flex always takes the softmax of each
  row's modified scores (no mod replaces it), and no score_mod turns a softmax into per-key sigmoids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch
from torch import Tensor

from attngen import intervals, ir
from attngen.analysis import Analysis, analyze
from attngen.api import SpecLike, load_spec, with_params
from attngen.errors import ArgumentError
from attngen.frontend.printer import expr_to_source
from attngen.reference import HALF_DTYPES, Env, _check_inputs, _check_qkv, _promote, scale_value
# The reference's own tables: the mods apply the very operations that define what each node means.
from attngen.runtime.operations import BINARY as TORCH_BINARY, FUNCTIONS as TORCH_FUNCTIONS
from attngen.runtime.reductions import reduced_inputs

__all__ = ["FlexVariant", "to_flex"]

# Options of FlexVariant's call, passed by keyword beside the inputs: an input of one of these
# names could not be passed, so such a spec is refused by to_flex.
CALL_OPTIONS = ("block_mask", "return_lse", "kernel")

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
# A translated expression: the index tensors by name ("b", "h", "hkv", "q", "k", "score") -> its value.
Value = Callable[[dict], Tensor]


def to_flex(spec: SpecLike, *, params: dict | None = None) -> FlexVariant:
    """The spec (a path, spec text or Spec; `params` override its params, as in `attngen.build`) as
    FlexAttention mods, a BlockMask and a call; see the module's documentation."""
    parsed = with_params(load_spec(spec)[0], params)
    if parsed.sink is not None:
        raise ArgumentError(f"spec {parsed.name!r} must have no 'sink:' to run as FlexAttention, got "
                            f"'sink: {expr_to_source(parsed.sink)}': Flex's score_mod and mask_mod change the "
                            f"scores of keys, and a sink is a softmax term with no key and no value; run the "
                            f"spec with attngen.build")
    if parsed.sigmoid:
        raise ArgumentError(f"spec {parsed.name!r} must be softmax attention to run as FlexAttention, got "
                            f"'normalize: sigmoid': Flex always takes the softmax of each row's modified scores, "
                            f"and no score_mod or mask_mod turns it into a sigmoid of each key; run the spec with "
                            f"attngen.build")
    for decl in parsed.inputs:
        if decl.name in CALL_OPTIONS:
            raise ArgumentError(f"input {decl.name!r} has the name of an option of the Flex call "
                                f"({', '.join(CALL_OPTIONS)}), so it could not be passed; rename it to use to_flex")
    return FlexVariant(parsed)


@dataclass(frozen=True)
class FlexVariant:
    """A spec as FlexAttention mods. Sizes come from each call's q (B, H, Q_LEN, D) and k (B, HKV, KV_LEN, D)."""
    spec: ir.Spec
    _facts: Analysis = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # The int ranges and length limit attngen's kernels take their widths from: the same here.
        object.__setattr__(self, "_facts", analyze(self.spec))

    @property
    def max_length(self) -> int:
        """The longest Q_LEN and KV_LEN at which every int of the spec fits int64 (as attngen's modules)."""
        return self._facts.length_limit

    @property
    def mask_reads_batch(self) -> bool:
        """Whether the mask depends on the batch index (else its BlockMask has batch size None: broadcast)."""
        return ir.uses(self.spec.mask, ir.Var, "b")

    @property
    def mask_reads_heads(self) -> bool:
        """Whether the mask depends on the head index `h` or `hkv` (else its BlockMask has H None)."""
        return ir.uses(self.spec.mask, ir.Var, "h") or ir.uses(self.spec.mask, ir.Var, "hkv")

    def scale(self, head_dim: int) -> float:
        """The softmax scale Flex must be given for query/key head dim `head_dim`."""
        return scale_value(self.spec, head_dim)

    def mods(self, q: Tensor, k: Tensor, /, **inputs: Tensor) -> tuple[MaskMod | None, ScoreMod | None]:
        """(mask_mod, score_mod) for calls with these q and k sizes and inputs; each None where the spec
        has no mask or no score. They read the inputs' tensors (captured, as Flex's buffers) and their
        values when called: a BlockMask made from mask_mod keeps the values it was made with."""
        sizes = self._sizes(q, k)
        inputs = _check_inputs(self.spec, inputs, sizes)
        float_dtype = torch.float32 if q.dtype in HALF_DTYPES else q.dtype
        # A reduction (sum(x[b, :])) is computed here, once, and captured as a buffer of its own, as the
        # kernels read it: the mods translate the spec the kernels run (Analysis.spec).
        reductions = tuple((r.name, r.op, r.source, r.dims) for r in self._facts.reductions)
        try:
            inputs = {**inputs, **reduced_inputs(reductions, inputs, float_dtype)}
        except ValueError as e:
            raise ArgumentError(str(e)) from None
        spec = self._facts.spec
        translate = _Translator(spec, self._facts.ranges, inputs, sizes, float_dtype, q.device)
        group = sizes["H"] // sizes["HKV"]
        mask_mod = score_mod = None
        if spec.mask is not None:
            mask = translate(spec.mask)

            def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
                return mask(_indices(b, h, q_idx, kv_idx, group))
            mask_mod.__name__ = mask_mod.__qualname__ = f"{self.spec.name}_mask_mod"
        if spec.score is not None:
            score = translate(spec.score)

            def score_mod(s: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
                env = _indices(b, h, q_idx, kv_idx, group)
                env["score"] = s
                # An int or constant score is the float score' of the reference.
                return score(env).to(s.dtype)
            score_mod.__name__ = score_mod.__qualname__ = f"{self.spec.name}_score_mod"
        return mask_mod, score_mod

    def block_mask(self, q: Tensor, k: Tensor, /, **inputs: Tensor):
        """FlexAttention's BlockMask of the spec's mask for these sizes and inputs (B and H None, so
        broadcast, where the mask does not read them), or None when the spec has no mask."""
        mask_mod, _ = self.mods(q, k, **inputs)
        return self._block_mask(mask_mod, q, k)

    def kwargs(self, q: Tensor, k: Tensor, /, *, block_mask=None, **inputs: Tensor) -> dict:
        """The keyword arguments of flex_attention(q, k, v, ...) that run the spec for these sizes and
        inputs: score_mod, block_mask (`block_mask`, else made here when the spec has a mask), scale and
        enable_gqa. Made once, they serve any number of calls while the inputs' values stay the same."""
        mask_mod, score_mod = self.mods(q, k, **inputs)
        if block_mask is None:
            block_mask = self._block_mask(mask_mod, q, k)
        return dict(score_mod=score_mod, block_mask=block_mask, scale=self.scale(q.shape[-1]),
                    enable_gqa=q.shape[1] != k.shape[1])

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, /, *, block_mask=None, return_lse: bool = False,
                 kernel: Callable | None = None, dropout_p: float = 0.0, **inputs: Tensor):
        """FlexAttention running the spec: `out`, or `(out, lse)` with return_lse (natural log, -inf on
        rows with no allowed key). `kernel` is flex_attention (the default, eager) or a compiled one,
        e.g. torch.compile(flex_attention); `block_mask` one made by `self.block_mask` for these sizes and
        input values (made here when None and the spec has a mask). `dropout_p` must be 0: flex_attention
        has no dropout (attngen's kernels do)."""
        from torch.nn.attention.flex_attention import flex_attention

        if dropout_p != 0:
            raise ArgumentError(f"dropout_p must be 0 for FlexAttention, which has no dropout argument, got "
                                f"{dropout_p!r}: run the spec with attngen.build for dropout")
        _check_qkv(q, k, v)
        kwargs = self.kwargs(q, k, block_mask=block_mask, **inputs)
        if return_lse:
            try:  # torch >= 2.9 asks for the LSE this way (return_lse is deprecated there)
                from torch.nn.attention.flex_attention import AuxRequest
                kwargs["return_aux"] = AuxRequest(lse=True)
            except ImportError:
                kwargs["return_lse"] = True
        result = (kernel or flex_attention)(q, k, v, **kwargs)
        if not return_lse:
            return result
        out, aux = result
        return out, getattr(aux, "lse", aux)

    # --- helpers ---------------------------------------------------------------------------------

    def _sizes(self, q: Tensor, k: Tensor) -> dict[str, int]:
        _check_qkv(q, k, k)  # q and k as attngen's call checks them (v is not needed here)
        B, H, Q_LEN, D = q.shape
        HKV, KV_LEN = k.shape[1], k.shape[2]
        if max(Q_LEN, KV_LEN) > self.max_length:
            culprit = self._facts.length_culprit
            why = (f"beyond it '{_source(culprit)}' overflows int64" if culprit is not None
                   else "positions are int32 in the kernels")
            raise ArgumentError(f"Q_LEN and KV_LEN must be at most {self.max_length} ({why}), "
                                f"got {Q_LEN} and {KV_LEN}")
        # Flex's q_idx is the query's row: query 0 sits at position 0 (Q_OFFSET).
        return {"B": B, "H": H, "HKV": HKV, "Q_LEN": Q_LEN, "KV_LEN": KV_LEN, "D": D, "Q_OFFSET": 0}

    def _block_mask(self, mask_mod: MaskMod | None, q: Tensor, k: Tensor):
        if mask_mod is None:
            return None
        from torch.nn.attention.flex_attention import create_block_mask

        B, H, Q_LEN, _ = q.shape
        return create_block_mask(mask_mod, B if self.mask_reads_batch else None,
                                 H if self.mask_reads_heads else None, Q_LEN, k.shape[2], device=q.device)


def _source(expr: ir.Expr) -> str:
    from attngen.frontend.printer import expr_to_source
    return expr_to_source(expr)


def _indices(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor, group: int) -> dict:
    """The index variables as int32 (Flex passes int32 when compiled, int64 in eager; every index fits)."""
    h = h.to(torch.int32)
    return {"b": b.to(torch.int32), "h": h, "hkv": torch.div(h, group, rounding_mode="floor"),
            "q": q_idx.to(torch.int32), "k": kv_idx.to(torch.int32)}


class _Translator:
    """IR expression -> a closure computing it on Flex's index tensors, as the reference computes it."""

    def __init__(self, spec: ir.Spec, ranges: intervals.Ranges, inputs: Mapping[str, Tensor],
                 sizes: dict[str, int], float_dtype: torch.dtype, device: torch.device):
        self.params = spec.param_values
        self.ranges = ranges
        self.inputs = inputs
        self.sizes = sizes
        self.float_dtype = float_dtype
        self.device = device
        # What reference._promote reads: ints mixed with floats become floats of this dtype.
        self.env = Env({}, {}, float_dtype, device)

    def __call__(self, e: ir.Expr) -> Value:
        if isinstance(e, ir.Const):
            return self._constant(e, e.value)
        if isinstance(e, ir.Param):
            return self._constant(e, self.params[e.name])
        if isinstance(e, ir.Size):
            return self._constant(e, self.sizes[e.name])
        if isinstance(e, (ir.Var, ir.Score)):
            name = "score" if isinstance(e, ir.Score) else e.name
            return lambda env: env[name]
        if isinstance(e, ir.Load):
            return self._load(e)
        if isinstance(e, ir.Unary):
            return self._unary(e)
        if isinstance(e, ir.Binary):
            return self._binary(e)
        if isinstance(e, ir.Call):
            return self._call(e)
        raise TypeError(f"not an expression: {e!r}")

    def _dtype(self, e: ir.Expr, type: ir.ValueType) -> torch.dtype:
        if type == "float":
            return self.float_dtype
        if type == "bool":
            return torch.bool
        return torch.int64 if self.ranges.wide(e) else torch.int32

    def _constant(self, e: ir.Expr, value) -> Value:
        dtype, device = self._dtype(e, e.type), self.device
        # Made inside the mod (a constant of its graph), not captured: a captured tensor would be a
        # buffer Flex's kernel loads from memory.
        return lambda env: torch.full((), value, dtype=dtype, device=device)

    def _load(self, e: ir.Load) -> Value:
        x, dtype = self.inputs[e.input], self._dtype(e, e.type)
        index = [self(i) for i in e.index]
        if not index:
            return lambda env: x.to(dtype)
        return lambda env: x[tuple([i(env) for i in index])].to(dtype)

    def _widen(self, e: ir.Expr) -> Callable[[list[Tensor]], list[Tensor]]:
        """Casts int operands up to int64 where this node's value needs it (its range does not fit int32)."""
        if not self.ranges.wide(e):
            return lambda xs: xs
        return lambda xs: [x.to(torch.int64) if not (x.is_floating_point() or x.dtype == torch.bool) else x
                           for x in xs]

    def _unary(self, e: ir.Unary) -> Value:
        operand, widen = self(e.operand), self._widen(e)
        if e.op == "not":
            return lambda env: torch.logical_not(operand(env))
        if e.op == "invert":
            return lambda env: torch.bitwise_not(widen([operand(env)])[0])
        return lambda env: torch.neg(widen([operand(env)])[0])

    def _binary(self, e: ir.Binary) -> Value:
        left, right, widen, env_ = self(e.left), self(e.right), self._widen(e), self.env
        op, fd = TORCH_BINARY[e.op], self.float_dtype
        if e.op == "div" or (e.op == "pow" and e.type == "float"):
            # True division, also of two ints; and a power the IR types float (an int to a negative or
            # non-constant power) is a float power, as the reference takes them.
            return lambda env: op(left(env).to(fd), right(env).to(fd))
        exponent = self.ranges.value(e.right) if e.op == "pow" else None
        if exponent is not None and e.type == "int" and exponent.lo == exponent.hi >= 0:
            # An int to a constant power, given as a Python int: Inductor has no pointwise int pow of two
            # tensors, and expands this one into products. Exact in the width the range asks for.
            n = int(exponent.lo)
            return lambda env: torch.pow(widen([left(env)])[0], n)
        if e.op in ir.SHIFT_OPS:
            def shift(env):
                x, n = widen([left(env), right(env)])
                # As in the kernels: an int32 shifted by 32 or more is undefined in generated code, and 31
                # gives Python's value wherever the result fits int32 (the sign for `>>`, 0 << n for `<<`).
                return op(x, torch.clamp(n, max=31) if x.dtype == torch.int32 else n)
            return shift
        return lambda env: op(*widen(_promote(left(env), right(env), env=env_)))

    def _call(self, e: ir.Call) -> Value:
        args, widen, env_, fd = [self(a) for a in e.args], self._widen(e), self.env, self.float_dtype
        if e.fn == "where":
            cond, a, b = args
            return lambda env: torch.where(cond(env), *widen(_promote(a(env), b(env), env=env_)))
        fn = TORCH_FUNCTIONS[e.fn]
        if ir.FUNCTIONS[e.fn][1] == "float":
            return lambda env: fn(*_promote(*[a(env).to(fd) for a in args], env=env_))
        return lambda env: fn(*widen(_promote(*[a(env) for a in args], env=env_)))
