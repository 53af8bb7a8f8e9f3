"""The compile-time checks of a spec's numbers: a spec that cannot be computed exactly is rejected before any kernel exists.

Lowering runs them on the declared params and positions each problem at its node; build-time
param overrides (`with_params`) run them again on the new values, naming the params and printing
the offending expression, since an override has no place in the text.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

from attngen import ir
from attngen.errors import ArgumentError
from attngen.intervals import HEAD_DIMS, MAX_LENGTH, Ranges, box, is_constant, length_limit
from attngen.frontend.printer import expr_to_source, host_scale

# A spec whose ints overflow int64 below this length is rejected: it could serve only toy
# sequences, so the overflow is more likely a mistake than a design. Above it, the generated
# module refuses the lengths beyond its limit at call time (intervals.length_limit).
MIN_LENGTH = 1024
_DIVIDES = {"div": "/", "floordiv": "//", "mod": "%"}
_SHIFTS = {"lshift": "<<", "rshift": ">>"}
# The largest |scale|. The kernels exponentiate base-2 scores (score * log2(e)) in float32, and the
# backward recomputes P = exp2(s2 - LSE2) from the float32 LSE, whose rounding (ulp |LSE2|) enters
# P's exponent: beyond 2**24 the error in P reaches a factor of 2**0.5, and beyond 2**31 P overflows.
# With |scale| <= 2**15, q and k whose entries lie within +-1 (|q.k| <= D <= 256) give base-2 scores
# below 2**15 * log2(e) * 2**8 < 2**24.
MAX_SCALE = 2.0 ** 15


@dataclass(frozen=True)
class Problem:
    """What is wrong (`message`, "X must ..., got ...") and where: the offending subexpression."""
    node: ir.Expr
    message: str


def _number(v: float) -> str:
    if isinstance(v, int) and abs(v) < 10 ** 25:
        return str(v)
    return f"{v:.3g}"


def _range(value) -> str:
    return f"[{_number(value.lo)}, {_number(value.hi)}]"


def problems(spec: ir.Spec) -> list[Problem]:
    """Everything that keeps the spec's numbers from being exact, innermost and leftmost first."""
    found = []
    ranges = Ranges(box(spec, MIN_LENGTH))
    # Divisors widen with the lengths: one nonzero up to the longest length any call may have.
    widest = Ranges(box(spec, MAX_LENGTH))
    for expr in (spec.mask, spec.score, spec.scale, spec.sink):
        for node in ir.postorder(expr) if expr is not None else ():
            found += _node_problems(node, ranges, widest)
    # The scale is computed on the host in float64 (`_scale_problems` checks its value); the rest
    # runs in float32, in the kernels (mask, score) or on the host (sink), whose float constants are float32.
    found += _float32_problems(spec, (spec.mask, spec.score, spec.sink))
    limit, culprit = length_limit(spec)
    if limit < MIN_LENGTH:
        got = _range(Ranges(box(spec, limit + 1)).value(culprit))
        where = ("whatever the call's inputs and sizes" if limit == 0 else
                 f"at lengths up to {MIN_LENGTH} (it overflows beyond length {limit})")
        found.append(Problem(culprit, f"'{expr_to_source(culprit)}' must fit in int64 {where}, got values in "
                                      f"{got}; compute it in float (with a float operand) or from narrower ints"))
    if spec.scale is not None:
        found += _scale_problems(spec, ranges)
    return found


