"""Tools: the command line, --check, packaging, the eager reference."""
