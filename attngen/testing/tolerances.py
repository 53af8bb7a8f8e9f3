"""Test helpers for attngen and its users: check a kernel against the float64 reference, tolerances from data.

The rule (DESIGN.md, "Testing"): a kernel's error against the reference evaluated in float64 may be at
most a small multiple of the error that the same reference makes in the kernel's own precision, plus a
rounding floor. It is written once, here:

    max |actual - truth| <= factor * max |low_precision - truth| + floor

The floor is a few ulps of the result's scale and of the sums the kernel forms, plus, for gradients
that go through dS, the exact effect of the kernel's own output error on them (the backward reads
delta = rowsum(dO * O) from the rounded output, as FlashAttention's does: `output_error_effect`).
Kernel tests call `check_against_reference`; the pieces it is built from are public too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import Tensor

from attngen.runtime import shared
from attngen.ir import Load, Reduce, Spec, walk
from attngen.reference import (PackedRow, dropped, evaluate, evaluate_expr, evaluate_packed, make_env,
                               modified_scores, probabilities, scale_value, sink_logits)

__all__ = ["DEFAULT_FACTOR", "FLOOR_ULPS", "FP32_EPS", "ReferenceRun", "assert_matches_reference",
           "check_against_reference", "check_fp8", "default_floor", "dequantized", "fp8_bound", "output_error_effect",
           "random_inputs", "random_qkv", "reference_error", "summation_scales", "TORCH_DTYPES"]


# --- Tolerances ----------------------------------------------------------------------------------

# The kernel may be a few times less accurate than the eager reference in the same precision: it sums
# in another order (tiles, online softmax rescaling, exp2 with folded log2(e)) and rounds P and dS to the
# input dtype before its dots. FlashAttention's own tests allow 2x; 3x leaves room for the backward,
# whose dq/dk/dv pass through one more rounded product, without hiding a real bug (those are O(1) off).
DEFAULT_FACTOR = 3.0

# The floor covers the reference run being exact by luck (outputs that are representable, gradients
# that are sums of few terms) while the kernel, rounding in another order, is off by its last roundings:
# a few units in the last place of the result's dtype, relative to the tensor's largest entry.
# That is about 5e-7 x max|truth| in float32, 4e-3 x in float16 and 3e-2 x in bfloat16.
FLOOR_ULPS = 4.0


def default_floor(truth: Tensor, dtype: torch.dtype) -> float:
    """FLOOR_ULPS units in the last place of `dtype`, at the scale of the largest finite entry of `truth`."""
    finite = truth[torch.isfinite(truth)]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    return FLOOR_ULPS * torch.finfo(dtype).eps * scale


def assert_matches_reference(name: str, actual: Tensor, truth: Tensor, low_precision: Tensor, *,
                             factor: float = DEFAULT_FACTOR, floor: float | None = None) -> None:
    """Assert `actual` is as close to `truth` (float64) as the rule allows, given the reference's own
    error `low_precision - truth` in the kernel's precision.

    Non-finite entries of `truth` (LSE = -inf on rows with no allowed key) must be reproduced exactly,
    and NaN anywhere in `actual` fails. `floor` defaults to `default_floor(truth, actual.dtype)`.
    """
    __tracebackhide__ = True
    if tuple(actual.shape) != tuple(truth.shape):
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} does not match "
                             f"the reference's {tuple(truth.shape)}")
    if floor is None:
        floor = default_floor(truth, actual.dtype)
    a, t, lo = (x.detach().to("cpu", torch.float64) for x in (actual, truth, low_precision))

    nan = torch.isnan(a)
    if nan.any():
        raise AssertionError(f"{name}: {int(nan.sum())} NaN value(s), the first at index {_first(nan)}")
    finite = torch.isfinite(t)
    wrong_inf = (finite != torch.isfinite(a)) | (~finite & (a != t))
    if wrong_inf.any():
        i = _first(wrong_inf)
        raise AssertionError(f"{name}: {int(wrong_inf.sum())} value(s) differ from the reference in being "
                             f"infinite, the first at index {i}: got {a[i].item()}, expected {t[i].item()}")

    # Where the low-precision run itself overflowed, it says nothing about the expected error.
    reference_ok = finite & torch.isfinite(lo)
    reference_error = float((lo - t)[reference_ok].abs().max()) if reference_ok.any() else 0.0
    bound = factor * reference_error + floor
    error = torch.where(finite, (a - t).abs(), 0.0)
    if error.numel() and float(error.max()) > bound:
        i = _first(error == error.max())
        raise AssertionError(
            f"{name}: max error {float(error.max()):.4g} exceeds the allowed {bound:.4g} "
            f"(= {factor} x reference error {reference_error:.4g} in low precision + floor {floor:.4g}); "
            f"worst at index {i}: got {a[i].item():.6g}, expected {t[i].item():.6g}")


def _first(where: Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in where.nonzero()[0])


# --- The reference in two precisions ---------------------------------------------------------------

@dataclass(frozen=True)
class ReferenceRun:
    """The reference's outputs by name: "out", "lse" (not of a sigmoid spec, which has none), and with gradients
    "dq", "dk", "dv" and "d_NAME" for each learnable input; `truth` in float64, `low_precision` in the kernel's
    dtype."""
    truth: dict[str, Tensor]
    low_precision: dict[str, Tensor]

    def error(self, name: str) -> float:
        """max |low_precision - truth| over the entries where both are finite."""
        t, lo = self.truth[name].double(), self.low_precision[name].double()
        ok = torch.isfinite(t) & torch.isfinite(lo)
        return float((lo - t)[ok].abs().max()) if ok.any() else 0.0


def reference_error(spec: Spec, q: Tensor, k: Tensor, v: Tensor, inputs: Mapping[str, Tensor] | None = None,
                    dtype: torch.dtype | None = None, *, dout: Tensor | None = None,
                    dlse: Tensor | None = None, cache: Mapping[str, Tensor] | None = None,
                    packed: Mapping | None = None, dropout: Mapping | None = None) -> ReferenceRun:
    """Run the reference in float64 (the truth) and in `dtype` (default q's dtype), forward, and
    backward too when the upstream gradient `dout` is given (`dlse` optional, zero where LSE is -inf; a sigmoid
    spec has no LSE, and no "lse" among the outputs).

    q, k and v are cast to each precision. Tensor inputs enter the low-precision run as given, since the
    kernel reads them so, and the truth with float inputs in float64; learnable ones get gradients.
    `cache`: a cache call's kv_len and q_offset (reference.evaluate's), if any; `packed`: a packed call's
    cu_seqlens_q/k and max_seqlen_q/k (reference.evaluate_packed's), if any; `dropout`: a call's dropout_p and
    dropout_mask (reference.evaluate's), if any.
    """
    dtype = dtype or q.dtype
    cache = dict(cache or {})
    inputs = dict(inputs or {})
    learnable = [i.name for i in spec.learnable_inputs]
    runs = []
    for run_dtype in (torch.float64, dtype):
        grad = dout is not None
        qkv = [x.detach().to(run_dtype).requires_grad_(grad) for x in (q, k, v)]
        run_inputs = {}
        for name, x in inputs.items():
            x = x.detach()
            if x.is_floating_point() and run_dtype == torch.float64:
                x = x.double()
            run_inputs[name] = x.clone().requires_grad_(grad and name in learnable)
        if packed:
            out, lse = evaluate_packed(spec, *qkv, run_inputs, **packed, **dict(dropout or {}))
        else:
            out, lse = evaluate(spec, *qkv, run_inputs, **cache, **dict(dropout or {}))
        result = {"out": out.detach()} | ({"lse": lse.detach()} if lse is not None else {})
        if grad:
            outputs, grads_out = [out], [dout.to(out.dtype)]
            if dlse is not None and lse is not None:
                outputs.append(lse)
                grads_out.append(torch.where(torch.isfinite(lse), dlse.to(lse.dtype), 0.0))
            leaves = qkv + [run_inputs[name] for name in learnable]
            grads = _grads(outputs, leaves, grads_out)
            result |= dict(zip(["dq", "dk", "dv"] + [f"d_{name}" for name in learnable], grads))
        runs.append(result)
    return ReferenceRun(*runs)


# --- Random data ---------------------------------------------------------------------------------

# How q, k, v lie in memory: dense (B, heads, length, D) tensors, or the transpose(1, 2) of dense
# (B, length, heads, D) ones, as transformers passes them (kernels read them by their strides).
LAYOUTS = ("dense", "transposed")


def random_qkv(B: int, H: int, HKV: int, Q_LEN: int, KV_LEN: int, D: int, DV: int, dtype: torch.dtype,
               device: torch.device | str = "cpu", seed: int = 0,
               layout: str = "dense") -> tuple[Tensor, Tensor, Tensor]:
    """Standard normal q (B, H, Q_LEN, D), k (B, HKV, KV_LEN, D), v (B, HKV, KV_LEN, DV); drawn on the CPU in
    float32 so a seed gives the same values on every device, dtype and layout (one of LAYOUTS)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, H, Q_LEN, D), (B, HKV, KV_LEN, D), (B, HKV, KV_LEN, DV)]
    dense = [torch.randn(s, generator=g).to(device=device, dtype=dtype) for s in shapes]
    if layout == "transposed":
        return tuple(x.transpose(1, 2).contiguous().transpose(1, 2) for x in dense)
    return tuple(dense)


