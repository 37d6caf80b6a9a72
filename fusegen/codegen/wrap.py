"""Generated C++ lines of at most WIDTH columns, as a careful hand would wrap them.

The templates keep their own lines short; what they paste can be long (an expression in a
comment, a function of many parameters, a schema string, the printed math), so each
rendered line longer than WIDTH is broken at a space: after a comma where there is one,
continued 4 columns deeper (`//` lines continue as comments, under their text). A break
inside a string literal closes it and opens the next line with the rest, which C++
concatenates. Preprocessor lines are never broken. Whitespace is all that changes, so the
code means the same; the output stays a pure function of the input.
"""

from __future__ import annotations

import re

WIDTH = 100
_COMMENT = re.compile(r"^(\s*)//(\s*)")


def wrap(text: str, width: int = WIDTH) -> str:
    out = []
    for line in text.split("\n"):
        out.extend(_wrap_line(line, width))
    return "\n".join(out)


def _wrap_line(line: str, width: int) -> list[str]:
    if len(line) <= width or line.lstrip().startswith("#"):
        return [line]
    comment = _COMMENT.match(line)
    if comment:
        return _wrap_comment(line, comment, width)
    indent = len(line) - len(line.lstrip())
    lines = []
    rest = line
    lead = " " * (indent + 4)
    while len(rest) > width:
        cut, quoted = _cut(rest, width, len(lead) if lines else indent)
        if cut is None:
            break
        head, tail = rest[:cut].rstrip(), rest[cut:].lstrip(" ")
        if quoted:  # a string literal continues on the next line
            head, tail = rest[:cut] + '"', '"' + rest[cut:]
        lines.append(head)
        rest = lead + tail
    lines.append(rest)
    return lines


def _cut(line: str, width: int, start: int) -> tuple[int | None, bool]:
    """Where to break `line` (an index of a space), and whether it lies in a string
    literal: after the last comma that fits, else at the last space that fits."""
    spaces, commas = [], []
    quote = None
    i = 0
    while i <= min(width, len(line) - 1):
        ch = line[i]
        if quote:
            if ch == "\\":
                i += 1  # an escaped character, never the literal's end
            elif ch == quote:
                quote = None
            elif ch == " " and quote == '"' and start + 8 < i < width - 1:
                spaces.append((i + 1, True))  # after the space: it stays in the first part
        elif ch in "\"'":
            quote = ch
        elif line.startswith("//", i):
            break  # a trailing comment: never broken into
        elif ch == " " and i > start:
            spaces.append((i, False))
            if line[i - 1] == ",":
                commas.append((i, False))
        i += 1
    for candidates in (commas, spaces):
        if candidates:
            return candidates[-1]
    return None, False


def _wrap_comment(line: str, match: re.Match, width: int) -> list[str]:
    lead = match.group(1) + "//" + match.group(2)
    words = line[len(lead):].split(" ")
    more = lead + "    "
    lines, current = [], lead
    for word in words:
        if current not in (lead, more) and len(current) + 1 + len(word) > width:
            lines.append(current)
            current = more
        current += ("" if current in (lead, more) else " ") + word
    lines.append(current)
    return lines
