"""The eager PyTorch operation each row reduction stands for (primitives.REDUCTIONS): torch's
reduction over the last dimension with keepdim=True, the spelling the parser reads."""

from __future__ import annotations

import torch


def sum(x):  # noqa: A001 - the reduction's name in the language
    return torch.sum(x, -1, keepdim=True)


def mean(x):
    return torch.mean(x, -1, keepdim=True)


def amax(x):
    return torch.amax(x, -1, keepdim=True)


def amin(x):
    return torch.amin(x, -1, keepdim=True)


def logsumexp(x):
    return torch.logsumexp(x, -1, keepdim=True)