def _node_problems(node: ir.Expr, ranges: Ranges, widest: Ranges) -> list[Problem]:
    if isinstance(node, ir.Binary) and node.op in _DIVIDES:
        divisor = widest.value(node.right)
        if divisor.lo == divisor.hi == 0 and not divisor.nan:
            return [Problem(node, f"the divisor of '{_DIVIDES[node.op]}' must not be a constant zero, "
                                        f"got '{expr_to_source(node.right)}', which is 0")]
        if node.op != "div" and ranges.is_int(node) and divisor.lo <= 0 <= divisor.hi:
            # An int divided by zero has no value (the reference raises, a kernel would return
            # some number), so the divisor must be provably nonzero at every position.
            return [Problem(node.right, f"the divisor of an int '{_DIVIDES[node.op]}' must be nonzero for every "
                                        f"b, h, q, k and input value, got '{expr_to_source(node.right)}' with "
                                        f"values in {_range(divisor)}; bound it away from zero, e.g. "
                                        f"'max({expr_to_source(node.right)}, 1)'")]
    if isinstance(node, ir.Binary) and node.op in ir.SHIFT_OPS:
        # Python's shifts on int64 are torch's and the kernels' for counts 0 .. 63 only (a negative count
        # raises in Python; wider ones are undefined in C), so the count must provably lie there.
        count, text = widest.value(node.right), _SHIFTS[node.op]
        written = expr_to_source(node.right)
        if is_constant(node.right) and (count.lo < 0 or count.hi > ir.MAX_SHIFT):
            why = "must not be negative" if count.lo < 0 else f"must be at most {ir.MAX_SHIFT} (an int is 64 bits wide)"
            return [Problem(node.right, f"the count of '{text}' {why}, got '{written}', which is {_number(count.lo)}")]
        if count.nan or count.lo < 0 or count.hi > ir.MAX_SHIFT:
            return [Problem(node.right, f"the count of '{text}' must lie in 0..{ir.MAX_SHIFT} for every b, h, q, k "
                                        f"and input value, got '{written}' with values in {_range(count)}; "
                                        f"clamp it, e.g. 'clamp({written}, 0, {ir.MAX_SHIFT})'")]
    if isinstance(node, ir.Call) and node.fn == "softcap":
        cap = ranges.value(node.args[1])
        if cap.lo == cap.hi == 0 and not cap.nan:
            return [Problem(node, f"the cap of softcap() must not be a constant zero (it divides by it), "
                                          f"got '{expr_to_source(node.args[1])}', which is 0")]
    if isinstance(node, ir.Binary) and node.op == "pow" and ranges.is_int(node) and not is_constant(node.right):
        # torch computes an int to a non-negative int power in int64; the kernels compute it
        # exactly by repeated squaring, which needs the exponent at compile time.
        return [Problem(node.right, f"the exponent of an int '**' must be a constant (literals and params), "
                                    f"got '{expr_to_source(node.right)}'; for a float power use a float "
                                    f"base, e.g. '1.0 * {expr_to_source(node.left)}'")]
    return []


def _float32_problems(spec: ir.Spec, exprs) -> list[Problem]:
    """Float literals, params and expressions of them alone are float32 numbers computed in float32
    (`reference.Env.constant_dtype`, `analysis.fold`): one finite in float64 but not in float32 (`1e39`,
    `1e20 * 1e20`, `exp(100.0)`) would turn the spec's finite number into inf, so it is rejected
    (innermost first; inf itself, and what inf makes, are the spec's own)."""
    # Imported here: a spec that fails before its numbers are checked is reported without torch.
    import torch

    from attngen.reference import Env, evaluate_expr

    float32_max = float(torch.finfo(torch.float32).max)
    params = {p.name: torch.tensor(p.value, dtype={"int": torch.int64, "float": torch.float64}[p.type])
              for p in spec.params}
    found, flagged = [], set()
    for expr in exprs:
        for node in ir.postorder(expr) if expr is not None else ():
            if node.type != "float" or not is_constant(node) or any(id(c) in flagged for c in ir.children(node)):
                continue
            try:
                wide, narrow = (float(evaluate_expr(node, Env(params, {}, torch.float64, constant_dtype=dtype)))
                                for dtype in (torch.float64, torch.float32))
            except (RuntimeError, ArithmeticError):  # an int divided by zero: a problem of its own above
                continue
            if math.isfinite(wide) and not math.isfinite(narrow):
                flagged.add(id(node))
                found.append(Problem(node, f"'{expr_to_source(node)}' must be finite in float32, the precision "
                                           f"of the kernels' float constants (|x| <= {float32_max:.8g}), "
                                           f"got {narrow} ({_number(wide)} in float64)"))
    return found


