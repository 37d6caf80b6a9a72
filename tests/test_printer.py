"""The printer: exact C strings per compute type. No compiler, no GPU."""

from __future__ import annotations

import pytest
import sympy

from fusegen.ir import primitives as fn
from fusegen.frontend.parse import parse
from fusegen.ir.expr import symbol
from fusegen.codegen.printer import CPrinter, print_op, print_program
from fusegen.ir.spec import differentiate

x, y = symbol("x"), symbol("y")
F, D = CPrinter("float"), CPrinter("double")


def c(expr, ctype="float"):
    return (F if ctype == "float" else D).doprint(parse(expr).tree if isinstance(expr, str) else expr)


@pytest.mark.parametrize("func", ["exp", "expm1", "log", "log1p", "sin", "cos", "tan", "tanh", "atan",
                                  "erf", "erfc", "sqrt"])
def test_math_function_spelling_per_compute_type(func):
    assert c(f"{func}(x)") == f"{func}f(x)"
    assert c(f"{func}(x)", "double") == f"{func}(x)"


def test_rsqrt_is_one_over_sqrt():
    assert c("rsqrt(x)") == "1.0f/sqrtf(x)"
    assert c("rsqrt(x)", "double") == "1.0/sqrt(x)"


def test_float_literals_carry_the_suffix():
    assert c("2*x") == "2.0f*x"
    assert c("2*x", "double") == "2.0*x"
    assert c("x + 0.1") == "x + 0.1f"
    assert c("1e-30*x") == "1e-30f*x"
    assert c(sympy.Integer(3)) == "3.0f"


def test_square_and_cube_are_products():
    assert c("x**2") == "x*x"
    assert c("x**2.0") == "x*x"        # an integral float exponent is an integer
    assert c("x**3", "double") == "x*x*x"
    assert c("x**-2") == "1.0f/(x*x)"
    assert c("pow(x, 2)") == "x*x"


def test_square_inside_product_is_parenthesized():
    assert c("y/(x*x)") == "y/(x*x)"
    assert c("y/x**2") == "y/(x*x)"
    assert c("2*x**2+1") == "2.0f*(x*x) + 1.0f"


def test_other_powers():
    assert c("x**2.5") == "powf(x, 2.5f)"
    assert c("x**2.5", "double") == "pow(x, 2.5)"
    assert c("x**-3") == "powf(x, -3.0f)"    # torch multiplies only for 2, 3 and -2
    assert c("pow(x, y)") == "powf(x, y)"     # a varying exponent
    assert c("2**x") == "powf(2.0f, x)"
    assert c("x**0.5") == "sqrtf(x)" and c("x**-0.5") == "1.0f/sqrtf(x)" and c("x**-1") == "1.0f/x"
    assert c("x**1") == "x" and c("x**0") == "1.0f"  # torch copies / fills


def test_division_is_division():
    assert c("x/y") == "x/y"
    assert c("x/2") == "x/2.0f"
    assert c("x/(y*z)") == "x/(y*z)" and c("x/y/z") == "x/y/z"
    # Python's `number / tensor` is tensor.reciprocal() * number in eager
    assert c("1/x") == "1.0f/x"
    assert c("2/x") == "(1.0f/x)*2.0f"


def test_user_form_is_kept():
    """sympy's algebra would change values eager gives: none of it happens."""
    assert c("a*0") == "a*0.0f"
    assert c("a - a") == "a - a"
    assert c("exp(log(x))") == "expf(logf(x))"
    assert c("sqrt(x*x)") == "sqrtf(x*x)"
    assert c("minimum(minimum(a, b), c)") == "fusegen::minimum(fusegen::minimum(a, b), c)"
    assert c("a + (b + c)") == "a + (b + c)" and c("a - (b - c)") == "a - (b - c)"
    assert c("a*b*c") == "a*b*c" and c("a*(b*c)") == "a*(b*c)"
    assert c("-(a + b)") == "-(a + b)" and c("-(-x)") == "x" and c("x*-2") == "x*(-2.0f)"


def test_pi_is_a_literal_not_the_double_macro():
    assert c("math.pi*x") == "3.141592653589793f*x"
    assert c("math.pi*x", "double") == "3.141592653589793*x"
    assert c("torch.e*x") == "2.718281828459045f*x"
    assert "M_PI" not in c("math.pi*x") and "M_E" not in c("math.e*x")


def test_maximum_minimum_use_nan_propagating_helpers():
    assert c("maximum(x, y)") == "fusegen::maximum(x, y)"
    assert c("minimum(x, y)", "double") == "fusegen::minimum(x, y)"
    assert "fmax" not in c("maximum(x, y)") and "fmin" not in c("minimum(x, y)")


