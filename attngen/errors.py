"""The errors attngen shows users: spec errors with a position and caret, and call-argument errors."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Position:
    """A span of spec text: 1-based line and columns, `end_column` exclusive."""
    line: int
    column: int
    end_column: int | None = None


class SpecError(Exception):
    """A spec that is wrong: reported as `file:line:col: message`, then the line and a caret."""

    def __init__(self, message: str, position: Position | None = None, *,
                 source: str | None = None, filename: str = "<spec>"):
        super().__init__(message)
        self.message = message
        self.position = position
        self.source = source
        self.filename = filename

    def located(self, source: str, filename: str) -> "SpecError":
        """The same error, attached to the text it was found in."""
        return SpecError(self.message, self.position, source=source, filename=filename)

    def __str__(self) -> str:
        if self.position is None:
            return f"{self.filename}: {self.message}"
        pos = self.position
        text = f"{self.filename}:{pos.line}:{pos.column}: {self.message}"
        lines = (self.source or "").splitlines()
        if 1 <= pos.line <= len(lines):
            line = lines[pos.line - 1]
            stripped = line.lstrip()
            indent = len(line) - len(stripped)
            end = pos.end_column if pos.end_column and pos.end_column > pos.column else pos.column + 1
            if pos.line and end > len(line) + 1:
                end = max(len(line) + 1, pos.column + 1)
            caret = " " * (pos.column - 1 - indent) + "^" * (end - pos.column)
            text += f"\n    {stripped}\n    {caret}"
        return text


class ArgumentError(ValueError):
    """A call or build argument that is wrong; the message names the argument."""


class IndexOutOfRange(ArgumentError):
    """The reference met an input indexed outside its extent (say `doc[q]` with doc sized KV_LEN and
    Q_LEN > KV_LEN): the spec does not define attention for these sizes and inputs."""


class SpecWarning(UserWarning):
    """A spec that is legal but almost certainly not what was meant (a mask that allows no key)."""
