"""Benchmarks: `fusegen bench` and its subcommands."""
