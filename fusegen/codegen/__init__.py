"""Code generation: the OpSpec printed as C strings and rendered into files."""