def _scale_problems(spec: ir.Spec, ranges: Ranges) -> list[Problem]:
    """The scale runs on the host for the call's head dim D: every int must fit int64 (torch's
    reference computes them so) and the value must be finite, for every D the module accepts."""
    culprit = ranges.overflow(spec.scale)
    if culprit is not None:
        return [Problem(culprit, f"'{expr_to_source(culprit)}' must fit in int64 for every head dim D in "
                                 f"{HEAD_DIMS[0]}..{HEAD_DIMS[1]}, got values in {_range(ranges.value(culprit))}")]
    scale = host_scale(spec.scale, spec.param_values)
    values = {}
    for d in range(HEAD_DIMS[0], HEAD_DIMS[1] + 1):
        try:
            values[d] = scale(d)
        except (ArithmeticError, ValueError, TypeError) as err:
            got = f"{type(err).__name__} ({err})"
        else:
            if math.isfinite(values[d]):
                continue
            got = repr(values[d])
        return [Problem(spec.scale, f"scale must be a finite number for every head dim D in "
                                    f"{HEAD_DIMS[0]}..{HEAD_DIMS[1]}, got {got} at D={d}")]
    # Every D a call may have is checked here, so softmax_scale(D) needs no check at call time.
    for d, value in values.items():
        if abs(value) > MAX_SCALE:
            return [Problem(spec.scale, f"scale must be within [-2**15, 2**15] for every head dim D in "
                                        f"{HEAD_DIMS[0]}..{HEAD_DIMS[1]} (a larger one makes the kernels' float32 "
                                        f"scores too coarse to recompute the softmax from its LSE), "
                                        f"got {value:.6g} at D={d}")]
    return []


def with_params(spec: ir.Spec, overrides: dict[str, int | float] | None) -> ir.Spec:
    """`spec` with some params given new values (build-time overrides, `-D`), checked as lowering checks
    the declared ones: an ArgumentError names the params, and the expression they make inexact."""
    if not overrides:
        return spec
    declared = {p.name: p for p in spec.params}
    for name, value in overrides.items():
        if name not in declared:
            known = ", ".join(declared) or "none"
            raise ArgumentError(f"params: unknown param '{name}' (the spec declares: {known})")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ArgumentError(f"params: '{name}' must be a number, got {value!r}")
        # nan and inf, and an int past the largest float for a float param, would be baked in as inf.
        if not (-sys.float_info.max <= value <= sys.float_info.max):
            raise ArgumentError(f"params: '{name}' must be a finite number, got {value!r}")
        if declared[name].type == "int" and isinstance(value, float) and not value.is_integer():
            raise ArgumentError(f"params: '{name}' is an int param and must be an integer, got {value!r}")
        if declared[name].type == "int" and not ir.I64_RANGE[0] <= value <= ir.I64_RANGE[1]:
            raise ArgumentError(f"params: '{name}' is an int param and must fit in int64, got {value!r}")
    params = tuple(
        p.model_copy(update={"value": (int(overrides[p.name]) if p.type == "int" else float(overrides[p.name]))})
        if p.name in overrides else p
        for p in spec.params)
    changed = spec.model_copy(update={"params": params})
    found = problems(changed)
    if not found:
        return changed
    problem = found[0]
    named = [n for n in overrides if ir.uses(problem.node, ir.Param, n)] or list(overrides)
    values = ", ".join(f"'{n}' = {overrides[n]!r}" for n in named)
    raise ArgumentError(f"params: {values} makes '{expr_to_source(problem.node)}' wrong: {problem.message}")
