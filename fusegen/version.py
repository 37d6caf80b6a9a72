"""fusegen's version: part of every cache key and of spec.json. A module of its own so that
the light path (a cached load, which must not import sympy) can read it."""

FUSEGEN_VERSION = "0.1.0"
