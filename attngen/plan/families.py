"""The kernel families' plan entries, in the registry's order (attngen.families), and the choice of those
that serve a spec on a target."""

from __future__ import annotations

import importlib
from functools import cache

from attngen import families as registry
from attngen.analysis import Analysis
from attngen.plan.family import KERNELS, Family
from attngen.plan.targets import Target

__all__ = ["KERNELS", "Family", "by_name", "choose_families"]  # and FAMILIES, loaded on first use



@cache
def _entries() -> tuple[Family, ...]:
    # Each family's entry is its folder's family.py (FAMILY), in the registry's order of preference. Loaded
    # on first use: an entry imports plan.family, which runs this package first.
    return tuple(importlib.import_module(f"attngen.families.{name}.family").FAMILY for name in registry.FAMILIES)


def __getattr__(name: str):
    # FAMILIES: every family's entry, in the registry's order (the last serves what the others do not).
    if name == "FAMILIES":
        return _entries()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def by_name(name: str) -> Family:
    """The family registered as `name`."""
    return next(family for family in _entries() if family.name == name)


def deterministic_backward(facts: Analysis, families: tuple[str, ...]) -> str:
    """Which backward a call in deterministic mode (the same bits run after run) runs, and how, for a module
    of these families (each entry's `deterministic` rule): what `attngen explain` says of it."""
    serving, passed = [], []
    for family in _entries():
        if family.name in families and family.deterministic is not None:
            serves, how = family.deterministic(facts)
            (serving if serves else passed).append((family.name, how))
    parts = [f"{name} for the calls its rule admits, {how}" for name, how in serving[:-1]]
    last, how = serving[-1]
    parts.append(f"{last} for the others ({how})" if parts else f"{last} ({how})")
    parts += [f"not {name}: {why}" for name, why in passed]
    if facts.spec.learnable_inputs:
        parts.append("learnable inputs' gradients summed exactly (int64 words of 24-bit digits), the same in any "
                     "order of their adds")
    return "; ".join(parts)


def choose_families(facts: Analysis, target: Target) -> tuple[tuple[Family, ...], str]:
    """The families of this spec's module on `target`, in order of preference (the last, which serves
    every call, last), and why (including why a family was passed over)."""
    chosen, reasons = [], []
    entries = _entries()
    last = entries[-1]
    for family in entries:
        problem = family.problem(facts, target)
        if problem is not None:
            reasons.append(f"not {family.name}: {problem}")
            continue
        chosen.append(family)
        scope = "" if family is last else f" ({'/'.join(family.kernels)} for {family.per_call})"
        reasons.append(f"{family.name}{scope}: {family.strength}")
    if not chosen or chosen[-1] is not last:
        raise RuntimeError(f"the {last.name} family must serve every spec on every target, last: {reasons}")
    return tuple(chosen), "; ".join(reasons)
