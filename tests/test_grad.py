"""Symbolic derivatives of score expressions (attngen.grad) against torch autograd of the eager reference."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from attngen import ir
from attngen.api import parse_spec
from attngen.analysis.derivatives import ONE, ZERO, derivative, learnable_loads
from attngen.reference import evaluate_expr, make_env

F64 = torch.float64
SIZES = dict(B=2, H=3, HKV=3, Q_LEN=5, KV_LEN=7, D=16)
SHAPE = (SIZES["B"], SIZES["H"], SIZES["Q_LEN"], SIZES["KV_LEN"])

# Every expression below is read in this spec; t, u, w and x are the learnable inputs.
HEADER = """\
attention grad_check
param cap = 20.0
param n = 3
input t: f32[H] learnable
input u: f32[H, Q_LEN, KV_LEN] learnable
input w: f32[H, 5] learnable
input x: f32[] learnable
input bias: f32[H]
"""

# Score expressions; random data stays away from ties and kinks (min/max/clamp/abs switch
# points, mod and floor jumps have measure zero) and from non-positive log/sqrt/pow bases.
EXPRESSIONS = [
    "score",
    "score * 2 + 1",
    "-score ** 2",
    "score * (k - q)",
    "softcap(score, 20.0)",
    "softcap(score, cap)",
    "tanh(score)",
    "exp(score / 4)",
    "exp2(score)",
    "log(abs(score) + 1)",
    "log2(abs(score) + 1)",
    "sqrt(abs(score) + 1)",
    "rsqrt(abs(score) + 1)",
    "rsqrt(score * score + 0.5)",
    "sigmoid(score)",
    "abs(score)",
    "min(score, 0.3)",
    "max(score, -0.2)",
    "max(0.1, score)",
    "min(q - k, score)",
    "clamp(score, -1.0, 1.5)",
    "clamp(score, -1, 1)",
    "where(q > k, score * 2, score)",
    "where(q >= k, exp(score), -inf)",
    "where(q > k, 1.0, score)",
    "score ** 3",
    "score ** 2",
    "score ** n",
    "(abs(score) + 1) ** 2.5",
    "(abs(score) + 1) ** -1.5",
    "(abs(score) + 1) ** 0.5",
    "2.0 ** score",
    "(abs(score) + 1) ** score",
    "score / (abs(score) + 2)",
    "1 / (score * score + 1)",
    "(q - k) / (score * score + 1)",
    "score % 0.7",
    "score % -0.7",
    "score // 0.5 + score",
    "score + floor(score) * 0.5",
    "ceil(score) + score",
    "sin(cos(score)) + tan(score * 0.3)",
    "cos(score) * sin(score) + atan(score * 2)",
    "erf(score) + sign(score) * score",
    "round(score * 3) * 0.25 + score",
    "score + tan(t[h] * 0.5) + sin(x) * erf(t[h]) + atan(u[h, q, k])",
    "score + bias[h]",
    "score * bias[h] + exp(bias[h])",
    # learnable inputs
    "score * t[h] + t[h] ** 2",
    "score + t[h] * (k - q)",
    "softcap(score, 30.0) + t[h]",
    "score * exp(t[h])",
    "score * t[h] * t[h]",
    "t[h] * t[(h + 1) % H] + score",
    "exp(score - t[h]) * sigmoid(t[h])",
    "max(score, t[h])",
    "min(t[h], score)",
    "clamp(score, t[h] - 1, t[h] + 1)",
    "clamp(score, t[h], 0.25)",
    "clamp(score, -0.25, t[h])",
    "clamp(score, t[h], -t[h])",
    "where(q > k, t[h] * score, score - t[h])",
    "score % (abs(t[h]) + 0.5)",
    "score / (abs(t[h]) + 0.5)",
    "(abs(t[h]) + 1) ** score",
    "(abs(score) + 1) ** t[h]",
    "softcap(score, abs(t[h]) + 5.0)",
    "score + u[h, q, k] * score",
    "u[h, q, k] / (abs(score) + 1)",
    "log(u[h, q, k] * u[h, q, k] + 1) * tanh(score)",
    "score + w[h, clamp(q - k, -2, 2) + 2]",
    "score * x",
    "softcap(score * x, cap)",
    "score + x * x",
]


def spec_of(text: str) -> ir.Spec:
    return parse_spec(f"{HEADER}score: {text}\n")


def float_loads(expr: ir.Expr) -> list[ir.Load]:
    """The distinct float loads of an expression (equal loads read the same element)."""
    seen: list[ir.Load] = []
    for node in ir.walk(expr):
        if isinstance(node, ir.Load) and node.type == "float" and node not in seen:
            seen.append(node)
    return seen


WITH_LOADS = [text for text in EXPRESSIONS if float_loads(spec_of(text).score)]


def random_inputs(gen: torch.Generator) -> dict[str, torch.Tensor]:
    H, Q, K = SIZES["H"], SIZES["Q_LEN"], SIZES["KV_LEN"]
    return {
        "t": torch.randn(H, generator=gen, dtype=F64),
        "u": torch.randn(H, Q, K, generator=gen, dtype=F64),
        "w": torch.randn(H, 5, generator=gen, dtype=F64),
        "x": torch.randn((), generator=gen, dtype=F64) + 1.5,
        "bias": torch.randn(H, generator=gen, dtype=F64),
    }


def env_of(spec: ir.Spec, score: torch.Tensor, inputs: dict[str, torch.Tensor]):
    env = make_env(spec, **SIZES, inputs=inputs, float_dtype=F64)
    return replace(env, values={**env.values, "score": score})


def value(expr: ir.Expr, env) -> torch.Tensor:
    return evaluate_expr(expr, env).to(F64).expand(SHAPE)


@pytest.fixture(params=range(2), ids=lambda s: f"seed{s}")
def data(request):
    gen = torch.Generator().manual_seed(1234 + request.param)
    score = 2.0 * torch.randn(SHAPE, generator=gen, dtype=F64)
    weight = torch.rand(SHAPE, generator=gen, dtype=F64) + 0.5
    return score, random_inputs(gen), weight


@pytest.mark.parametrize("text", EXPRESSIONS)
def test_score_derivative_matches_autograd(text, data):
    score, inputs, _ = data
    spec = spec_of(text)
    expr = spec.score
    leaf = score.clone().requires_grad_(True)
    out = value(expr, env_of(spec, leaf, inputs))
    assert torch.isfinite(out[out > -float("inf")]).all()
    (expected,) = torch.autograd.grad(out.sum(), leaf, allow_unused=True)
    if expected is None:
        expected = torch.zeros_like(score)

    got = value(derivative(expr, ir.Score()), env_of(spec, score, inputs))
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("text", WITH_LOADS)
def test_load_derivatives_match_autograd(text, data):
    """d/d input by autograd equals the sum, over every load of it and every grid element that
    reads it, of the symbolic derivative w.r.t. that load (weighted, so nothing cancels)."""
    score, inputs, weight = data
    spec = spec_of(text)
    loads = float_loads(spec.score)
    names = sorted({load.input for load in loads})
    leaves = {name: x.clone().requires_grad_(name in names) for name, x in inputs.items()}
    out = value(spec.score, env_of(spec, score, leaves))
    grads = torch.autograd.grad((out * weight).sum(), [leaves[n] for n in names], allow_unused=True)

    env = env_of(spec, score, inputs)
    for name, grad in zip(names, grads):
        expected = torch.zeros_like(inputs[name]) if grad is None else grad
        got = torch.zeros_like(inputs[name])
        for load in (ld for ld in loads if ld.input == name):
            contribution = value(derivative(spec.score, load), env) * weight
            if load.index:
                index = tuple(evaluate_expr(i, env).expand(SHAPE) for i in load.index)
                got.index_put_(index, contribution, accumulate=True)
            else:
                got += contribution.sum()
        torch.testing.assert_close(got, expected, msg=lambda m: f"d/d{name} of {text}: {m}")


def test_derivatives_fold_zeros_and_ones():
    t_h = ir.Load(type="float", input="t", index=(ir.Var(name="h"),))
    assert derivative(spec_of("score + t[h]").score, ir.Score()) == ONE
    assert derivative(spec_of("score + t[h]").score, t_h) == ONE
    assert derivative(spec_of("score").score, ir.Score()) == ONE
    assert derivative(spec_of("score * 2").score, ir.Score()) == ir.Const(type="int", value=2)
    assert derivative(spec_of("exp(t[h])").score, ir.Score()) == ZERO
    assert derivative(spec_of("score + (q - k)").score, ir.Score()) == ONE
    assert derivative(spec_of("floor(score) + 1.0").score, ir.Score()) == ZERO
    # A constant clamp passes the gradient inside [lo, hi] and nowhere else: one select, no bound terms.
    d = derivative(spec_of("clamp(score, -1.0, 1.0)").score, ir.Score())
    assert isinstance(d, ir.Call) and d.fn == "where" and d.args[1:] == (ONE, ZERO)


def test_learnable_loads_are_the_distinct_learnable_reads_in_order():
    spec = spec_of("score * t[h] + t[h] ** 2 + bias[h] + w[h, 0] * t[(h + 1) % H] + x")
    assert [(ld.input, len(ld.index)) for ld in learnable_loads(spec)] == [("t", 1), ("w", 2), ("t", 1), ("x", 0)]
    assert learnable_loads(parse_spec("attention a\nmask: causal\n")) == ()
