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
