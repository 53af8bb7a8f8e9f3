"""The front end: spec text to parse tree (parser), parse tree to typed IR (lower, with the number checks), IR back to text (printer)."""

from attngen import ir
from attngen.errors import SpecError
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


__all__ = ["parse_spec"]
