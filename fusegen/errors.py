"""One exception class per stage. Each message names the culprit and says what was expected."""

from __future__ import annotations


class FusegenError(ValueError):
    """Base class of every error fusegen raises on purpose."""


class ParseError(FusegenError):
    """The expression text is not something fusegen accepts.

    The message quotes the expression with a caret under the offending column."""

    def __init__(self, message: str, expr: str, col: int | None = None, hint: str | None = None):
        self.expr, self.col, self.hint = expr, col, hint
        lines = [message, f"    {expr}"]
        if col is not None:
            lines.append("    " + " " * col + "^")
        if hint:
            lines.append(hint)
        super().__init__("\n".join(lines))


class SpecError(FusegenError):
    """The op's name, inputs or scalars are not valid (expected vs got in the message)."""


class BuildError(FusegenError):
    """The compiler failed. Carries the command, the log and the source paths."""

    def __init__(self, message: str, log: str = "", sources: tuple[str, ...] = ()):
        self.log, self.sources = log, sources
        text = message
        if sources:
            text += "\nsources:\n" + "\n".join(f"  {s}" for s in sources)
        if log:
            text += "\ncompiler log (last 60 lines):\n" + "\n".join(log.splitlines()[-60:])
        super().__init__(text)


class LoadError(FusegenError):
    """A built library could not be loaded, or its op clashes with one already loaded."""
