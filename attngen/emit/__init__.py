"""Emission: an analysed spec and its plan to the source text of a standalone kernel module."""

from attngen.emit.module import comment_lines, render

__all__ = ["comment_lines", "render"]
