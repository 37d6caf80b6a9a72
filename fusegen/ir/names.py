"""Every identifier the generated C++ declares: one table, read by the parser and the renderer.

A user may name an input, a scalar or an op with any identifier except a C/C++/CUDA
keyword or a `__`-prefixed name (reserved for the implementation). So that no such name
can collide with the generated code's own names, with another user name's derived names,
or with a function or macro of the headers the code includes (`expf`, `INFINITY`,
`int64_t`, ...), a user's name never appears bare in C: it appears as `<role>_<name>`,
where `<role>` is one of ROLES. A role has no underscore, so `<role>_<name>` decodes to
exactly one (role, name) pair; and none of the generated code's own names (LOCALS) starts
with a role and an underscore. An op's code lives in the namespace `fusegen::op_<op name>`,
so ops bundled into one translation unit never collide either.

The forward schema keeps the user's names (they are the op's keyword arguments in
Python); the backward schema uses the C names, since it also has `dout` and `output_mask`.
"""

from __future__ import annotations

import keyword
import re

from fusegen import files
from fusegen.errors import SpecError

# role -> what an identifier `<role>_<name>` holds.
ROLES = {
    "in": "the value of input or scalar <name>: math parameter, functor member, schema name",
    "grad": "the gradient of input <name>: math result, schema name",
}

# The generated code's own local names. None may start with `<role>_` (tests check).
# (`output_mask` and `dout` are also the backward schema's own argument names.)
LOCALS = frozenset("""
    out dout n scalar_t acc_t tag grads output_mask stream dtype scalars forward backward
    forward_cpu backward_cpu forward_cuda backward_cuda forward_cuda_fp16 backward_cuda_fp16
    forward_cuda_bf16 backward_cuda_bf16
    forward_cuda_functor backward_cuda_functor kDef registered describe def kInputNames
    kScalarNames kBackwardInputs kBackwardInputNames kBackwardScalars kGrads kDoutSteps kJvpArgs kJvpScalars
    Forward Backward
    kInputs kOutputs x y zero data strides loop T
    row acc other v kRows kPasses init pass combine finish per_row pass_begin
    u kRandom random kProbabilities rng_state
    raw kRaw SavedBackward saved_backward saved_backward_cpu saved_backward_cuda
    saved_backward_cuda_fp16 saved_backward_cuda_bf16 saved_backward_cuda_functor
""".split())

# Temporaries of the straight-line math: t0, t1, ... (`t` is not a role).
TEMP_PREFIX = "t"
# A row op's values per row, row0, row1, ... in the IR (ir/rows.py); `row[k]` in C.
ROW_PREFIX = "row"
# The forward's row values its backward reads (saved0, saved1, ...): extra outputs of the
# forward's functor and per-row inputs of the backward's (ir/rows.py, `saved_rows`).
SAVED_ROW_PREFIX = "saved"

# The incoming gradient (d loss / d out) in the math and the backward schema; an op of
# several outputs has one per output, dout0, dout1, ... (dout()).
DOUT = "dout"
_DOUT_K = re.compile(r"dout[0-9]+")


# An op's random streams in the math and its functors' parameters: rand0, rand1, ...
RANDOM_PREFIX = "rand"
_RANDOM_K = re.compile(r"rand[0-9]+")


def random(k: int) -> str:
    """The uniform of random stream k (primitives.random_stream)."""
    return f"{RANDOM_PREFIX}{k}"


def is_random(name: str) -> bool:
    return _RANDOM_K.fullmatch(name) is not None


def dout(k: int) -> str:
    """The incoming gradient of output k of an op of several outputs."""
    return f"{DOUT}{k}"


def is_dout(name: str) -> bool:
    return name == DOUT or _DOUT_K.fullmatch(name) is not None


def output(k: int, count: int) -> str:
    """The C name of the forward's output k of `count`: `out` for one, `out0`, ... for several."""
    return "out" if count == 1 else f"out{k}"

# The forward's output when the backward reads it instead of inputs (spec._plan): a name
# beside the user's (fresh() adds `_` on a clash), so it is `in_result` in C, as
# derivatives.yaml calls it `result`.
SAVED_OUTPUT = "result"

# The ops fusegen registers beside a user's op <name> (spec.py derives them, api.py builds
# them into the op's library, autograd.py uses them):
#   <name>_backward        the vector-Jacobian product (first-order gradients), one kernel;
#   <name>_grad2           h(dout, x, gg) = sum_k gg_k * grad_k(dout, x): its backward
#   <name>_grad2_backward  is the derivative of <name>_backward (double backward), one kernel;
#   <name>_jvp             sum_i t_i * d<name>/dx_i: forward-mode AD (jvp), one kernel;
#   <name>_jvp_backward    its backward (reverse over forward).
# So a user's op name may not end in any of these suffixes.
BACKWARD_SUFFIX = "_backward"
GRAD2_SUFFIX = "_grad2"
JVP_SUFFIX = "_jvp"
RESERVED_SUFFIXES = (BACKWARD_SUFFIX, GRAD2_SUFFIX, JVP_SUFFIX)

