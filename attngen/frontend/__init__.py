"""The front end: spec text to parse tree (parser), parse tree to typed IR (lower, with the number checks), IR back to text (printer), param overrides (checks.with_params)."""

import os
from pathlib import Path

from attngen import ir
from attngen.errors import ArgumentError, SpecError
from attngen.frontend import checks
from attngen.frontend.checks import with_params
from attngen.frontend.printer import expr_to_source
from attngen.frontend.lower import lower
from attngen.frontend.parser import parse


def parse_spec(text: str, filename: str = "<spec>") -> ir.Spec:
    """Spec text to IR; a SpecError carries the file name, position and source line. A leading
    byte order mark (as some editors save UTF-8) is not part of the spec."""
    text = text.removeprefix("\ufeff")
    try:
        return lower(parse(text))
    except SpecError as e:
        raise e.located(text, filename) from None


SpecLike = str | os.PathLike | ir.Spec


def load_spec(spec: SpecLike) -> tuple[ir.Spec, str]:
    """A Spec and the text to show for it, from a path, spec source text or a Spec."""
    if isinstance(spec, ir.Spec):
        # Built in Python, it may have skipped validation (model_copy, model_construct) and never met
        # lowering's number checks: run both here.
        spec = ir.revalidated(spec)
        for problem in checks.problems(spec)[:1]:
            raise ArgumentError(f"spec {spec.name!r}: {problem.message} (in '{expr_to_source(problem.node)}')")
        return spec, spec.model_dump_json(indent=2)
    if isinstance(spec, os.PathLike) or (isinstance(spec, str) and "\n" not in spec
                                         and not spec.lstrip().startswith("attention")):
        path = Path(spec)
        if not path.is_file():
            raise ArgumentError(f"spec must be a path to an .attn file, spec text or a Spec, "
                                f"got {str(spec)!r} (no such file)")
        text = _read_spec_file(path)
        return parse_spec(text, str(path)), text
    if isinstance(spec, str):
        return parse_spec(spec), spec
    raise ArgumentError(f"spec must be a path, spec text or a Spec, got {type(spec).__name__}")


def _read_spec_file(path: Path) -> str:
    """A spec file's text: UTF-8 whatever the locale, a leading byte order mark dropped."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        # The bytes before the bad one decode: count lines and characters in them.
        before = data[:e.start].decode("utf-8-sig")
        line, column = before.count("\n") + 1, len(before) - before.rfind("\n")
        raise ArgumentError(f"spec file {str(path)!r} must be UTF-8 text, got byte 0x{data[e.start]:02x} at "
                            f"line {line}, column {column} (byte offset {e.start})") from None


__all__ = ["SpecLike", "load_spec", "parse_spec", "with_params"]
