"""The loop bounds of `spans.region` evaluated for one tile in Python, exactly as the generated kernels compute them."""

from __future__ import annotations

import torch

from attngen import ir
from attngen.analysis import spans
from attngen.reference import Env, evaluate_expr


class RuntimeDecided(Exception):
    """A bound reads a tensor input, so only the kernel knows it."""


def _uniform_value(expr: ir.Expr | None, env: Env) -> int:
    if expr is None:
        return 0
    try:
        return int(evaluate_expr(expr, env))
    except (KeyError, ValueError) as e:
        raise RuntimeDecided(str(e)) from None


def bound_value(bound: spans.Bound, tile: dict[str, int], env: Env) -> int | None:
    """A bound of `spans.region` for one tile, as the kernel computes it (None: unbounded)."""
    if bound is None:
        return None
    if isinstance(bound, spans.Extremum):
        values = [bound_value(t, tile, env) for t in bound.terms]
        return min(values) if bound.op == "min" else max(values)
    if isinstance(bound, spans.Gate):
        opened = bound_value(bound.cond, tile, env) >= 0
        if bound.side == "lo":
            return spans.OPEN_LO if opened else spans.CLOSED_LO
        return spans.OPEN_HI if opened else spans.CLOSED_HI
    y = (tile[bound.var] + _uniform_value(bound.var_offset, env)) // bound.var_div
    num = bound.coef * y + _uniform_value(bound.const, env)
    m = num // bound.den if bound.round == "floor" else -(-num // bound.den)
    return bound.out_scale * m + _uniform_value(bound.out_offset, env)


def uniform_env(spec: ir.Spec, sizes: dict[str, int], b: int, h: int, inputs=None) -> Env:
    """What a bound may read at batch b, head h: sizes, params, b, h, hkv and the inputs (on the CPU).
    Query 0 sits at position Q_OFFSET, 0 unless `sizes` says otherwise."""
    values = {name: torch.tensor(n) for name, n in {"Q_OFFSET": 0, **sizes}.items()}
    hkv = h // (sizes["H"] // sizes["HKV"])
    values |= {"b": torch.tensor(b), "h": torch.tensor(h), "hkv": torch.tensor(hkv)}
    values |= {p.name: torch.tensor(p.value) for p in spec.params}
    return Env(values, {name: t.cpu() for name, t in (inputs or {}).items()}, torch.float64)
