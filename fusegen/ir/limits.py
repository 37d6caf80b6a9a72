"""How much work one op may cost: limits on the work, not on the text.

A short expression can ask for a lot: `maximum` nested seven deep is 85 characters, and a
@fused body of ten lines `y = y*y + 1` is a graph of 20 operations whose every path, written
out, is thousands. So besides the parser's limits on the text (parse.py), every op is
bounded by what its derivation builds and emits:

- MAX_GRAPH_NODES: distinct operations (DAG nodes, shared subexpressions counted once) in
  the forward and the gradients of the op and of its auxiliary ops (`<name>_grad2`,
  `<name>_jvp`), and the gradient terms the reverse pass carries on the way;
- MAX_SOURCE_BYTES: the op's generated source (its own files, not the shared helpers);
- MAX_ROW_VALUES: the values per row a row op's kernel accumulates (ir/rows.py);
- a deadline, FUSEGEN_MAX_DERIVE_SECONDS (DEFAULT_DERIVE_SECONDS; `inf` turns it off),
  checked inside the derivation's loops, so nothing runs on for minutes. It counts the
  derivation's own CPU time (time.thread_time), so a busy machine does not make an op
  that derives in time on an idle one fail.

Each raises LimitError, which names the limit and its value. A derivation runs in one
`scope()`: api.generate opens it for the whole family, and differentiate and the reverse
pass open one when called on their own.
"""

from __future__ import annotations

import contextvars
import math
import os
import time
from contextlib import contextmanager

from fusegen.errors import LimitError

MAX_GRAPH_NODES = 10_000
# Outputs of one op: the forward kernel's operands are its outputs and inputs, and the
# vector kernels mark each operand's access in one bit of 32 (fusegen-runtime.h).
MAX_OUTPUTS = 8
# Operands of a loop the runtime's launchers run for an op on the NVRTC route
# (kMaxLaunchedOperands, fusegen-runtime.h); an op of more keeps launchers of its own.
MAX_LAUNCHED_OPERANDS = 32
MAX_SOURCE_BYTES = 4_000_000
# Values per row of a row op's kernel (its reductions' accumulators): each thread holds them
# all, and a block combines them through shared memory (8 warps x 64 doubles: 4 KiB).
MAX_ROW_VALUES = 64
DEFAULT_DERIVE_SECONDS = 5.0
SECONDS_ENV = "FUSEGEN_MAX_DERIVE_SECONDS"


def derive_seconds() -> float:
    """The deadline in seconds, from FUSEGEN_MAX_DERIVE_SECONDS (a positive number or `inf`)."""
    text = os.environ.get(SECONDS_ENV, "").strip()
    if not text:
        return DEFAULT_DERIVE_SECONDS
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0:  # NaN, zero and negatives alike
        raise LimitError(f"{SECONDS_ENV} must be a positive number of seconds (or inf), got {text!r}",
                         SECONDS_ENV, text)
    return value


class Budget:
    """The work one derivation has left: its deadline and the operations built so far."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.end = time.thread_time() + seconds
        self.nodes = 0
        self.op: str | None = None      # the op the derivation is for, for the messages

    def _who(self) -> str:
        return f"fusegen op '{self.op}'" if self.op else "fusegen"

    def check_time(self):
        if time.thread_time() > self.end:
            raise LimitError(f"{self._who()}: deriving it took more than {self.seconds:g} s of CPU time "
                             f"(the limit {SECONDS_ENV}={self.seconds:g}); simplify the expression, "
                             f"or raise {SECONDS_ENV}", SECONDS_ENV, self.seconds)

    def check_nodes(self, needed: int, what: str):
        """`needed` operations more than counted so far would be too many."""
        if self.nodes + needed > MAX_GRAPH_NODES:
            raise LimitError(f"{self._who()}: {what} would have more than {MAX_GRAPH_NODES} operations "
                             f"(the limit MAX_GRAPH_NODES={MAX_GRAPH_NODES} on the distinct operations "
                             "of an op's forward and gradients, its _grad2 and _jvp ops included); "
                             "simplify the expression, or split it into several ops",
                             "MAX_GRAPH_NODES", MAX_GRAPH_NODES)

    def add_nodes(self, count: int, what: str):
        self.check_nodes(count, what)
        self.nodes += count


_CURRENT: contextvars.ContextVar[Budget | None] = contextvars.ContextVar("fusegen_budget", default=None)


def current() -> Budget | None:
    return _CURRENT.get()


@contextmanager
def scope(op: str | None = None):
    """The budget of one derivation: the one already open, or a new one for this call.
    A RecursionError inside (a sympy walk fusegen does not own) becomes a LimitError."""
    budget = _CURRENT.get()
    if budget is not None:
        if budget.op is None:
            budget.op = op
        yield budget
        return
    budget = Budget(derive_seconds())
    budget.op = op
    token = _CURRENT.set(budget)
    try:
        yield budget
    except RecursionError:
        raise LimitError(f"{budget._who()}: the expression is nested too deeply "
                         "(Python's recursion limit); simplify it, or split it into several ops",
                         "recursion", None) from None
    finally:
        _CURRENT.reset(token)


def tick():
    """The deadline check of a loop: nothing when no derivation is open."""
    budget = _CURRENT.get()
    if budget is not None and time.thread_time() > budget.end:
        budget.check_time()


def check_source(op: str, files: dict[str, str], shared=()):
    """The op's own generated files (not the `shared` helpers) must stay under MAX_SOURCE_BYTES."""
    size = sum(len(text.encode()) for name, text in files.items() if name not in shared)
    if size > MAX_SOURCE_BYTES:
        raise LimitError(f"fusegen op '{op}': its generated source is {size} bytes, over the limit "
                         f"MAX_SOURCE_BYTES={MAX_SOURCE_BYTES}; simplify the expression, or split it "
                         "into several ops", "MAX_SOURCE_BYTES", MAX_SOURCE_BYTES)
