"""One exception class per stage. Each message names the culprit and says what was expected."""

from __future__ import annotations

from dataclasses import dataclass


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


@dataclass(frozen=True)
class CompilerError:
    """The first error in a compiler log: where (file may be None for a linker error), what,
    and the source line it points at when the file could be read."""
    file: str | None
    line: int | None
    col: int | None
    message: str
    source_line: str | None = None

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}: " if self.file else ""
        text = f"{where}error: {self.message}"
        if self.source_line is not None:
            gutter = f"    {self.line} | "
            text += f"\n{gutter}{self.source_line.expandtabs(8)}"
            if self.col:  # compilers count columns from 1
                text += "\n" + " " * (len(gutter) - 2) + "| " + " " * (self.col - 1) + "^"
        return text


class BuildError(FusegenError):
    """The compiler failed (or the cache could not be built in). Carries the log, the source
    paths, the first compiler error (`first_error`) and where the full log was kept
    (`log_path`). The message is the first error and its source line, not the whole log."""

    def __init__(self, message: str, log: str = "", sources: tuple[str, ...] = (),
                 first_error: CompilerError | None = None, log_path: str | None = None):
        self.log, self.sources = log, sources
        self.first_error, self.log_path = first_error, log_path
        text = message
        if first_error is not None:
            text += f": {first_error}"
        elif log:  # no error line recognised: the end of the log is the best clue
            text += "\ncompiler log (last 20 lines):\n" + "\n".join(log.splitlines()[-20:])
        if log_path:
            text += f"\nfull compiler log: {log_path} (the sources are beside it)"
        elif sources:
            text += "\nsources:\n" + "\n".join(f"  {s}" for s in sources)
        super().__init__(text)


class LoadError(FusegenError):
    """A built library could not be loaded, or its op clashes with one already loaded."""


class LimitError(FusegenError):
    """An op would cost more work than fusegen allows (limits.py): the message names the
    limit and its value; `limit` and `value` carry them."""

    def __init__(self, message: str, limit: str, value):
        self.limit, self.value = limit, value
        super().__init__(message)