def random_inputs(spec: Spec, B: int, H: int, HKV: int, Q_LEN: int, KV_LEN: int, *,
                  device: torch.device | str = "cpu", seed: int = 0,
                  query_positions: int | None = None) -> dict[str, Tensor]:
    """Plausible values for every declared tensor input, as a user would pass them.

    Position-indexed ints (dims with Q_LEN or KV_LEN) are non-decreasing document ids; other
    ints lie in [0, KV_LEN] (lengths, prefixes); floats are N(0, 0.5); bools are fair coins.
    A `*` dim is sized to the largest index the spec uses there on this grid, whose queries sit at
    positions 0 .. query_positions - 1 (a cache call's q_offset + Q_LEN at most; default Q_LEN).
    """
    g = torch.Generator().manual_seed(seed)
    sizes = {"B": B, "H": H, "HKV": HKV, "Q_LEN": Q_LEN, "KV_LEN": KV_LEN}
    grid = {**sizes, "Q_LEN": max(Q_LEN, query_positions or 0)}
    result: dict[str, Tensor] = {}
    for decl in spec.inputs:
        shape = [sizes.get(d, d) if d != "*" else _extent(spec, decl.name, i, grid) for i, d in enumerate(decl.dims)]
        if decl.dtype in ("i32", "i64"):
            if any(d in ("Q_LEN", "KV_LEN") for d in decl.dims):
                x = torch.randint(0, 4, shape, generator=g).sort(dim=-1).values
            else:
                x = torch.randint(0, KV_LEN + 1, shape, generator=g)
        elif decl.dtype == "bool":
            x = torch.rand(shape, generator=g) < 0.5
        else:
            x = 0.5 * torch.randn(shape, generator=g)
        result[decl.name] = x.to(device=device, dtype=TORCH_DTYPES[decl.dtype])
    return result


