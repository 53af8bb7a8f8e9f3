"""Parses .attn text into a lark parse tree, turning lark's errors into positioned SpecErrors."""

from __future__ import annotations

from functools import lru_cache
from importlib import resources

from lark import Lark, Token, Tree
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from attngen.errors import Position, SpecError

# How a terminal is shown in "expected ..." messages.
_TERMINAL_TEXT = {
    "NAME": "a name", "NUMBER": "a number", "_NL": "a new line", "$END": "end of file",
    "LPAR": "'('", "RPAR": "')'", "LSQB": "'['", "RSQB": "']'", "COMMA": "','", "COLON": "':'",
    "EQUAL": "'='", "MINUS": "'-'", "PLUS": "'+'", "STAR": "'*'", "SLASH": "'/'",
    "PERCENT": "'%'", "COMP_OP": "a comparison", "LEARNABLE": "'learnable'",
}
_BRACKETS_OPEN = {"LPAR", "LSQB"}
_BRACKETS_CLOSE = {"RPAR", "RSQB"}


class _JoinBracketedLines:
    """Drops line breaks inside brackets, so an expression may span several lines there."""

    always_accept = ("_NL",)

    def process(self, stream):
        depth = 0
        for token in stream:
            if token.type in _BRACKETS_OPEN:
                depth += 1
            elif token.type in _BRACKETS_CLOSE:
                depth = max(0, depth - 1)
            elif token.type == "_NL" and depth > 0:
                continue
            yield token


@lru_cache(maxsize=1)
def _parser() -> Lark:
    grammar = resources.files("attngen").joinpath("grammar/attn.lark").read_text()
    return Lark(grammar, parser="lalr", propagate_positions=True, maybe_placeholders=True,
                postlex=_JoinBracketedLines())


def _describe_expected(expected) -> str:
    names = sorted({_TERMINAL_TEXT.get(t, f"'{t.lower()}'" if t.isupper() else t) for t in expected})
    return ", ".join(names)


def _token_text(token: Token) -> str:
    if token.type == "_NL":
        return "end of line"
    if token.type == "$END":
        return "end of file"
    return f"'{token}'"


def parse(source: str) -> Tree:
    """Parse spec text; raise SpecError at the first syntax error."""
    try:
        return _parser().parse(source)
    except UnexpectedCharacters as e:
        char = source[e.pos_in_stream] if e.pos_in_stream < len(source) else ""
        raise SpecError(f"unexpected character {char!r}", Position(e.line, e.column, e.column + 1),
                        source=source) from None
    except UnexpectedToken as e:
        token = e.token
        if token.type == "$END":
            line = max(1, len(source.splitlines()))
            column = len(source.splitlines()[-1]) + 1 if source.splitlines() else 1
            raise SpecError(f"unexpected end of file; expected {_describe_expected(e.expected)}",
                            Position(line, column), source=source) from None
        line, column = token.line, token.column
        width = len(token.value) if token.type != "_NL" else 1
        raise SpecError(f"unexpected {_token_text(token)}; expected {_describe_expected(e.expected)}",
                        Position(line, column, column + width), source=source) from None
    except UnexpectedEOF as e:
        lines = source.splitlines() or [""]
        raise SpecError(f"unexpected end of file; expected {_describe_expected(e.expected)}",
                        Position(len(lines), len(lines[-1]) + 1), source=source) from None
    except UnexpectedInput as e:  # pragma: no cover - every lark error is one of the above
        raise SpecError(str(e), Position(e.line, e.column), source=source) from None
