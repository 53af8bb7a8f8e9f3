"""The spec's code spliced into the kernel skeletons keeps its declared contract: each hook reads only
the names it declares (besides the module's globals and the kernels' parameters) and defines the
outputs it promises, for every catalog spec and for random specs."""

import ast
import builtins
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attngen
from attngen import api
from attngen.analysis import analyze
from attngen.emit.hooks import Hook, defined_names, kernel_context, undeclared_reads
from attngen.plan import get_target
from attngen.plan.families import choose_families
from attngen.testing import strategies

ROOT = Path(__file__).resolve().parent.parent
CATALOG = sorted(ROOT.glob("specs/*.attn"))


def _hooks(context: dict):
    # Every kernel's hooks, whichever family's context holds them (flags such as the Hopper kernels'
    # plain_score, the signatures and the tables' parameter names are not hooks).
    kernels = [kernel for kernel, value in context.items()
               if isinstance(value, dict) and any(isinstance(hook, Hook) for hook in value.values())]
    assert {"fwd", "dq", "dkdv"} <= set(kernels), kernels
    for kernel in kernels:
        for name, hook in context[kernel].items():
            if isinstance(hook, Hook):
                yield f"{kernel}.{name}", hook


def _check_contracts(spec: attngen.Spec) -> None:
    facts = analyze(spec)
    chosen, _ = choose_families(facts, get_target("h200"))
    context = kernel_context(facts, tuple(f.name for f in chosen))
    module = ast.parse(attngen.compile_source(spec, target="h200"))
    globals_ = {t.id for node in module.body if isinstance(node, ast.Assign) for t in node.targets
                if isinstance(t, ast.Name)}
    globals_ |= {node.name for node in module.body if isinstance(node, ast.FunctionDef | ast.ClassDef)}
    globals_ |= {alias.asname or alias.name.split(".")[0] for node in module.body
                 if isinstance(node, ast.Import | ast.ImportFrom) for alias in node.names}
    params = {p for signature in context["sig"].values() for p in signature.params}
    known = globals_ | params | set(dir(builtins))
    for where, hook in _hooks(context):
        assert not undeclared_reads(hook, known), f"{spec.name} {where} reads undeclared {undeclared_reads(hook, known)}"
        assert set(hook.outputs) <= defined_names(hook), f"{spec.name} {where} does not define {hook.outputs}"


@pytest.mark.parametrize("path", CATALOG, ids=[p.stem for p in CATALOG])
def test_catalog_hooks_keep_their_contracts(path):
    _check_contracts(attngen.parse_spec(path.read_text()))


# 15 drawn specs in the default tier and 25 others in the slow one (another test, other draws).
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(spec=strategies.specs())
def test_random_spec_hooks_keep_their_contracts(spec):
    _check_contracts(spec)


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(spec=strategies.specs())
def test_random_spec_hooks_keep_their_contracts_in_more_drawn_specs(spec):
    _check_contracts(spec)


def test_a_hook_reading_an_undeclared_name_is_caught():
    hook = Hook("score", ("qk",), ("s2",), "t = qk * 2\ns2 = t + secret")
    assert undeclared_reads(hook, {"tl"}) == {"secret"}
    assert defined_names(hook) == {"t", "s2"}


def test_score_and_mask_hooks_carry_their_spec_line():
    context = kernel_context(analyze(attngen.parse_spec((ROOT / "specs" / "alibi_causal.attn").read_text())))
    assert str(context["fwd"]["score"]).startswith("# score: score + slopes[h] * (k - q)\n")
    assert str(context["fwd"]["mask"]).startswith("# mask: q >= k\n")


def test_floor_division_of_operands_proven_non_negative_is_tritons_own():
    """// and % of operands the intervals prove non-negative (positions over a positive param) are Triton's own,
    which truncate and agree with Python's floor there; an operand that may be negative (q - k, k - 9) keeps
    the helpers that floor. The kernel tests and the fuzz check both against the reference."""
    text = "attention t\nparam c = 7\nmask: q // c == k // c and (q - k) % c != 3 and (k - 9) // c < 100\n"
    mask = str(kernel_context(analyze(attngen.parse_spec(text)))["fwd"]["mask"])
    assert "mk0 = pos_m[:, None] // 7\nmk1 = offs_n[None, :] // 7\n" in mask
    assert "_floormod(mk3, 7)" in mask and "_floordiv(mk7, 7)" in mask


# Int index expressions of q and k for the tile intervals (`TritonEmitter.interval`): the ops it follows,
# and one it does not (%).
_INDEX_LEAVES = st.sampled_from(["q", "k", "h", "3", "-5", "64", "q - k", "k - q"])


def _index_texts(depth: int) -> st.SearchStrategy[str]:
    if depth == 0:
        return _INDEX_LEAVES
    sub = _index_texts(depth - 1)
    const = st.sampled_from(["2", "7", "128", "-3"])
    return st.one_of(
        _INDEX_LEAVES,
        st.tuples(sub, st.sampled_from(["+", "-"]), sub).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
        st.tuples(const, sub).map(lambda t: f"({t[0]} * {t[1]})"),
        st.tuples(sub, st.sampled_from(["2", "7", "64"])).map(lambda t: f"({t[0]} // {t[1]})"),
        st.tuples(sub, st.sampled_from(["5", "64"])).map(lambda t: f"({t[0]} % {t[1]})"),
        st.tuples(st.sampled_from(["min", "max"]), sub, sub).map(lambda t: f"{t[0]}({t[1]}, {t[2]})"),
        st.tuples(sub, const, st.sampled_from(["130", "200"])).map(lambda t: f"clamp({t[0]}, {t[1]}, {t[2]})"),
        sub.map(lambda t: f"abs({t})"),
        sub.map(lambda t: f"-{t}"),
        st.tuples(sub, sub).map(lambda t: f"where(q > k, {t[0]}, {t[1]})"),
    )


