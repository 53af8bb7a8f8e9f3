"""Evaluates a spec eagerly in PyTorch, N x N scores and all: the oracle that defines what a spec means."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Mapping

import torch
from torch import Tensor

from attngen.errors import ArgumentError, IndexOutOfRange
from attngen.ir import (FUNCTIONS, Binary, Call, Const, Expr, Load, Param, Reduce, Score, Size, Spec, Unary, Var,
                        ValueType, walk)
from attngen.runtime.operations import BINARY as TORCH_BINARY, FUNCTIONS as TORCH_FUNCTIONS, UNARY as TORCH_UNARY
from attngen.runtime.reductions import reduce_input

HALF_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Env:
    """What an expression reads: index variables, sizes, params and `score` by name, the tensor inputs,
    and the float dtype its arithmetic runs in."""
    values: Mapping[str, Tensor]
    inputs: Mapping[str, Tensor]
    float_dtype: torch.dtype = torch.float32
    device: torch.device | str = "cpu"
    # Float literals and params are float32 numbers, and what is computed from them alone is computed
    # in float32, whatever `float_dtype` is: the kernels hold them and fold them so (analysis.fold), and
    # the float64 truth must mean the same spec (checks.py rejects one that overflows float32 there).
    constant_dtype: torch.dtype = torch.float32


@dataclass(frozen=True)
class PackedRow:
    """One sequence of a packed call, evaluated as a batch of one row: its index `b` among `B` sequences, and
    the call's max_seqlen_q/k, the length of an input dim declared Q_LEN/KV_LEN."""
    b: int
    B: int
    max_seqlen_q: int
    max_seqlen_k: int


