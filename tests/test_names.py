"""Any identifier a user may write is a valid input, scalar or op name (names.py): only
C++/CUDA keywords and `__`-prefixed names are refused. Each case below broke the build or
was refused before user names got their own C namespace (`in_x`, `grad_x`, `op_<name>`).

One library holds every case; each matches eager forward and backward, and every `.cu`
compiles with nvcc."""

from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from fusegen.ir import names
from fusegen.api import Request, fuse_many, generate
from fusegen.errors import FusegenError
from fusegen.files import runtime_files, write
from fusegen.frontend.parse import parse

# (op name, expression, scalars, eager oracle over (*tensors, *scalars))
CASES = [
    ("quad", "p*x**2 + q*x + r", (), lambda p, x, q, r: p * x ** 2 + q * x + r),
    ("v", "v*k + n*i - e", (), lambda v, k, n, i, e: v * k + n * i - e),
    ("first", "first*dtype + grad_x*x_v - layout*op", (),
     lambda first, dtype, grad_x, x_v, layout, op: first * dtype + grad_x * x_v - layout * op),
    ("grad", "grad*out + t0*n - stream*self + m", (),
     lambda grad, out, t0, n, stream, self, m: grad * out + t0 * n - stream * self + m),
    ("out", "dout*output_mask + in_x*ptr_x*outputs", (),
     lambda dout, output_mask, in_x, ptr_x, outputs: dout * output_mask + in_x * ptr_x * outputs),
    # Macros and library names of the headers the generated code includes.
    ("expf", "INFINITY*NAN + TORCH_CHECK*FUSEGEN_H_ - std*at + half*c10", (),
     lambda INFINITY, NAN, TORCH_CHECK, FUSEGEN_H_, std, at, half, c10:
         INFINITY * NAN + TORCH_CHECK * FUSEGEN_H_ - std * at + half * c10),
    # Function names used as names, and locals of the generated code as scalars.
    ("int64_t", "exp*sigmoid(pi) + scalar_t*kVec", ("kVec",),
     lambda exp, pi, scalar_t, kVec: exp * torch.sigmoid(pi) + scalar_t * kVec),
    ("forward", "forward*flat + backward*tag", ("tag",),
     lambda forward, flat, backward, tag: forward * flat + backward * tag),
    ("in_forward", "vec_a*gval_x + gvec_b*acc_t", ("acc_t",),
     lambda vec_a, gval_x, gvec_b, acc_t: vec_a * gval_x + gvec_b * acc_t),
]
SCALAR_VALUE = 0.75


@pytest.fixture(scope="module")
def ops():
    made = fuse_many([Request(expr, name=f"nm_{name}", scalars=scalars) for name, expr, scalars, _ in CASES])
    return dict(zip([c[0] for c in CASES], made))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_any_name_builds_and_matches_eager(ops, case):
    name, _, scalars, eager = case
    op = ops[name]
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(37, generator=g, dtype=torch.float64, requires_grad=True) for _ in op.spec.inputs]
    values = [SCALAR_VALUE] * len(scalars)
    got = op(*tensors, *values)
    want = eager(*tensors, *values)
    torch.testing.assert_close(got, want)
    dout = torch.randn(37, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(got, tensors, dout), torch.autograd.grad(want, tensors, dout)):
        torch.testing.assert_close(a, b)


def test_op_names_that_read_like_c_identifiers():
    """Op names, too: each becomes the namespace fusegen::op_<name>."""
    made = fuse_many([Request("x*y", name=n) for n in ("sin", "std", "Tensor", "main", "fusegen")])
    x, y = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    for op in made:
        torch.testing.assert_close(op(x, y), x * y)


@pytest.mark.parametrize("bad, why", [("int", "keyword"), ("class", "keyword"), ("__x", "'__'"),
                                      ("threadIdx", "keyword")])
def test_only_keywords_and_double_underscore_are_refused(bad, why):
    with pytest.raises(FusegenError, match=why):
        parse(f"{bad}*2" if bad != "class" else "x*2", scalars=[bad] if bad == "class" else ())


def test_the_runtime_folder_is_not_an_op_name():
    """generated/_runtime/ holds the runtime beside the op folders: no op may take its name."""
    with pytest.raises(FusegenError, match="reserved"):
        generate(Request("x*2", name=names.RUNTIME_FOLDER))
    assert generate(Request("x*2", name="_runtime2")).spec.name == "_runtime2"


def test_locals_cannot_collide_with_a_user_name():
    """A user's name x appears in C only as <role>_x; no local of the generated code has
    that shape, so no user name can reach it."""
    for local in names.LOCALS:
        assert not any(local.startswith(role + "_") for role in names.ROLES), local
    assert all("_" not in role for role in names.ROLES)
    assert names.DOUT in names.LOCALS


@pytest.mark.slow
def test_every_cu_compiles_with_nvcc(tmp_path):
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
    if nvcc is None:
        if os.environ.get("CI") == "true":
            pytest.fail("nvcc not found: CI must compile the generated CUDA sources")
        pytest.skip("nvcc not found")
    units = []
    for name, expr, scalars, _ in CASES:
        folder = tmp_path / name
        folder.mkdir()
        for fname, text in generate(Request(expr, name=f"nm_{name}", scalars=scalars)).files.items():
            (folder / fname).write_text(text)
        write(runtime_files(), folder)
        units.append(folder / f"nm_{name}.cu")

    def compile_one(cu):
        return subprocess.run([nvcc, "-std=c++17", "-O1", "-gencode=arch=compute_90,code=sm_90", "-Werror",
                               "all-warnings", "-c", str(cu), "-o", str(cu.with_suffix(".o"))],
                              capture_output=True, text=True)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = list(pool.map(compile_one, units))
    failures = [f"{cu}:\n{r.stderr}" for cu, r in zip(units, results) if r.returncode or r.stderr.strip()]
    assert not failures, "\n\n".join(failures)
