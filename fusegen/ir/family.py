"""An op family as torch.library sees it: each op's name, how many tensors it takes, whether
it is a backward op and whether it has a fused derivative. Derived from the specs when an
op is built; kept by the request index (build/index.py) so that a cached load registers the
family (pytorch/autograd.py) without sympy."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Member:
    """One op of a family, as torch.library sees it."""

    name: str
    tensors: int              # tensor arguments, first in its schema
    backward: bool            # a `<x>_backward` op: Tensor[] result, trailing output_mask
    composite: bool           # no fused derivative: the composite autograd kernel is registered
    outputs: int = 1          # a forward op's results (several: a tuple of tensors), a
                              # backward op's douts (its forward's outputs)
    joined: bool = False      # its two outputs are the halves of one result (torch.cat, dim -1)
    rows: bool = False        # it reduces over the last dimension (a row op)
    random: bool = False      # it draws random numbers (its backward op's last tensor is the
                              # forward's random state, counted in `tensors`)
