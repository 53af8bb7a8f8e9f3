"""The spec's code spliced into the kernel skeletons keeps its declared contract: each hook reads only
the names it declares (besides the module's globals and the kernels' parameters) and defines the
outputs it promises, for every catalog spec and for random specs."""

import ast
import builtins
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

import attngen
from attngen.analysis import analyze
from attngen.emit.hooks import Hook, defined_names, kernel_context, undeclared_reads
from attngen.plan import get_target
from attngen.plan.families import choose_families
from attngen.testing import strategies

ROOT = Path(__file__).resolve().parent.parent
CATALOG = sorted(ROOT.glob("specs/*.attn"))


def _hooks(context: dict):
    for kernel in ("fwd", "dq", "dkdv", "table_by_query", "table_by_key", "decode", "hopper", "hopper_bwd"):
        for name, hook in (context[kernel] or {}).items():
            if not isinstance(hook, bool):  # the Hopper kernels' flags (plain_score, remask, ...)
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
        assert isinstance(hook, Hook)
        assert not undeclared_reads(hook, known), f"{spec.name} {where} reads undeclared {undeclared_reads(hook, known)}"
        assert set(hook.outputs) <= defined_names(hook), f"{spec.name} {where} does not define {hook.outputs}"


@pytest.mark.parametrize("path", CATALOG, ids=[p.stem for p in CATALOG])
def test_catalog_hooks_keep_their_contracts(path):
    _check_contracts(attngen.parse_spec(path.read_text()))


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(spec=strategies.specs())
def test_random_spec_hooks_keep_their_contracts(spec):
    _check_contracts(spec)


def test_a_hook_reading_an_undeclared_name_is_caught():
    hook = Hook("score", ("qk",), ("s2",), "t = qk * 2\ns2 = t + secret")
    assert undeclared_reads(hook, {"tl"}) == {"secret"}
    assert defined_names(hook) == {"t", "s2"}


def test_score_and_mask_hooks_carry_their_spec_line():
    context = kernel_context(analyze(attngen.parse_spec((ROOT / "specs" / "alibi_causal.attn").read_text())))
    assert str(context["fwd"]["score"]).startswith("# score: score + slopes[h] * (k - q)\n")
    assert str(context["fwd"]["mask"]).startswith("# mask: q >= k\n")
