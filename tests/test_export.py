"""torch.export of a model that calls fused ops: exported, saved, loaded, run, and matched
with eager, for every op of the test corpus (one model calls them all: one export, one
save/load). The ops need their Meta impls (registered by the runtime) for this; the
exported graph holds torch.ops.fusegen.<name> as a call, so the process that loads it
must have the ops registered (import the op library or the package `fusegen package`
built) before torch.export.load."""

from __future__ import annotations

import os

import pytest
import torch

from corpus import CORPUS


class AllOps(torch.nn.Module):
    """A linear layer feeding every corpus op's first input, the rest passed in."""

    def __init__(self, cases):
        super().__init__()
        self.cases = cases
        self.lin = torch.nn.Linear(9, 9, dtype=torch.float64)

    def forward(self, xs: list[list[torch.Tensor]]):
        outs = []
        for case, tensors in zip(self.cases, xs):
            op = getattr(torch.ops.fusegen, case.name)
            first = tensors[0] if case.domains[0] != "real" else self.lin(tensors[0])
            outs.append(op(first, *tensors[1:], *case.scalar_values))
        return outs


def _inputs(cases, seed=0):
    return [list(case.sample(9, torch.float64, seed=seed)) for case in cases]


def _eager(model, cases, xs):
    """The same model with each op's hand-written eager oracle in place of the fused op."""
    outs = []
    for case, tensors in zip(cases, xs):
        first = tensors[0] if case.domains[0] != "real" else model.lin(tensors[0])
        outs.append(case.eager(first, *tensors[1:], *case.scalar_values))
    return outs


def test_export_save_load_matches_eager(corpus_ops, tmp_path):
    cases = list(CORPUS)
    model = AllOps(cases)
    xs = _inputs(cases)
    ep = torch.export.export(model, (xs,))
    called = {n.target for n in ep.graph.nodes if n.op == "call_function"}
    for case in cases:  # each op stays one call in the graph (not decomposed, not traced into)
        assert getattr(torch.ops.fusegen, case.name).default in called, case.name
    path = tmp_path / "model.pt2"
    torch.export.save(ep, path)
    loaded = torch.export.load(path).module()
    fresh = _inputs(cases, seed=1)  # other values than the ones exported with
    with torch.no_grad():
        got, want = loaded(fresh), _eager(model, cases, fresh)
    for case, g, w in zip(cases, got, want):
        torch.testing.assert_close(g, w, msg=lambda m, case=case: f"{case.name}: {m}")


def test_exported_model_backward(corpus_ops):
    """The exported module (training IR) keeps the op's autograd: gradients match eager."""
    (case,) = [c for c in CORPUS if c.name == "cp_fma"]
    model = AllOps([case])
    xs = _inputs([case])
    module = torch.export.export(model, (xs,)).module()
    args = [[t.detach().requires_grad_(True) for t in xs[0]]]
    (out,) = module(args)
    (want,) = _eager(model, [case], args)
    torch.testing.assert_close(out, want)
    grads = torch.autograd.grad(out.sum(), args[0])
    for g, w in zip(grads, torch.autograd.grad(want.sum(), args[0])):
        torch.testing.assert_close(g, w)


@pytest.mark.slow
def test_aoti_package_runs(corpus_ops, tmp_path):
    """AOTInductor (CPU): the exported model compiled into a .pt2 package, loaded and run. The
    fused op stays a call (through AOTInductor's proxy executor) to the registered kernel;
    inductor compiles the code around it. About 20 s on a 2-core machine with a cold cache."""
    cases = [c for c in CORPUS if c.name in ("cp_fma", "cp_silu")]
    assert len(cases) == 2
    model = AllOps(cases)
    xs = _inputs(cases)
    ep = torch.export.export(model, (xs,))
    path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "model.pt2"))
    runner = torch._inductor.aoti_load_package(path)
    fresh = _inputs(cases, seed=2)
    with torch.no_grad():
        got, want = runner(fresh), _eager(model, cases, fresh)
    for case, g, w in zip(cases, got, want):
        torch.testing.assert_close(g, w, msg=lambda m, case=case: f"{case.name}: {m}")
