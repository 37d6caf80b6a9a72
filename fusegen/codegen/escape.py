"""User text into generated code: one escaper per context, and nothing else writes it.

The expression, the regenerate command (a CLI line, a `Request.command`, a function's
`__module__` and `__qualname__` for @fused), the gradients' notation and the names reach
the generated C++ and the packaged Python. Identifiers (names.py) go in bare, after
validation; every other string goes through exactly one of these:

    c_comment(text)  the body of a `//` or `/* */` comment, on one line
    c_string(text)   a C/C++ string literal, quotes included
    py_string(text)  a Python string literal

Each keeps ordinary text as written (so the golden files read naturally) and escapes what
could end the context early: for a comment a line break (which ends a `//` comment, after
which the rest compiles as code), a backslash or trigraph `??/` before the line's end
(which splices the next line into the comment), `*/` (which ends a block comment) and
`/*` (which GCC warns about inside one); for a
string literal a quote, a backslash, a line break and the trigraph `??`.
"""

from __future__ import annotations

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _is_plain(ch: str) -> bool:
    """Printable ASCII: the only characters either C escaper writes as they are."""
    return " " <= ch <= "~"


def c_comment(text: str) -> str:
    """`text` as comment text on one line: printable ASCII as written, a backslash as `\\\\`,
    line breaks and tabs as `\\n`, `\\r`, `\\t`, any other character as the `\\xNN` of its
    UTF-8 bytes; `/` after `*`, `*` after `/` and `?` after `?` as `\\x2f`, `\\x2a`, `\\x3f`
    (no `*/` ends a block comment, no `/*` inside one draws a warning, no trigraph);
    trailing blanks dropped and a final backslash written `\\x5c`, so that nothing splices
    the next line in (GCC splices a backslash, blanks and a line break too)."""
    text = _text(text).rstrip(" ")
    out = []
    for i, ch in enumerate(text):
        prev = text[i - 1] if i else ""
        if ch == "\\":
            out.append("\\x5c" if i == len(text) - 1 else "\\\\")
        elif (ch == "/" and prev == "*") or (ch == "*" and prev == "/") or (ch == "?" and prev == "?"):
            out.append(f"\\x{ord(ch):02x}")
        elif _is_plain(ch):
            out.append(ch)
        elif ch in _NAMED:
            out.append(_NAMED[ch])
        else:
            out.append("".join(f"\\x{b:02x}" for b in ch.encode("utf-8", "surrogatepass")))
    return "".join(out)


def c_string(text: str) -> str:
    """A C/C++ string literal, quotes included, whose bytes are `text`'s UTF-8: printable
    ASCII as written but `"` and `\\` escaped and `?` after `?` as `\\?` (no trigraph);
    line breaks and tabs named; every other byte as a three-digit octal escape, which,
    unlike `\\x`, cannot take a following digit into it."""
    out = ['"']
    prev = ""
    for ch in _text(text):
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "?" and prev == "?":
            out.append("\\?")
        elif _is_plain(ch):
            out.append(ch)
        elif ch in _NAMED:
            out.append(_NAMED[ch])
        else:
            out.append("".join(f"\\{b:03o}" for b in ch.encode("utf-8", "surrogatepass")))
        prev = ch
    out.append('"')
    return "".join(out)


def py_string(text: str) -> str:
    """A Python string literal whose value is `text`: str's own repr, which escapes quotes,
    backslashes and line breaks (never a subclass's __repr__)."""
    return str.__repr__(_text(text))


def py_strings(items) -> str:
    """A Python tuple literal of strings: `("a", "b")`, one string `("a",)`, none `()`."""
    parts = [py_string(x) for x in items]
    return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"


def _text(text) -> str:
    if not isinstance(text, str):
        raise TypeError(f"expected text (str), got {type(text).__name__}")
    return str.__str__(text)
