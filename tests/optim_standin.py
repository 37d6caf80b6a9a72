"""An eager stand-in of fusegen.FusedStep with the same interface, for when the step ops
are not built in: each statement evaluated with fusegen's eager reference, in fp32 (fp64
if any tensor is fp64), the mutated inputs copied back."""

from __future__ import annotations

import ast

import torch

from fusegen.tools.reference import evaluate_text


class StandInStep:
    def __init__(self, text, name, inputs, scalars):
        self.name = name
        self.inputs = tuple(s.strip() for s in inputs.split(","))
        self.scalars = tuple(s.strip() for s in scalars.split(",")) if scalars else ()
        body = ast.parse(text.strip()).body
        self.statements = [(s.targets[0].id, ast.unparse(s.value)) for s in body]
        assigned = {t for t, _ in self.statements}
        self.mutated = tuple(n for n in self.inputs if n in assigned)

    def __call__(self, *tensors, **scalars):
        assert len(tensors) == len(self.inputs) and set(scalars) == set(self.scalars), (self.name, scalars)
        compute = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
        env = {n: t.to(compute) for n, t in zip(self.inputs, tensors)}
        env.update({k: v.to(compute) if isinstance(v, torch.Tensor) else v for k, v in scalars.items()})
        for target, text in self.statements:
            env[target] = evaluate_text(text, env)
        for n, t in zip(self.inputs, tensors):
            if n in self.mutated:
                t.copy_(env[n])

    def foreach(self, *lists, **scalars):
        assert len(lists) == len(self.inputs) and len({len(x) for x in lists}) == 1
        for tensors in zip(*lists):
            self(*tensors, **scalars)


def fuse(text, name=None, inputs=None, scalars=()):
    return StandInStep(text, name, inputs, scalars)