def test_clamp_and_helpers():
    # number bounds: std::max / std::min (ties keep x); tensor bounds: NaN-propagating
    assert c("clamp(x, 0, 1)") == "fusegen::clamp_max(fusegen::clamp_min(x, 0.0f), 1.0f)"
    assert c("clamp(x, min=0)") == "fusegen::clamp_min(x, 0.0f)"
    assert c("clamp(x, max=0)") == "fusegen::clamp_max(x, 0.0f)"
    assert c("clamp(x, y, z)") == "fusegen::minimum(fusegen::maximum(x, y), z)"
    assert c("sigmoid(x)") == "fusegen::sigmoid(x)"
    assert c("sign(x)") == "fusegen::sign(x)"
    assert c("relu(x)") == "fusegen::relu(x)"


def test_where_is_a_ternary():
    assert c("where(x > y, x, y)", "double") == "(x > y ? x : y)"
    assert c("(x+y)>0") == "(x + y > 0.0f ? 1.0f : 0.0f)"
    assert c("where(x, x, y)") == "(x != 0.0f ? x : y)"
    both = fn.Where(fn.LogicalAnd(fn.Greater(x, 0), fn.Less(y, 1)), 1, 0)
    assert c(both) == "((x > 0.0f) && (y < 1.0f) ? 1.0f : 0.0f)"


@pytest.mark.parametrize("op", ["<", "<=", ">", ">=", "==", "!="])
def test_comparisons(op):
    assert c(f"x {op} y") == f"(x {op} y ? 1.0f : 0.0f)"


def test_infinity_and_nan():
    assert c("clamp(x, max=math.inf)") == "x"  # an unbounded side prints nothing
    assert c(sympy.oo) == "INFINITY" and c(sympy.nan) == "NAN"


def test_print_program_fma():
    spec = differentiate(parse("a*b+c"), name="p_fma")
    fwd = print_program(spec.forward_program, "float")
    assert fwd.temps == () and fwd.results == (("out", "a*b + c"),)
    bwd = print_program(spec.backward_program, "double")
    assert bwd.results == (("grad_a", "dout*b"), ("grad_b", "dout*a"))


def test_print_program_relu_gate_shares_temps():
    spec = differentiate(parse("(x+y)*((x+y)>0)"), name="p_gate")
    fwd = print_program(spec.forward_program, "float")
    assert fwd.temps == (("float", "t0", "x + y"), ("float", "t1", "(t0 > 0.0f ? 1.0f : 0.0f)"))
    assert fwd.results == (("out", "t0*t1"),)
    bwd = print_program(spec.backward_program, "float")
    # x and y have the same gradient: one kernel output, grad_x, returned for both
    assert bwd.results == (("grad_x", "dout*t1"),) and bwd.temps[-1] == ("float", "t1", "(t0 > 0.0f ? 1.0f : 0.0f)")


def test_print_program_silu():
    # sigmoid_backward is grad * (1 - y) * y, as torch's kernel computes it
    spec = differentiate(parse("x*sigmoid(x)"), name="p_silu")
    bwd = print_program(spec.backward_program, "float")
    assert bwd.temps == (("float", "t0", "fusegen::sigmoid(x)"),)
    assert bwd.results == (("grad_x", "dout*t0 + dout*x*(1.0f - t0)*t0"),)


def test_backward_mirrors_torch_formulas():
    def grad_code(expr, ctype="double"):
        p = print_program(differentiate(parse(expr), name="p_f").backward_program, ctype)
        return "; ".join(f"{n} = {e}" for _, n, e in p.temps) + " | " + "; ".join(f"{n} = {e}" for n, e in p.results)
    assert grad_code("exp(x)") == "t0 = exp(x) | grad_x = dout*t0"
    assert grad_code("expm1(x)") == "t0 = expm1(x) | grad_x = dout*(t0 + 1.0)"
    assert grad_code("rsqrt(x)") == "t0 = 1.0/sqrt(x) | grad_x = -0.5*dout*(t0*t0*t0)"
    assert grad_code("erf(x)") == " | grad_x = 1.1283791670955126*exp(-(x*x))*dout"
    assert grad_code("relu(x)") == "t0 = fusegen::relu(x) | grad_x = (t0 <= 0.0 ? 0.0 : dout)"
    assert grad_code("x/y") == "t0 = x/y | grad_x = dout/y; grad_y = -dout*(t0/y)"
    assert grad_code("clamp(x, 0, 1)") == " | grad_x = ((x >= 0.0) && (x <= 1.0) ? dout : 0.0)"


def test_print_op_is_deterministic_and_has_both_types():
    spec = differentiate(parse("x*sigmoid(x) + exp(y)/y**2"), name="p_det")
    first, second = print_op(spec), print_op(spec)
    assert first == second
    assert set(first.forward) == set(first.backward) == {"float", "double"}
    assert "expf" in str(first.forward["float"]) and "expf" not in str(first.forward["double"])
