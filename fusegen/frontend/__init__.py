"""The frontend: user text (an expression, a function's source) to a sympy DAG."""
