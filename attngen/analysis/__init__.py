"""Analysis: every fact about a spec that planning, emission and the reports need, computed once by `analyze`."""

from attngen.analysis.analyze import Analysis, analyze

__all__ = ["Analysis", "analyze"]
