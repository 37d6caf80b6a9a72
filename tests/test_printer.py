"""The printer: exact C strings per compute type. No compiler, no GPU."""

from __future__ import annotations

import pytest
import sympy

from fusegen import functions as fn
from fusegen.parse import parse, symbol
from fusegen.printer import CPrinter, print_op, print_program
from fusegen.spec import differentiate

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
    assert c("pow(x, y)") == "powf(x, y)"     # a varying exponent: fn.Power
    assert c("1/x") == "1.0f/x"
    assert c(sympy.sqrt(x)) == "sqrtf(x)"


def test_pi_is_a_literal_not_the_double_macro():
    assert c("math.pi*x") == "3.141592653589793f*x"
    assert c("math.pi*x", "double") == "3.141592653589793*x"
    assert c("torch.e*x") == "2.718281828459045f*x"
    assert "M_PI" not in c("math.pi*x") and "M_E" not in c("math.e*x")


def test_maximum_minimum_use_nan_propagating_helpers():
    assert c("maximum(x, y)") == "fusegen::maximum(x, y)"
    assert c("minimum(x, y)", "double") == "fusegen::minimum(x, y)"
    assert "fmax" not in c("maximum(x, y)") and "fmin" not in c("minimum(x, y)")
    assert c(sympy.Max(x, y, 0)) == "fusegen::maximum(fusegen::maximum(0.0f, x), y)"


def test_clamp_and_helpers():
    assert c("clamp(x, 0, 1)") == "fusegen::minimum(fusegen::maximum(x, 0.0f), 1.0f)"
    assert c("clamp(x, min=0)") == "fusegen::maximum(x, 0.0f)"
    assert c("clamp(x, max=0)") == "fusegen::minimum(x, 0.0f)"
    assert c("sigmoid(x)") == "fusegen::sigmoid(x)"
    assert c("sign(x)") == "fusegen::sign(x)"


def test_piecewise_is_a_ternary():
    assert c("relu(x)") == "(x > 0.0f ? x : 0.0f)"
    assert c("where(x > y, x, y)", "double") == "(x > y ? x : y)"
    assert c("(x+y)>0") == "(x + y > 0.0f ? 1.0f : 0.0f)"
    nested = sympy.Piecewise((x, x > y), (y, x < 0), (0, True))
    assert c(nested) == "(x > y ? x : (x < 0.0f ? y : 0.0f))"
    both = fn.indicator(sympy.And(x > 0, y < 1))
    assert c(both) == "((x > 0.0f) && (y < 1.0f) ? 1.0f : 0.0f)"


@pytest.mark.parametrize("op", ["<", "<=", ">", ">=", "==", "!="])
def test_comparisons(op):
    assert c(f"x {op} y") == f"(x {op} y ? 1.0f : 0.0f)"


def test_rational_is_a_decimal_literal():
    assert c(sympy.Rational(1, 2)) == "0.5f"
    assert c(sympy.Rational(1, 2), "double") == "0.5"
    assert c(sympy.Rational(1, 4) * x).replace("(", "").replace(")", "") == "0.25f*x"
    # never C integer division
    assert "1/2" not in c("x/2") and "0.5f" in c("x/2")


def test_infinity():
    assert c("clamp(x, max=math.inf)") == "x"  # an unbounded side prints nothing
    assert c(sympy.oo) == "INFINITY"


def test_print_program_fma():
    spec = differentiate(parse("a*b+c"), name="p_fma")
    fwd = print_program(spec.forward_program, "float")
    assert fwd.temps == () and fwd.results == (("out", "a*b + c"),)
    bwd = print_program(spec.backward_program, "double", scale="grad")
    assert bwd.results == (("grad_a", "grad * b"), ("grad_b", "grad * a"))


def test_print_program_relu_gate_shares_temps():
    spec = differentiate(parse("(x+y)*((x+y)>0)"), name="p_gate")
    fwd = print_program(spec.forward_program, "float")
    assert fwd.temps == (("float", "t0", "x + y"), ("float", "t1", "(t0 > 0.0f ? 1.0f : 0.0f)"))
    assert fwd.results == (("out", "t0*t1"),)
    bwd = print_program(spec.backward_program, "float", scale="grad")
    assert bwd.results == (("grad_x", "grad * t1"), ("grad_y", "grad * t1"))


def test_print_program_silu():
    spec = differentiate(parse("x*sigmoid(x)"), name="p_silu")
    bwd = print_program(spec.backward_program, "float", scale="grad")
    assert bwd.temps == (("float", "t0", "fusegen::sigmoid(x)"), ("float", "t1", "t0*x"))
    assert bwd.results == (("grad_x", "grad * (t0 + t1*(1.0f - t0))"),)


def test_constants_are_folded():
    spec = differentiate(parse("0.5*x*(1+tanh(0.7978845608*(x+0.044715*x*x*x)))"), name="p_gelu")
    fwd = print_program(spec.forward_program, "float")
    assert fwd.temps[0] == ("float", "t0", "tanhf(0.035677408136172f*(x*x*x) + 0.7978845608f*x)")
    # erf's derivative 2/sqrt(pi)*exp(-x**2) is one literal, not a runtime sqrt(pi)
    grad = print_program(differentiate(parse("erf(x)"), name="p_erf").backward_program, "double", "grad")
    code = grad.results[0][1] + "".join(t[2] for t in grad.temps)
    assert "1.1283791670955126" in code and "sqrt" not in code


def test_print_op_is_deterministic_and_has_both_types():
    spec = differentiate(parse("x*sigmoid(x) + exp(y)/y**2"), name="p_det")
    first, second = print_op(spec), print_op(spec)
    assert first == second
    assert set(first.forward) == set(first.backward) == {"float", "double"}
    assert "expf" in str(first.forward["float"]) and "expf" not in str(first.forward["double"])
