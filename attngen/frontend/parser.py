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
    "PERCENT": "'%'", "COMP_OP": "a comparison", "LEARNABLE": "'learnable'", "_LSHIFT": "'<<'", "_RSHIFT": "'>>'",
}
_BRACKETS_OPEN = {"LPAR", "LSQB"}
# Spec text is untrusted: its size is bounded, so that parsing and everything after it (linear in
# the text) ends in seconds. A person's spec is a few hundred characters.
MAX_SOURCE_CHARS = 1_000_000
_BRACKETS_CLOSE = {"RPAR", "RSQB"}
# Operators of C, Python's bitwise ones and conditional expressions, which the language spells in words:
# (what was written, what to write instead), longest first.
_FOREIGN_OPERATORS = [("&&", "'and'"), ("||", "'or'"), ("!", "'not'"), ("?", "where(cond, a, b)")]
_FOREIGN_WORDS = {"if": "where(cond, a, b)", "else": "where(cond, a, b)"}


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
    grammar = resources.files("attngen").joinpath("frontend/grammar/attn.lark").read_text(encoding="utf-8")
    return Lark(grammar, parser="lalr", propagate_positions=True, maybe_placeholders=True,
                postlex=_JoinBracketedLines())


def _terminal_text(name: str) -> str:
    if name in _TERMINAL_TEXT:
        return _TERMINAL_TEXT[name]
    # Keywords and anonymous operators ('//', '**'): show the literal text, not lark's name for it.
    pattern = next((t.pattern for t in _parser().terminals if t.name == name), None)
    return f"'{pattern.value}'" if pattern is not None and pattern.type == "str" else name.lower()


def _describe_expected(expected) -> str:
    return ", ".join(sorted({_terminal_text(t) for t in expected}))


def _open_brackets(source: str, before: int | None = None) -> list[Token]:
    """The brackets still open at offset `before` (the end of the text if None), innermost last."""
    stack: list[Token] = []
    for token in _parser().lex(source):
        if before is not None and token.start_pos >= before:
            break
        if token.type in _BRACKETS_OPEN:
            stack.append(token)
        elif token.type in _BRACKETS_CLOSE and stack:
            stack.pop()
    return stack


def _unclosed(bracket: Token, expected: str, source: str) -> SpecError:
    # The file ended inside brackets: the bracket left open is the text to show, not the end of file.
    return SpecError(f"'{bracket}' is never closed (unexpected end of file; expected {expected})",
                     Position(bracket.line, bracket.column, bracket.column + 1), source=source)


def _token_text(token: Token) -> str:
    if token.type == "_NL":
        return "end of line"
    if token.type == "$END":
        return "end of file"
    return f"'{token}'"


def _foreign_word(source: str, at: Token) -> Token | None:
    """The first 'if' or 'else' up to the token a syntax error stopped at: a conditional expression,
    which reads as names (they can never be declared: they are Python keywords) until it breaks."""
    for token in _parser().lex(source):
        if token.type == "NAME" and token.value in _FOREIGN_WORDS:
            return token
        if token.start_pos is not None and at.start_pos is not None and token.start_pos >= at.start_pos:
            return None
    return None


def parse(source: str) -> Tree:
    """Parse spec text; raise SpecError at the first syntax error, or at the first character past
    MAX_SOURCE_CHARS."""
    if len(source) > MAX_SOURCE_CHARS:
        line = source.count("\n", 0, MAX_SOURCE_CHARS) + 1
        column = MAX_SOURCE_CHARS - source.rfind("\n", 0, MAX_SOURCE_CHARS)
        raise SpecError(f"spec text must be at most {MAX_SOURCE_CHARS} characters, got {len(source)}",
                        Position(line, column), source=source)
    try:
        return _parser().parse(source)
    except UnexpectedCharacters as e:
        char = source[e.pos_in_stream] if e.pos_in_stream < len(source) else ""
        for written, instead in _FOREIGN_OPERATORS:
            if source.startswith(written, e.pos_in_stream):
                raise SpecError(f"unexpected '{written}'; use {instead}",
                                Position(e.line, e.column, e.column + len(written)), source=source) from None
        raise SpecError(f"unexpected character {char!r}", Position(e.line, e.column, e.column + 1),
                        source=source) from None
    except UnexpectedToken as e:
        token = e.token
        # `&&` and `||` lex as two operators, and the second is the one the parser does not take.
        doubled = source[token.start_pos - 1:token.start_pos + 1] if token.start_pos else ""
        if doubled in ("&&", "||"):
            instead = dict(_FOREIGN_OPERATORS)[doubled]
            raise SpecError(f"unexpected '{doubled}'; use {instead}",
                            Position(token.line, token.column - 1, token.column + 1), source=source) from None
        word = _foreign_word(source, token)
        if word is not None:
            raise SpecError(f"unexpected '{word}'; use {_FOREIGN_WORDS[word.value]}",
                            Position(word.line, word.column, word.column + len(word)), source=source) from None
        # accepts (what the parser state really takes) is exact; expected may list terminals
        # of merged LALR states, such as ')' where no bracket is open.
        expected = _describe_expected(e.accepts or e.expected)
        if token.type == "$END":
            opened = _open_brackets(source)
            if opened:
                raise _unclosed(opened[-1], expected, source) from None
            line = max(1, len(source.splitlines()))
            column = len(source.splitlines()[-1]) + 1 if source.splitlines() else 1
            raise SpecError(f"unexpected end of file; expected {expected}",
                            Position(line, column), source=source) from None
        line, column = token.line, token.column
        width = len(token.value) if token.type != "_NL" else 1
        note = ""
        opened = _open_brackets(source, token.start_pos)
        # Line breaks inside brackets are joined, so an unclosed bracket makes the next item
        # read as more of the expression: name the bracket, not just the token.
        if opened and opened[-1].line < line:
            b = opened[-1]
            note = f" (the '{b}' at line {b.line}, column {b.column} is still open)"
        raise SpecError(f"unexpected {_token_text(token)}; expected {expected}{note}",
                        Position(line, column, column + width), source=source) from None
    except UnexpectedEOF as e:
        expected = _describe_expected(e.expected)
        opened = _open_brackets(source)
        if opened:
            raise _unclosed(opened[-1], expected, source) from None
        lines = source.splitlines() or [""]
        raise SpecError(f"unexpected end of file; expected {expected}",
                        Position(len(lines), len(lines[-1]) + 1), source=source) from None
    except UnexpectedInput as e:  # pragma: no cover - every lark error is one of the above
        raise SpecError(str(e), Position(e.line, e.column), source=source) from None
