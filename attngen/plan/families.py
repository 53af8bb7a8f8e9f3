"""The kernel families, each a folder of templates under attngen/emit/families/ with its entry here: which targets and specs it serves, and why."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from attngen.analysis import Analysis
from attngen.plan.targets import Target


@dataclass(frozen=True)
class Family:
    """A kernel family: `name` is its template folder; `problem(analysis, target)` says why it cannot
    serve that spec on that target (None: it can), `strength` why it is chosen when it can."""
    name: str
    strength: str
    problem: Callable[[Analysis, Target], str | None]


PORTABLE = Family(
    name="portable",
    strength=("FlashAttention-2-style Triton kernels (tl.dot, software-pipelined loads): any CUDA GPU and "
              "Triton's interpreter"),
    problem=lambda facts, target: None,
)

# In order of preference: the first family that can serve a spec on a target gets it.
FAMILIES: tuple[Family, ...] = (PORTABLE,)


def choose_family(facts: Analysis, target: Target) -> tuple[Family, str]:
    """The family for this spec on `target`, and why (including why each preferred one could not)."""
    passed_over = []
    for family in FAMILIES:
        problem = family.problem(facts, target)
        if problem is None:
            return family, "; ".join([*passed_over, family.strength])
        passed_over.append(f"not {family.name}: {problem}")
    raise AssertionError("the portable family serves every spec on every target")