class _ScalarTl:
    """The tl calls of the intervals' scalar code, on Python ints."""
    int64 = None
    cast = staticmethod(lambda x, dtype: int(x))
    minimum = staticmethod(min)
    maximum = staticmethod(max)
    where = staticmethod(lambda c, a, b: a if c else b)
    abs = staticmethod(abs)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=_index_texts(3), q0=st.integers(0, 400), k0=st.integers(0, 400),
       rows=st.sampled_from([1, 16, 64]), cols=st.sampled_from([1, 16, 64]))
def test_tile_intervals_bound_every_element_and_a_point_is_exact(text, q0, k0, rows, cols):
    from attngen import ir
    from attngen.intervals import TileBox, fits, value
    from attngen.ir import I32_RANGE, postorder
    from attngen.emit.expressions import Spelling, TritonEmitter
    from attngen.analysis.fold import fold

    spec = attngen.parse_spec(f"attention t\ninput t: f32[H, 1]\nscore: score + t[h, {text}]")
    facts = analyze(spec)
    index = spec.score.right.index[1]
    spelling = Spelling(names={"q": "q", "k": "k", "h": "off_h", "score": "s"},
                        dims={"q": frozenset("m"), "k": frozenset("n"), "score": frozenset("mn")}, zeros="0.0",
                        corners=("q_first", "q_last", "k_first", "k_last"))
    em = TritonEmitter(spelling, facts.params, {"t": spec.inputs[0]}, "x", facts.ranges)
    bounds = em.interval(index)
    if bounds is None:  # only for what it does not follow: %, or an int the analysis cannot bound within int32
        nodes = list(postorder(fold(index, facts.params)))
        assert any(isinstance(n, ir.Binary) and n.op == "mod" for n in nodes) or not all(
            fits(facts.ranges.value(n), I32_RANGE) for n in nodes if facts.ranges.is_int(n)), text
        return
    scope = {"tl": _ScalarTl, "_floordiv": lambda a, b: a // b, "_floormod": lambda a, b: a % b,
             "off_h": 2, "q_first": q0, "q_last": q0 + rows - 1,
             "k_first": k0, "k_last": k0 + cols - 1}
    exec("\n".join(em.lines), scope)
    lo, hi = (scope[b] if b in scope else eval(b, scope) for b in bounds)
    sizes = {"B": 1, "H": 4, "HKV": 4, "Q_LEN": 1024, "KV_LEN": 1024, "D": 64}
    for q in range(q0, q0 + rows):
        for k in range(k0, k0 + cols):
            v = value(index, TileBox(q=(q, q), k=(k, k), params={}, sizes=sizes, uniform={"h": (2, 2)}))
            assert v.lo == v.hi and lo <= v.lo <= hi, (text, q, k, v, lo, hi)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=_index_texts(3))
def test_the_analysis_says_which_loads_gather_and_take_point_loads_as_the_hopper_score_hook_does(text):
    """`attngen explain` reads Analysis.score_gathers; the kernels' emitter decides per load on its own
    spelling of the tile (folded, Q_OFFSET pinned, corners): the two agree."""
    from attngen import ir
    from attngen.emit import hooks
    from attngen.families.hopper.emit import HOPPER_SCORE

    spec = attngen.parse_spec(f"attention t\ninput t: f32[H, 1]\ninput u: f32[9, 9]\n"
                              f"score: score + t[h, {text}] + u[q % 9, {text}]")
    facts = analyze(spec)
    em = hooks._emitter(facts, HOPPER_SCORE, "sc")
    loads = dict.fromkeys(n for n in ir.postorder(spec.score) if isinstance(n, ir.Load))
    assert list(facts.score_gathers) == [(load, em.point(load.index) is not None) for load in loads
                                         if em.varies_on_tile(load.index)], text


def test_explain_says_which_score_inputs_take_point_loads_as_the_kernels_do():
    spec = """
    attention mixed_biases
    input table: f32[H, 9] learnable
    input grid: f32[3, 5]
    input rows: f32[Q_LEN]
    score: score + table[h, clamp(q - k, -4, 4) + 4] + grid[q % 3, k % 5] + rows[q]
    """
    text = api.explain(spec, q_len=256, kv_len=256, head_dim=64, head_dim_v=64, dtype="bf16", target="h200").text
    assert "table[h, clamp(q - k, -4, 4) + 4]: point loads" in text and "in one atomic" in text
    assert "grid[q % 3, k % 5]: gathered on every tile" in text
    assert "  rows[q]:" not in text  # read once a row: no gather
    # What explain says is what the generated kernels do: a point load for table only.
    source = attngen.compile_source(spec, target="h200")
    assert "_entry = tl.load(table_ptr" in source and "_entry = tl.load(grid_ptr" not in source
    plain = api.explain("attention plain\nscore: score * 2.0\n", q_len=64, kv_len=64, head_dim=64,
                        head_dim_v=64, dtype="bf16", target="h200").text
    assert "score inputs read at both q and k" not in plain