# The folder beside the op folders that holds the one copy of the runtime they build with
# (generated/_runtime/): no op may be called so, or its folder would be the runtime's.
RUNTIME_FOLDER = files.RUNTIME_FOLDER

# Input names of the auxiliary ops beside the user's names: <name>_grad2's incoming
# gradients keep their own (DOUT, dout()), then the gradient arriving at grad_<x> (gg_<x>)
# and the tangent of <x> (t_<x>). A user's name spelled the same gets a trailing `_` added
# until unique (fresh()).
GRAD2_GG = "gg_{}"
JVP_TANGENT = "t_{}"

# C, C++ and CUDA keywords and the CUDA built-in variables: a name may not be one, because
# the forward schema and the error messages spell it as written, and a reader would stumble.
C_KEYWORDS = frozenset("""
    alignas alignof and and_eq asm auto bitand bitor bool break case catch char char8_t
    char16_t char32_t class compl concept const consteval constexpr constinit const_cast
    continue co_await co_return co_yield decltype default delete do double dynamic_cast else
    enum explicit export extern false float for friend goto if inline int long mutable
    namespace new noexcept not not_eq nullptr operator or or_eq private protected public
    register reinterpret_cast requires restrict return short signed sizeof static
    static_assert static_cast struct switch template this thread_local throw true try typedef
    typeid typename union unsigned using virtual void volatile wchar_t while xor xor_eq
    threadIdx blockIdx blockDim gridDim warpSize
""".split())

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def name_problem(name: object) -> str | None:
    """Why `name` cannot be a user's input, scalar or op name, or None when it can."""
    if not isinstance(name, str) or not _IDENT.fullmatch(name):
        return "must be an ASCII identifier ([A-Za-z_][A-Za-z0-9_]*)"
    if name.startswith("__"):
        return "must not start with '__' (reserved in C++)"
    if name in C_KEYWORDS or keyword.iskeyword(name):
        return "is a C++/CUDA keyword; pick another name"
    return None


def check_identifier(name: object, what: str) -> str:
    problem = name_problem(name)
    if problem:
        raise SpecError(f"{what} {name!r} {problem}")
    return name


MAX_OP_NAME = 100  # characters: <name>_grad2.cpp and the cache's file names stay far below 255


def check_op_name(name: object) -> str:
    check_identifier(name, "op name")
    if len(name) > MAX_OP_NAME:
        raise SpecError(f"op name too long ({len(name)} characters, limit {MAX_OP_NAME}): it names "
                        f"files (<name>_grad2.cpp, ...); got {name[:40]}...")
    if name == RUNTIME_FOLDER:
        raise SpecError(f"name {name!r} is reserved: generated/{name}/ holds the runtime every op builds with")
    for suffix in RESERVED_SUFFIXES:
        if name.endswith(suffix):
            raise SpecError(f"name must not end in '{suffix}' (fusegen registers <name>{suffix} itself), "
                            f"got {name!r}")
    return name


def fresh(base: str, taken) -> str:
    """`base`, or `base_`, `base__`, ... : the first spelling not in `taken` (deterministic)."""
    while base in taken:
        base += "_"
    return base


def value(name: str) -> str:
    """`in_<name>`: the C name of input or scalar `name`."""
    return f"in_{name}"


def grad(name: str) -> str:
    """`grad_<name>`: the C name of input `name`'s gradient."""
    return f"grad_{name}"


def role(role_name: str, name: str) -> str:
    """`<role>_<name>` for any role in ROLES."""
    assert role_name in ROLES, role_name
    return f"{role_name}_{name}"


def c_renaming(user_names) -> dict:
    """Each user name's symbol -> its C name's (`x` -> `in_x`)."""
    import sympy

    return {sympy.Symbol(n, real=True): sympy.Symbol(value(n), real=True) for n in user_names}


def for_c(program, user_names):
    """`program` (a spec.Program) with every user name renamed to its C name (`x` -> `in_x`),
    ready for the C printer. The incoming gradient is already `dout` (primitives.GRAD)."""
    import sympy

    from fusegen.ir import dag

    rename = {sympy.Symbol(n, real=True): sympy.Symbol(value(n), real=True) for n in user_names}
    exprs = dag.substitute([e for _, e in program.temps] + [e for _, e in program.results], rename)
    temps = len(program.temps)
    return type(program)(
        temps=tuple((s, e) for (s, _), e in zip(program.temps, exprs)),
        results=tuple((r, e) for (r, _), e in zip(program.results, exprs[temps:])),
    )


def c_double(value: float) -> str:
    """A double literal that reads back as exactly `value` (inf and NaN included)."""
    import math
    if math.isnan(value):
        return "NAN"
    if math.isinf(value):
        return "INFINITY" if value > 0 else "-INFINITY"
    text = repr(float(value))
    return text if ("e" in text or "." in text) else text + ".0"


def op_namespace(op_name: str) -> str:
    """The C++ namespace (inside `fusegen`) that holds one op's code."""
    return f"op_{op_name}"
