"""Fused optimizers: `fusegen.Optimizer`, a torch.optim.Optimizer whose update is one fusegen
step op (a statement program updating the param and its state in place), and AdamW, Lion
and Adan written as such programs.

    opt = fusegen.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

See docs/optim.md."""

from fusegen.optim.algorithms import ADAMW, ADAN, LION, PROGRAMS, AdamW, Adan, Lion, Program, step_op
from fusegen.optim.base import Optimizer

__all__ = ["Optimizer", "AdamW", "Lion", "Adan", "Program", "PROGRAMS", "ADAMW", "LION", "ADAN", "step_op"]
