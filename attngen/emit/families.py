"""The kernel families' emit sides, by registered name (attngen.families): each family's folder holds an
emit.py with its template's context (`context(facts)`), its kernels' signatures (`signatures(params)`), what
its module hands to the runtime (DECLARATION) and the device helpers its kernels import from its runtime
side (DEVICE_HELPERS)."""

from __future__ import annotations

import importlib
from types import ModuleType


def emit_side(name: str) -> ModuleType:
    """The emit side of the family registered as `name`."""
    return importlib.import_module(f"attngen.families.{name}.emit")