# The torch dtype of each DSL dtype (ir.DTYPES), as generated modules check inputs against it.
TORCH_DTYPES = shared._INPUT_DTYPES


def _extent(spec: Spec, name: str, dim: int, sizes: dict[str, int]) -> int:
    """One more than the largest index the spec's loads of `name` use in `dim` on this grid (5 where a
    reduction runs over it)."""
    env = make_env(spec, D=16, **sizes)
    largest = 0
    for expr in (spec.mask, spec.score, spec.sink):
        for node in walk(expr) if expr is not None else ():
            if isinstance(node, (Load, Reduce)) and node.input == name:
                index = node.index[dim]
                # A dim a reduction runs over (':') has a few elements to reduce.
                largest = max(largest, 4 if index is None else int(evaluate_expr(index, env).max()))
    return largest + 1


FP32_EPS = torch.finfo(torch.float32).eps


def summation_scales(spec: Spec, q: Tensor, k: Tensor, v: Tensor, inputs: Mapping[str, Tensor] | None = None,
                     *, dout: Tensor | None = None, dlse: Tensor | None = None,
                     cache: Mapping[str, Tensor] | None = None, row: PackedRow | None = None,
                     dropout: Mapping | None = None) -> dict[str, float]:
    """For out, dq, dk and dv: the largest sum of absolute terms the kernel adds up in fp32 for one entry.

    Rounding in a sum is proportional to the sum of the absolute values of its terms, not to the
    result: the backward forms dS = P * (dP - delta + dLSE) from dP and delta, which cancel (with a
    single key they cancel exactly), so dq and dk can be tiny while their rounding is not (a sigmoid
    spec's dS = P * (1 - P) * dP has no row term). The
    floor of the tolerance adds FLOOR_ULPS fp32 ulps of these scales (the kernels accumulate in
    fp32 whatever their input dtype). `row`: q, k and v are that sequence of a packed call; `dropout` a
    call's dropout_p and dropout_mask (for these q, k and v): the kept P, scaled, are what out and dV sum.

    Each term's P is weighted by 1 + (|score'| + |LSE|) / (2 * FLOOR_ULPS): the kernels form P as
    exp2(score' * log2(e) - m) in fp32, m being the running max (forward) or the saved LSE (backward), both
    rounded at their own magnitude, so P itself is off by up to about 2**-24 * (|score'| + |LSE|) relative,
    which is many ulps where scores are large (scores near 40 put P 3.7e-6 off; a dropout call's few kept
    terms of dV then show it). A sigmoid spec's P = 1 / (1 + exp2(-score' * log2(e))) has no LSE: its
    weight is 1 + |score'| / (2 * FLOOR_ULPS), and dS's factor 1 - P is the unweighted one (at most 1).
    """
    with torch.no_grad():
        qd, kd, vd = (x.detach().to("cpu", torch.float64) for x in (q, k, v))
        ins = {n: (x.detach().cpu().double() if x.is_floating_point() else x.detach().cpu())
               for n, x in (inputs or {}).items()}
        group = q.shape[1] // k.shape[1]
        cached = {name: t.detach().cpu() for name, t in (cache or {}).items()}
        plain = probabilities(spec, qd, kd, vd, ins, **cached, row=row)
        score = modified_scores(spec, qd, kd, vd, ins, **cached, row=row)
        lse = evaluate(spec, qd, kd, vd, ins, **cached, row=row)[1]  # None for a sigmoid spec: no LSE
        magnitude = torch.where(plain > 0, score.abs() + (lse.abs().unsqueeze(-1) if lse is not None else 0.0), 0.0)
        p = plain * (1.0 + magnitude / (2 * FLOOR_ULPS))
        kept = dropped(p, **dict(dropout or {}))
        k_abs, v_abs = (x.repeat_interleave(group, dim=1).abs() for x in (kd, vd))
        out_terms = kept @ v_abs
        scales = {"out": out_terms}
        if dout is not None:
            do = dout.detach().to("cpu", torch.float64).abs()
            dl = dlse.detach().to("cpu", torch.float64).abs().unsqueeze(-1) if dlse is not None else 0.0
            # dP reaches dS through the kept P only, scaled as they are: p * dropped(dP) / p where p > 0.
            dp = dropped(do @ v_abs.transpose(-2, -1), **dict(dropout or {}))
            if spec.sigmoid:
                ds = p * (1 - plain) * dp
            else:
                ds = p * (dp + (do * out_terms).sum(-1, keepdim=True) + dl)
            ds = ds * abs(scale_value(spec, q.shape[-1]))

            def per_kv_head(x):  # the dK/dV kernel sums the query heads of a GQA group
                B, H, n, d = x.shape
                return x.view(B, H // group, group, n, d).sum(2)
            scales |= {"dq": ds @ k_abs, "dk": per_kv_head(ds.transpose(-2, -1) @ qd.abs()),
                       "dv": per_kv_head(kept.transpose(-2, -1) @ do)}
        return {name: float(x.max()) if x.numel() else 0.0 for name, x in scales.items()}


def output_error_effect(spec: Spec, q: Tensor, k: Tensor, v: Tensor, inputs: Mapping[str, Tensor] | None,
                        out: Tensor, dout: Tensor, *, row: PackedRow | None = None,
                        dropout: Mapping | None = None) -> dict[str, float]:
    """For dq, dk and each learnable input's gradient: how far the kernel's own output error moves them.

    The backward forms dS = P * (dP - delta) with delta = rowsum(dO * O) read from the forward's
    output, as FlashAttention does: O was rounded to its dtype (and summed from P rounded to it),
    so delta is off by rowsum(dO * (O - O_true)), the same for every key of a row. Those errors do
    not average out: a gradient summed over many keys of a row (a learned bias shared by a band of
    keys) moves by up to the row's whole error. This is not a fault of the backward, it is the forward's
    error (checked on its own) seen through it, and the reference in low precision does not make it
    (autograd's softmax backward forms delta from dP instead). It is computed exactly here, in float64,
    as the vector-Jacobian product of the scores with dS' = -P * rowsum(dO * (out - O_true)). With
    `dropout` (a call's dropout_p and dropout_mask) O_true sums the kept P, scaled; dS' keeps every P.
    A sigmoid spec's backward reads no row term (dS = P * (1 - P) * dP), so O's error does not reach it: 0.
    """
    learnable = [i.name for i in spec.learnable_inputs]
    names = ["dq", "dk"] + [f"d_{name}" for name in learnable]
    if spec.sigmoid:
        return dict.fromkeys(names, 0.0)
    qd, kd, vd = (x.detach().to("cpu", torch.float64).requires_grad_(name != "v")
                  for name, x in zip("qkv", (q, k, v)))
    ins = {n: (x.detach().cpu().double() if x.is_floating_point() else x.detach().cpu()).requires_grad_(n in learnable)
           for n, x in (inputs or {}).items()}
    score = modified_scores(spec, qd, kd, vd, ins, row=row)
    # A sink is a column of the softmax with no value: its logit's gradient moves as a key's does.
    sink = sink_logits(spec, qd, kd, vd, ins, row=row)
    with torch.no_grad():
        columns = score if sink is None else torch.cat([score, sink[..., None]], dim=-1)
        p = torch.softmax(columns, dim=-1).nan_to_num(0.0)  # rows with no allowed key are all 0
        group = q.shape[1] // k.shape[1]
        o_true = dropped(p[..., :score.shape[-1]], **dict(dropout or {})) @ vd.repeat_interleave(group, dim=1)
        row_error = (dout.detach().to("cpu", torch.float64) * (out.detach().to("cpu", torch.float64) - o_true))
        ds = torch.where(torch.isfinite(columns), -p * row_error.sum(-1, keepdim=True), 0.0)
    leaves = [qd, kd] + [ins[name] for name in learnable]
    if sink is None:
        effects = _grads([score], leaves, [ds])
    else:
        effects = _grads([score, sink], leaves, [ds[..., :-1], ds[..., -1]])
    return {name: float(x.abs().max()) if x.numel() else 0.0 for name, x in zip(names, effects)}


def _packed_scales(spec: Spec, q: Tensor, k: Tensor, v: Tensor, inputs: Mapping[str, Tensor], packed: Mapping,
                   out: Tensor, dout: Tensor | None, dlse: Tensor | None, grads: bool,
                   dropout: Mapping | None = None) -> tuple[dict[str, float], dict[str, float]]:
    """summation_scales and output_error_effect of a packed call (check_against_reference's `packed`), from
    its sequences' own: the largest of each, except a learnable input's effect, which adds up over the
    sequences as its gradient does. `dropout`: the call's dropout_p and its (B, H, max_seqlen_q, max_seqlen_k)
    dropout_mask, of which each sequence takes its part."""
    starts_q, starts_k = packed["cu_seqlens_q"].tolist(), packed["cu_seqlens_k"].tolist()
    B = len(starts_q) - 1
    scales = {"lse": 1.0 + math.sqrt(packed["max_seqlen_k"])}  # check_against_reference says why
    effects: dict[str, float] = {}
    for b in range(B):
        row = PackedRow(b, B, packed["max_seqlen_q"], packed["max_seqlen_k"])
        sq, sk = slice(starts_q[b], starts_q[b + 1]), slice(starts_k[b], starts_k[b + 1])
        rows = [t.detach()[span].transpose(0, 1).unsqueeze(0) for t, span in ((q, sq), (k, sk), (v, sk))]
        per_row = lambda t: t.detach()[sq].transpose(0, 1).unsqueeze(0) if t is not None else None  # noqa: E731
        dl = dlse.detach()[:, sq].unsqueeze(0) if dlse is not None else None
        mine = None
        if dropout:
            mask = dropout["dropout_mask"][b:b + 1, :, :sq.stop - sq.start, :sk.stop - sk.start]
            mine = {"dropout_p": dropout["dropout_p"], "dropout_mask": mask}
        for name, x in summation_scales(spec, *rows, inputs, dout=per_row(dout), dlse=dl, row=row,
                                        dropout=mine).items():
            scales[name] = max(scales.get(name, 0.0), x)
        if grads:
            for name, x in output_error_effect(spec, *rows, inputs, per_row(out), per_row(dout), row=row,
                                               dropout=mine).items():
                effects[name] = effects.get(name, 0.0) + x if name.startswith("d_") else max(effects.get(name, 0.0), x)
    return scales, effects


def _grads(outputs: list[Tensor], leaves: list[Tensor], grad_outputs: list[Tensor]) -> tuple[Tensor, ...]:
    """d(outputs . grad_outputs)/d leaves, zero for leaves nothing depends on. An output may depend on
    no leaf at all (every row masked, or a score expression that ignores `score`)."""
    pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad]
    if not pairs:
        return tuple(torch.zeros_like(leaf) for leaf in leaves)
    return torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True,
                               materialize_grads=True)


