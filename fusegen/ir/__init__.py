"""The IR: the primitive table, the OpSpec and its derivation (gradients, cse, plan), names."""