def make_env(spec: Spec, *, B: int, H: int, HKV: int, Q_LEN: int, KV_LEN: int, D: int,
             inputs: Mapping[str, Tensor] | None = None, float_dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu", kv_len: Tensor | None = None,
             q_offset: Tensor | None = None, row: PackedRow | None = None) -> Env:
    """The environment of the (B, H, Q_LEN, KV_LEN) grid: each index variable varies along its own axis.
    A cache call (`kv_len`, `q_offset`: (B,) ints) puts query i of row b at position q_offset[b] + i
    (Q_OFFSET, which `causal_bottom_right` reads to find the row; 0 without q_offset) and makes
    KV_LEN row b's kv_len[b]. `row`: the grid (B = 1) is that sequence of a packed call, whose `b` and `B`
    it gives."""
    def axis(n: int, dim: int) -> Tensor:
        return torch.arange(n, device=device).view([n if d == dim else 1 for d in range(4)])

    def per_row(t: Tensor) -> Tensor:
        return t.to(device=device, dtype=torch.int64).view(B, 1, 1, 1)

    h = axis(H, 1)
    q = axis(Q_LEN, 2) if q_offset is None else axis(Q_LEN, 2) + per_row(q_offset)
    values = {"b": axis(B, 0), "h": h, "hkv": h // (H // HKV), "q": q, "k": axis(KV_LEN, 3)}
    sizes = {"B": B, "H": H, "HKV": HKV, "Q_LEN": Q_LEN, "KV_LEN": KV_LEN, "D": D}
    values |= {name: torch.tensor(n, device=device) for name, n in sizes.items()}
    if row is not None:
        values |= {"b": torch.full((1, 1, 1, 1), row.b, device=device), "B": torch.tensor(row.B, device=device)}
    values["Q_OFFSET"] = torch.tensor(0, device=device) if q_offset is None else per_row(q_offset)
    if kv_len is not None:
        values["KV_LEN"] = per_row(kv_len)
    values |= {p.name: _constant(p.type, p.value, float_dtype, device) for p in spec.params}
    return Env(values, dict(inputs or {}), float_dtype, device)


def scale_value(spec: Spec, head_dim: int) -> float:
    """The softmax scale for query/key head dimension `head_dim`; `1/sqrt(D)` unless the spec sets one."""
    if spec.scale is None:
        return 1.0 / math.sqrt(head_dim)
    values = {"D": torch.tensor(head_dim)}
    values |= {p.name: _constant(p.type, p.value, torch.float64, "cpu") for p in spec.params}
    # The module computes it on the host in Python's float64 (softmax_scale(D)), constants included.
    return float(evaluate_expr(spec.scale, Env(values, {}, torch.float64, constant_dtype=torch.float64)))


def evaluate_expr(expr: Expr, env: Env) -> Tensor:
    """The value of an expression, as a tensor broadcastable to (B, H, Q_LEN, KV_LEN)."""
    if env.float_dtype != env.constant_dtype and _constant_float(expr):
        return _in_constant_dtype(expr, env)
    if isinstance(expr, Const):
        return _constant(expr.type, expr.value, env.float_dtype, env.device)
    if isinstance(expr, (Var, Size, Param, Score)):
        name = "score" if isinstance(expr, Score) else expr.name
        if name not in env.values:
            raise ValueError(f"{name!r} cannot be used here")
        return env.values[name]
    if isinstance(expr, Load):
        return _load(expr, env)
    if isinstance(expr, Reduce):
        return _reduce(expr, env)
    if isinstance(expr, Unary):
        x = evaluate_expr(expr.operand, env)
        return TORCH_UNARY[expr.op](x)
    if isinstance(expr, Binary):
        a, b = evaluate_expr(expr.left, env), evaluate_expr(expr.right, env)
        # True division, also of two ints; and a power the IR types float (an int to a negative or
        # non-constant power) is a float power, as in Python (2 ** -1 == 0.5), never torch's int one.
        if expr.op == "div" or (expr.op == "pow" and expr.type == "float"):
            a, b = _to_float(a, env), _to_float(b, env)
        return TORCH_BINARY[expr.op](*_promote(a, b, env=env))
    if isinstance(expr, Call):
        args = [evaluate_expr(a, env) for a in expr.args]
        if expr.fn == "where":
            return torch.where(args[0], *_promote(*args[1:], env=env))
        if FUNCTIONS[expr.fn][1] == "float":
            args = [_to_float(a, env) for a in args]
        return TORCH_FUNCTIONS[expr.fn](*_promote(*args, env=env))
    raise TypeError(f"not an expression: {expr!r}")


def evaluate(spec: Spec, q: Tensor, k: Tensor, v: Tensor, inputs: Mapping[str, Tensor] | None = None, *,
             kv_len: Tensor | None = None, q_offset: Tensor | None = None,
             row: PackedRow | None = None, dropout_p: float = 0.0,
             dropout_mask: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """(O, LSE) of the spec, exactly as DSL.md defines them (a sink and dropout included); differentiable in
    q, k, v and the inputs. A sigmoid spec (`normalize: sigmoid`) has no LSE: (O, None).

    q: (B, H, Q_LEN, D), k: (B, HKV, KV_LEN, D), v: (B, HKV, KV_LEN, DV). The score arithmetic runs in
    q's dtype, or in float32 for half dtypes (as the kernels do); the matmuls run in the inputs' dtype.
    O has q's dtype, LSE that arithmetic dtype.
    A cache call: k and v hold MAX_KV keys of which row b uses the first kv_len[b] ((B,) ints), and
    query i of row b sits at position q_offset[b] + i (by default kv_len - Q_LEN: the newest tokens;
    0 without kv_len); the mask and score see those positions as q and kv_len[b] as KV_LEN, and
    `causal_bottom_right` lets row i see keys k <= i + kv_len[b] - Q_LEN (with the default offset, `causal`).
    `row`: q, k and v (a batch of one) are that sequence of a packed call (evaluate_packed).
    Dropout: `dropout_mask` (B, H, Q_LEN, KV_LEN) bool says which P a call keeps (a kernel call's, from
    its `dropout_mask` method) and `dropout_p` the probability it drew them with; kept P are divided by
    1 - dropout_p, the others are 0, after the softmax or the sigmoid (LSE is unchanged).
    """
    where = dict(kv_len=kv_len, q_offset=q_offset, row=row)
    p, lse = _weights(spec, modified_scores(spec, q, k, v, inputs, **where),
                      sink_logits(spec, q, k, v, inputs, **where))
    p = dropped(p, dropout_p, dropout_mask)
    v = v.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return (p.to(v.dtype) @ v).to(q.dtype), lse


def dropped(p: Tensor, dropout_p: float = 0.0, dropout_mask: Tensor | None = None) -> Tensor:
    """P after dropout (DSL.md): where `dropout_mask` (P's shape, bool) keeps it, P / (1 - dropout_p), else 0;
    P itself without a mask. The scale is computed in float64 and applied in P's dtype."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0 <= dropout_p < 1:
        raise ArgumentError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    if dropout_mask is None:
        if dropout_p:
            raise ArgumentError(f"dropout_mask must be given with dropout_p={dropout_p} (the keep-mask of the call "
                                f"to compare with: its dropout_mask method gives it)")
        return p
    if not (isinstance(dropout_mask, Tensor) and dropout_mask.dtype == torch.bool
            and tuple(dropout_mask.shape) == tuple(p.shape)):
        got = (f"{dropout_mask.dtype} {tuple(dropout_mask.shape)}" if isinstance(dropout_mask, Tensor)
               else type(dropout_mask).__name__)
        raise ArgumentError(f"dropout_mask must be a bool tensor of shape {tuple(p.shape)} (B, H, Q_LEN, KV_LEN), "
                            f"got {got}")
    return torch.where(dropout_mask.to(p.device), p * (1.0 / (1.0 - dropout_p)), 0.0)


def evaluate_packed(spec: Spec, q: Tensor, k: Tensor, v: Tensor, inputs: Mapping[str, Tensor] | None = None, *,
                    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                    max_seqlen_k: int, dropout_p: float = 0.0,
                    dropout_mask: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """(O (TOTAL_Q, H, DV), LSE (H, TOTAL_Q), None for a sigmoid spec) of a packed call, as DSL.md defines it: q (TOTAL_Q, H, D),
    k (TOTAL_K, HKV, D), v (TOTAL_K, HKV, DV); sequence b is tokens cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1
    of q (and by cu_seqlens_k of k and v), evaluated on its own as a batch row: positions from 0, `b` its
    index, Q_LEN and KV_LEN its lengths; inputs are the call's (a dim declared Q_LEN or KV_LEN is
    max_seqlen_q or max_seqlen_k long). Differentiable, as `evaluate`. Dropout as in `evaluate`, the mask
    (B, H, max_seqlen_q, max_seqlen_k): sequence b's is mask[b, :, :Q_LEN, :KV_LEN] of its lengths."""
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    B = len(starts_q) - 1
    H = q.shape[1]
    if dropout_mask is not None and tuple(dropout_mask.shape) != (B, H, max_seqlen_q, max_seqlen_k):
        raise ArgumentError(f"dropout_mask must have shape (B, H, max_seqlen_q, max_seqlen_k) = "
                            f"{(B, H, max_seqlen_q, max_seqlen_k)} in a packed call, got {tuple(dropout_mask.shape)}")
    outs, lses = [], []
    for b in range(B):
        rows = [t[s:e].transpose(0, 1).unsqueeze(0) for t, s, e in
                ((q, starts_q[b], starts_q[b + 1]), (k, starts_k[b], starts_k[b + 1]), (v, starts_k[b], starts_k[b + 1]))]
        mask = None
        if dropout_mask is not None:
            mask = dropout_mask[b:b + 1, :, :starts_q[b + 1] - starts_q[b], :starts_k[b + 1] - starts_k[b]]
        out, lse = evaluate(spec, *rows, inputs, row=PackedRow(b, B, max_seqlen_q, max_seqlen_k), dropout_p=dropout_p,
                            dropout_mask=mask)
        outs.append(out[0].transpose(0, 1))
        if lse is not None:
            lses.append(lse[0])
    return torch.cat(outs), (torch.cat(lses, dim=1) if lses else None)


def probabilities(spec: Spec, q: Tensor, k: Tensor, v: Tensor, inputs: Mapping[str, Tensor] | None = None, *,
                  kv_len: Tensor | None = None, q_offset: Tensor | None = None, row: PackedRow | None = None) -> Tensor:
    """P (B, H, Q_LEN, KV_LEN): the weights `evaluate` multiplies V by, softmax or sigmoid (0 on masked keys)."""
    where = dict(kv_len=kv_len, q_offset=q_offset, row=row)
    return _weights(spec, modified_scores(spec, q, k, v, inputs, **where),
                    sink_logits(spec, q, k, v, inputs, **where))[0]


def modified_scores(spec: Spec, q: Tensor, k: Tensor, v: Tensor, inputs: Mapping[str, Tensor] | None = None, *,
                    kv_len: Tensor | None = None, q_offset: Tensor | None = None,
                    row: PackedRow | None = None) -> Tensor:
    """score' of every (b, h, q, k), -inf where the mask forbids the key (or it lies at or past
    kv_len[b] in a cache call, as `evaluate` says). `row`: q, k and v (a batch of one) are that sequence
    of a packed call (evaluate_packed)."""
    env = _call_env(spec, q, k, v, inputs, kv_len=kv_len, q_offset=q_offset, row=row)
    B, H, Q_LEN, D = q.shape
    HKV, KV_LEN = k.shape[1], k.shape[2]
    shape = (B, H, Q_LEN, KV_LEN)

    k = k.repeat_interleave(H // HKV, dim=1)
    score = (q @ k.transpose(-2, -1)).to(env.float_dtype) * scale_value(spec, D)
    if spec.score is not None:
        score = evaluate_expr(spec.score, replace(env, values={**env.values, "score": score}))
        score = _to_float(score, env)
    score = score.expand(shape)
    if spec.mask is not None:
        allowed = evaluate_expr(spec.mask, env)
        assert allowed.dtype == torch.bool, f"mask evaluated to {allowed.dtype}"
        score = torch.where(allowed.expand(shape), score, -math.inf)
    if kv_len is not None:
        score = torch.where(env.values["k"] < env.values["KV_LEN"], score, -math.inf)
    return score


def sink_logits(spec: Spec, q: Tensor, k: Tensor, v: Tensor, inputs: Mapping[str, Tensor] | None = None, *,
                kv_len: Tensor | None = None, q_offset: Tensor | None = None,
                row: PackedRow | None = None) -> Tensor | None:
    """The sink of every (b, h, q) row, (B, H, Q_LEN) in the score arithmetic's dtype, or None without a
    `sink:` item; positions, sizes and `row` as for `modified_scores`."""
    if spec.sink is None:
        return None
    env = _call_env(spec, q, k, v, inputs, kv_len=kv_len, q_offset=q_offset, row=row)
    B, H, Q_LEN, _ = q.shape
    return _to_float(evaluate_expr(spec.sink, env), env).expand(B, H, Q_LEN, 1)[..., 0]


def _call_env(spec: Spec, q: Tensor, k: Tensor, v: Tensor, inputs: Mapping[str, Tensor] | None, *,
              kv_len: Tensor | None, q_offset: Tensor | None, row: PackedRow | None) -> Env:
    """The environment of a call's (B, H, Q_LEN, KV_LEN) grid, its inputs checked."""
    B, H, Q_LEN, D = _check_qkv(q, k, v)
    HKV, KV_LEN = k.shape[1], k.shape[2]
    float_dtype = torch.float32 if q.dtype in HALF_DTYPES else q.dtype
    sizes = {"B": B, "H": H, "HKV": HKV, "Q_LEN": Q_LEN, "KV_LEN": KV_LEN}
    if row is not None:
        sizes |= {"B": row.B, "Q_LEN": row.max_seqlen_q, "KV_LEN": row.max_seqlen_k}
    inputs = _check_inputs(spec, inputs, sizes)
    if kv_len is not None and q_offset is None:
        q_offset = kv_len.long() - Q_LEN
    return make_env(spec, B=B, H=H, HKV=HKV, Q_LEN=Q_LEN, KV_LEN=KV_LEN, D=D, inputs=inputs,
                    float_dtype=float_dtype, device=q.device, kv_len=kv_len, q_offset=q_offset, row=row)


def _weights(spec: Spec, score: Tensor, sink: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """(P, LSE) of the modified scores (-inf on masked keys): the softmax over each row, or with
    `normalize: sigmoid` sigmoid(score') of each key on its own and no LSE. sigmoid(-inf) = 0, and its
    gradient there, P * (1 - P) = 0, is never NaN: a row with no allowed key has O = 0 and zero gradients."""
    if spec.sigmoid:
        return torch.sigmoid(score), None
    return _softmax(score, sink)


def _softmax(score: Tensor, sink: Tensor | None = None) -> tuple[Tensor, Tensor]:
    # Softmax shifted by a finite, detached row max, with a guarded divide: a row with no allowed key
    # then has exp(-inf) = 0 everywhere, O = 0 and LSE = -inf, and its gradients are 0, never NaN.
    # Detaching the shift is exact: softmax and LSE - shift do not depend on it.
    # A sink (B, H, Q_LEN) is one more key with no value: a column of the softmax that P drops, so a
    # row with no allowed key has O = 0 and LSE = sink. A sink of +inf takes all of its row's weight (P = 0
    # on every key: O = 0, LSE = +inf) and a NaN one makes its row NaN: those rows are computed as rows
    # without a sink (no inf - inf in their values or gradients), then given those values, LSE the sink
    # itself (so the sink gets LSE's gradient: d LSE / d sink is that weight, 1).
    special = None
    if sink is not None:
        sink = sink.to(score.dtype)
        special = ~(sink < math.inf)
        score = torch.cat([score, torch.where(special, -math.inf, sink)[..., None]], dim=-1)
    B, H, Q_LEN, KV_LEN = score.shape
    row_max = score.detach().amax(-1, keepdim=True) if KV_LEN else score.new_zeros(B, H, Q_LEN, 1)
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
    e = torch.exp(score - row_max)
    total = e.sum(-1, keepdim=True)
    nonempty = total > 0
    total = torch.where(nonempty, total, 1.0)
    lse = torch.where(nonempty, row_max + torch.log(total), -math.inf).squeeze(-1)
    p = e / total
    if sink is None:
        return p, lse
    weight = torch.where(sink == math.inf, 0.0, math.nan).to(p.dtype)
    return torch.where(special[..., None], weight[..., None], p[..., :-1]), torch.where(special, sink, lse)


# --- helpers -------------------------------------------------------------------------------------

def _constant_float(expr: Expr) -> bool:
    """Whether `expr` reads literals and params alone and computes in float (or compares floats)."""
    if not all(isinstance(n, (Const, Param, Unary, Binary, Call)) for n in walk(expr)):
        return False
    return any(n.type == "float" for n in walk(expr))


def _in_constant_dtype(expr: Expr, env: Env) -> Tensor:
    """`expr`, one of `_constant_float`, computed in env.constant_dtype (its floats widened after)."""
    names = {n.name for n in walk(expr) if isinstance(n, Param)}
    values = {**env.values, **{n: env.values[n].to(env.constant_dtype) for n in names
                               if env.values[n].is_floating_point()}}
    value = evaluate_expr(expr, replace(env, values=values, float_dtype=env.constant_dtype))
    return value.to(env.float_dtype) if value.is_floating_point() else value


def _constant(type: ValueType, value: bool | int | float, float_dtype: torch.dtype, device) -> Tensor:
    dtype = {"float": float_dtype, "int": torch.int64, "bool": torch.bool}[type]
    return torch.tensor(value, dtype=dtype, device=device)


def _to_float(x: Tensor, env: Env) -> Tensor:
    return x.to(env.float_dtype)


def _promote(*xs: Tensor, env: Env) -> list[Tensor]:
    """Ints mixed with floats become floats of the arithmetic dtype."""
    if any(x.is_floating_point() for x in xs):
        return [_to_float(x, env) for x in xs]
    return list(xs)


# The operators and functions' torch meaning is the runtime's (one table): checked whole against the IR's.
assert TORCH_FUNCTIONS.keys() | {"where"} == FUNCTIONS.keys()


def _load(expr: Load, env: Env) -> Tensor:
    """input[i0, i1, ...] by advanced indexing; indices are checked, since a negative one would wrap."""
    name = expr.input
    if name not in env.inputs:
        raise ArgumentError(f"input {name!r} must be given")
    return _read(name, env.inputs[name], [evaluate_expr(i, env) for i in expr.index], expr.type, env)


def _read(name: str, x: Tensor, index: list[Tensor], type_: ValueType, env: Env) -> Tensor:
    """x (input `name`, or its reduction) at the evaluated `index`, checked, as the load's type."""
    assert len(index) == x.dim(), f"input {name!r} has {x.dim()} dims, indexed with {len(index)}"
    for dim, (i, size) in enumerate(zip(index, x.shape)):
        assert not i.is_floating_point(), f"float index into {name!r}"
        if i.numel() and (i.min() < 0 or i.max() >= size):
            raise IndexOutOfRange(f"input {name!r} indexed out of range in dim {dim}: "
                                f"got indices in [{int(i.min())}, {int(i.max())}], size {size}")
    value = x[tuple(index)] if index else x
    if type_ == "float":
        return _to_float(value, env)
    return value.long() if type_ == "int" else value.bool()


def _reduce(expr: Reduce, env: Env) -> Tensor:
    """op(input[..., :, ...]): the input reduced over its ':' dims (floats in the reference's precision, ints and
    bools exactly), then read at the other indices as a load is (which may read other inputs: `prefix[b]`)."""
    name = expr.input
    if name not in env.inputs:
        raise ArgumentError(f"input {name!r} must be given")
    x = env.inputs[name]
    if x.is_floating_point():
        x = _to_float(x, env)
    elif x.dtype != torch.bool:
        x = x.long()
    try:
        reduced = reduce_input(x, expr.op, expr.reduced_dims, name)
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    if expr.op == "mean" and not reduced.dtype.is_floating_point:
        reduced = _to_float(reduced, env)
    kept = [evaluate_expr(i, env) for i in expr.index if i is not None]
    return _read(name, reduced, kept, expr.type, env)


def _check_qkv(q: Tensor, k: Tensor, v: Tensor) -> tuple[int, int, int, int]:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ArgumentError(f"{name} must have 4 dims (B, heads, length, head_dim), got shape {tuple(t.shape)}")
        if t.dtype != q.dtype or t.device != q.device:
            raise ArgumentError(f"{name} must have q's dtype and device ({q.dtype}, {q.device}), "
                                f"got {t.dtype}, {t.device}")
    B, H, _, D = q.shape
    HKV, KV_LEN = k.shape[1], k.shape[2]
    if k.shape[0] != B or k.shape[3] != D:
        raise ArgumentError(f"k must have shape (B={B}, HKV, KV_LEN, D={D}), got {tuple(k.shape)}")
    if v.shape[:3] != k.shape[:3]:
        raise ArgumentError(f"v must have shape ({B}, {HKV}, {KV_LEN}, DV) like k, got {tuple(v.shape)}")
    if HKV == 0 or H % HKV:
        raise ArgumentError(f"the number of query heads H={H} must be a multiple of the kv heads HKV={HKV}")
    return B, H, q.shape[2], D


def _check_inputs(spec: Spec, inputs: Mapping[str, Tensor] | None, sizes: dict[str, int]) -> dict[str, Tensor]:
    inputs = dict(inputs or {})
    declared = [i.name for i in spec.inputs]
    for name in inputs.keys() - set(declared):
        raise ArgumentError(f"{name!r} must be one of the spec's inputs {declared}, got an unknown input")
    for decl in spec.inputs:
        if decl.name not in inputs:
            raise ArgumentError(f"input {decl.name!r} must be given")
        x = inputs[decl.name]
        expected = [sizes.get(d, d) for d in decl.dims]
        if x.dim() != len(expected) or any(e != "*" and e != n for e, n in zip(expected, x.shape)):
            dims = ", ".join(f"{d}={sizes[d]}" if d in sizes else str(d) for d in decl.dims)
            raise ArgumentError(f"input {decl.name!r} must have shape [{dims}], got {tuple(x.shape)}")
        kind = "bool" if x.dtype == torch.bool else "float" if x.is_floating_point() else "int"
        if kind != decl.value_type:
            raise ArgumentError(f"input {decl.name!r} must be a {decl.value_type} tensor ({decl.dtype}), "
                                f"got {x.dtype}")
    return inputs