# --- Checking a kernel ---------------------------------------------------------------------------

def dequantized(t: Tensor, descale: Tensor) -> Tensor:
    """An FP8 call's float8_e4m3fn q, k or v (B, heads, length, D) times its (B, HKV) descale factors, in float64."""
    return t.double() * descale.double().repeat_interleave(t.shape[1] // descale.shape[1], 1)[:, :, None, None]


def fp8_bound(spec: Spec, q: Tensor, k: Tensor, v: Tensor, inputs: Mapping[str, Tensor] | None = None
              ) -> tuple[Tensor, Tensor]:
    """(bound, want): how far each row (B, H, Q_LEN) of an FP8 call's out may lie from the float64 reference
    `want` of these dequantized q, k and v. The kernels round P to e4m3 before its product with V (as
    FlashAttention-3's FP8 forward does), each weight relative to its tile's running max, which is at most the
    row's: an unnormalised weight p (at most 1) is off by at most 2^-4 p, or 2^-10 below 2^-6 (e4m3's
    subnormals). Divided by the row sum l, a softmax row is off by at most the sum over its allowed keys of
    (2^-4 w + 2^-10 / l) |v|, w the reference's weight and 1 / l the row's largest weight (its sink's
    included); a sigmoid row's weights are not divided (1 in place of 1 / l). Plus bfloat16's rounding of O
    and the fp32 sums'."""
    w = probabilities(spec, q, k, v, inputs)
    allowed = modified_scores(spec, q, k, v, inputs) > float("-inf")
    largest = torch.ones_like(w[..., 0]) if spec.sigmoid else torch.maximum(w.amax(-1), 1 - w.sum(-1))
    vmax = v.abs().amax((-1, -2)).repeat_interleave(q.shape[1] // v.shape[1], 1)[:, :, None]  # (B, H, 1)
    want = evaluate(spec, q, k, v, inputs)[0]
    p_error = (2**-4 * w.sum(-1) + 2**-10 * largest * allowed.sum(-1)) * vmax
    return p_error + 2**-8 * want.abs().amax(-1) + 2**-12 * vmax, want


def check_fp8(spec: Spec, fn: Callable, q: Tensor, k: Tensor, v: Tensor, inputs: Mapping[str, Tensor],
              seed: int = 0) -> None:
    """Assert that kernel `fn`'s FP8 call (q, k and v float8_e4m3fn, descale factors drawn from `seed` in
    [0.5, 1.5)) stays within fp8_bound of the reference of the dequantized tensors on every row."""
    gen = torch.Generator().manual_seed(seed)
    B, HKV = q.shape[0], k.shape[1]
    scales = [(torch.rand(B, HKV, generator=gen) + 0.5).to(q.device) for _ in range(3)]
    with torch.no_grad():
        out = fn(q, k, v, q_descale=scales[0], k_descale=scales[1], v_descale=scales[2], **inputs)
    inputs64 = {n: x.double() if x.is_floating_point() else x for n, x in inputs.items()}
    bound, want = fp8_bound(spec, *(dequantized(t, s) for t, s in zip((q, k, v), scales)), inputs64)
    error = (out.double() - want).abs().amax(-1)
    ok = (error <= bound) | (error.isnan() & want.isnan().any(-1))
    assert bool(ok.all()), (f"FP8 out off by {error[~ok].max().item():.3g} at {_first(~ok)}, bound "
                            f"{bound[~ok][0].item():.3g}")


def check_against_reference(spec: Spec, fn: Callable[..., tuple[Tensor, Tensor]], q: Tensor, k: Tensor,
                            v: Tensor, inputs: Mapping[str, Tensor] | None = None, *, grads: bool = True,
                            factor: float = DEFAULT_FACTOR, seed: int = 0,
                            cache: Mapping[str, Tensor] | None = None, packed: Mapping | None = None,
                            dropout_p: float = 0.0) -> None:
    """Assert that kernel `fn` computes `spec`: out and lse, and with `grads` dq, dk, dv and the gradient
    of every learnable input, each within the data-derived tolerance of the float64 reference.

    `fn` is called as `fn(q, k, v, return_lse=True, **inputs)` (an `attngen.build` callable), or for a sigmoid
    spec, which has no LSE, as `fn(q, k, v, **inputs)`. The backward pass gets a random dO and a random dLSE
    on the rows where the kernel's LSE is finite.
    `cache`: a cache call's keywords (no gradients); `packed`: a packed call's (cu_seqlens_q/k,
    max_seqlen_q/k), whose q, k and v are (TOTAL, heads, D): each sequence is checked against the
    reference of that sequence alone, its tolerances derived from that sequence's data. `dropout_p`: the
    call drops P with that probability, from a generator on q's device seeded with `seed`; the reference
    drops the P of the mask `fn.dropout_mask` gives for the same generator state.
    """
    __tracebackhide__ = True
    inputs = dict(inputs or {})
    learnable = [i.name for i in spec.learnable_inputs]
    qkv = [x.detach().clone().requires_grad_(grads) for x in (q, k, v)]
    kernel_inputs = {name: x.detach().clone().requires_grad_(grads and name in learnable)
                     for name, x in inputs.items()}
    cache = dict(cache or {})
    assert not (cache and grads), "cache calls have no backward pass"
    packed = dict(packed or {})
    dropout, drop = None, {}
    if dropout_p:
        if not callable(getattr(fn, "dropout_mask", None)):
            raise TypeError(f"fn must have a dropout_mask method (as an attngen.build callable has) to be checked with "
                            f"dropout_p={dropout_p}: the reference drops the weights of the call's own mask")
        generator = torch.Generator(device=q.device).manual_seed(seed)
        state = generator.get_state()
        mask = fn.dropout_mask(q, k, v, dropout_p=dropout_p, generator=generator, **inputs, **packed)
        generator.set_state(state)
        dropout, drop = {"dropout_p": dropout_p, "dropout_mask": mask}, {"dropout_p": dropout_p, "generator": generator}
    if spec.sigmoid:
        out, lse = fn(*qkv, **kernel_inputs, **cache, **packed, **drop), None
    else:
        out, lse = fn(*qkv, return_lse=True, **kernel_inputs, **cache, **packed, **drop)

    expected_lse_dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    for name, x, want in (("out", out, q.dtype), ("lse", lse, expected_lse_dtype)):
        if x is not None and x.dtype != want:
            raise AssertionError(f"{name}: dtype must be {want}, got {x.dtype}")

    dout = dlse = None
    if grads:
        g = torch.Generator().manual_seed(seed)
        dout = torch.randn(out.shape, generator=g).to(out.device, out.dtype)
        if lse is not None:
            dlse = torch.randn(lse.shape, generator=g).to(lse.device, lse.dtype)
            dlse = torch.where(torch.isfinite(lse.detach()), dlse, 0.0)
    ref = reference_error(spec, q, k, v, inputs, q.dtype, dout=dout, dlse=dlse, cache=cache, packed=packed,
                          dropout=dropout)
    if packed:
        scales, effects = _packed_scales(spec, q, k, v, inputs, packed, out, dout, dlse, grads, dropout)
    else:
        scales = summation_scales(spec, q, k, v, inputs, dout=dout, dlse=dlse, cache=cache, dropout=dropout)
        # LSE is a logarithm computed in fp32 (through exp2/log2 with log2(e) folded in): even where it is
        # exactly 0 (one allowed key with score 0) it is only good to ulps of 1, whatever max|LSE| is. Its
        # argument sums up to KV_LEN exponentials in fp32, whose rounding grows like sqrt(KV_LEN) ulps of
        # the sum: that many ulps of LSE. (The H200 fuzz found an LSE 12 ulps off at KV_LEN 512 with a
        # score that ignores q and k, so the reference's own low-precision error, usually far larger, was
        # near 0.)
        scales["lse"] = 1.0 + math.sqrt(k.shape[2])
        effects = output_error_effect(spec, q, k, v, inputs, out, dout, dropout=dropout) if grads else {}

    actual = {"out": out} | ({"lse": lse} if lse is not None else {})
    if grads:
        leaves = qkv + [kernel_inputs[name] for name in learnable]
        upstream = [(out, dout)] + ([(lse, dlse)] if lse is not None else [])
        kernel_grads = _grads([o for o, _ in upstream], leaves, [g for _, g in upstream])
        actual |= dict(zip(["dq", "dk", "dv"] + [f"d_{name}" for name in learnable], kernel_grads))
    for name, x in actual.items():
        floor = (default_floor(ref.truth[name], x.dtype) + FLOOR_ULPS * FP32_EPS * scales.get(name, 0.0)
                 + effects.get(name, 0.0))
        assert_matches_reference(name, x, ref.truth[name], ref.low_precision[name], factor=factor, floor=floor)


# --- Fuzzing -------------------------------------------------------------------------------------
