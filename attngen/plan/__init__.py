"""Planning: which kernel family and which tiles, warps and stages a spec gets on a target, and why."""

from attngen.plan.planner import (DTYPES, ELEMENT_BYTES, HEAD_DIMS, KERNELS, KernelPlan, Plan, Tiles, plan,
                                  plan_for)
from attngen.plan.targets import PRESETS, Target, detect_target, get_target

__all__ = ["DTYPES", "ELEMENT_BYTES", "HEAD_DIMS", "KERNELS", "PRESETS", "KernelPlan", "Plan", "Target", "Tiles",
           "detect_target", "get_target", "plan", "plan_for"]
