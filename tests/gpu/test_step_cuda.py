"""On a GPU: step ops (in-place statement programs) over tensors and tensor lists against
the statements run eagerly in float64; launches that split lists and tensors; 0-d device
scalars under CUDA graph capture and torch.compile."""

from __future__ import annotations

import pytest
import torch

import fusegen

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ADAMW = ("m = beta1*m + (1-beta1)*g; v = beta2*v + (1-beta2)*g*g; "
         "p = p*(1-lr*wd) - lr*(m/bc1)/(sqrt(v/bc2)+eps)")
SCALARS = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.1, bc1=0.1, bc2=0.001)


@pytest.fixture(scope="module")
def adamw():
    return fusegen.fuse(ADAMW, name="gpu_step_adamw", inputs="p,g,m,v", scalars="lr,beta1,beta2,eps,wd,bc1,bc2")


def eager(p, g, m, v, lr, beta1, beta2, eps, wd, bc1, bc2):
    m.copy_(beta1 * m + (1 - beta1) * g)
    v.copy_(beta2 * v + (1 - beta2) * g * g)
    p.copy_(p * (1 - lr * wd) - lr * (m / bc1) / ((v / bc2).sqrt() + eps))


def lists(shapes, pdtype, sdtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    ps = [torch.randn(s, device="cuda", generator=gen).to(pdtype) for s in shapes]
    gs = [torch.randn(s, device="cuda", generator=gen).to(pdtype) for s in shapes]
    ms = [(torch.randn(s, device="cuda", generator=gen) * 0.1).to(sdtype) for s in shapes]
    vs = [(torch.rand(s, device="cuda", generator=gen) * 0.01).to(sdtype) for s in shapes]
    return ps, gs, ms, vs


def reference(ps, gs, ms, vs, scalars):
    out = []
    for p, g, m, v in zip(ps, gs, ms, vs):
        r = [t.double() for t in (p, g, m, v)]
        eager(*r, **scalars)
        out.append(r)
    return out


TOL = {torch.float64: dict(rtol=1e-12, atol=1e-14), torch.float32: dict(rtol=2e-5, atol=1e-6),
       torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=1e-5)}


@pytest.mark.parametrize("pdtype, sdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                            (torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16),
                                            (torch.float64, torch.float64)])
def test_foreach_matches_eager_in_float64(adamw, pdtype, sdtype):
    # Odd sizes (tails of a vector), more tensors than one launch takes (81 of 4 operands),
    # one tensor of 321 chunks and a partial one, and empty ones.
    shapes = [(3,), (1, 5), (0,), (4097,), (130, 7)] * 20 + [(321 * 65536 + 5,)]
    ps, gs, ms, vs = lists(shapes, pdtype, sdtype)
    want = reference(ps, gs, ms, vs, SCALARS)
    adamw.foreach(ps, gs, ms, vs, **SCALARS)
    for k, (got, w) in enumerate(zip(zip(ps, gs, ms, vs), want)):
        for name, t, wt in zip("pgmv", got, w):
            torch.testing.assert_close(t.double(), wt.to(t.dtype).double(), **TOL[t.dtype],
                                       msg=lambda m: f"{name}[{k}] {tuple(t.shape)}: {m}")


def test_misaligned_and_strided_tensors(adamw):
    base = lists([(1001,)], torch.float32, torch.float32)
    ps, gs, ms, vs = ([t[0][1:]] for t in base)  # 4-byte offset: not 16-byte aligned
    want = reference(ps, gs, ms, vs, SCALARS)
    adamw.foreach(ps, gs, ms, vs, **SCALARS)
    torch.testing.assert_close(ps[0].double(), want[0][0], **TOL[torch.float32])
    t = lists([(64, 48)], torch.float32, torch.float32)
    p, g, m, v = t[0][0].t(), t[1][0].t().contiguous(), t[2][0].t(), t[3][0].t()  # g laid out otherwise
    want = reference([p], [g], [m], [v], SCALARS)
    adamw(p, g, m, v, **SCALARS)
    torch.testing.assert_close(p.double(), want[0][0], **TOL[torch.float32])


def test_cpu_and_cuda_agree(adamw):
    ps, gs, ms, vs = lists([(10000,)], torch.float32, torch.float32)
    cpu = [[t[0].cpu()] for t in (ps, gs, ms, vs)]
    adamw.foreach(ps, gs, ms, vs, **SCALARS)
    adamw.foreach(*cpu, **SCALARS)
    for got, want in zip((ps, gs, ms, vs), cpu):
        torch.testing.assert_close(got[0].cpu(), want[0], rtol=2e-6, atol=1e-7)


def test_device_scalars_under_cuda_graph_capture(adamw):
    ps, gs, ms, vs = lists([(5000,), (7, 9)], torch.float32, torch.float32)
    lr = torch.tensor(1e-2, device="cuda")
    bc2 = torch.tensor(1e-3, device="cuda", dtype=torch.float64)
    ref = [[t.clone() for t in lst] for lst in (ps, gs, ms, vs)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up outside the graph, as capture requires
        adamw.foreach(ps, gs, ms, vs, **dict(SCALARS, lr=lr, bc2=bc2))
    torch.cuda.current_stream().wait_stream(stream)
    for lst, r in zip((ps, gs, ms, vs), ref):
        for t, c in zip(lst, r):
            t.copy_(c)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        adamw.foreach(ps, gs, ms, vs, **dict(SCALARS, lr=lr, bc2=bc2))
    want = [[t.double() for t in lst] for lst in ref]
    for step, value in enumerate((1e-2, 5e-3, 1e-3)):
        lr.fill_(value)
        graph.replay()
        for k in range(2):
            eager(*[lst[k] for lst in want], **dict(SCALARS, lr=value))
    torch.cuda.synchronize()
    for lst, w in zip((ps, gs, ms, vs), want):
        for t, wt in zip(lst, w):
            torch.testing.assert_close(t.double(), wt, rtol=1e-4, atol=1e-6)


def test_compiled_step_does_not_recompile_when_lr_changes(adamw):
    import torch._dynamo

    torch._dynamo.reset()
    ps, gs, ms, vs = lists([(4096,), (33,)], torch.bfloat16, torch.float32)
    ref = [[t.double() for t in lst] for lst in (ps, gs, ms, vs)]

    @torch.compile(fullgraph=True)
    def step(ps, gs, ms, vs, lr):
        adamw.foreach(ps, gs, ms, vs, **dict(SCALARS, lr=lr))

    lr = torch.tensor(0.0, device="cuda")
    from torch._dynamo.utils import counters
    counters.clear()
    for k in range(4):
        value = 1e-2 / (k + 1)
        lr.fill_(value)
        step(ps, gs, ms, vs, lr)
        for i in range(2):
            eager(*[lst[i] for lst in ref], **dict(SCALARS, lr=value))
            for lst, r in zip((ps, gs, ms, vs), ref):  # each step rounds to the tensors' dtypes
                r[i].copy_(r[i].to(lst[i].dtype).double())
    assert counters["stats"]["unique_graphs"] == 1
    for lst, w in zip((ps, gs, ms, vs), ref):
        for t, wt in zip(lst, w):
            torch.testing.assert_close(t.double(), wt.to(t.dtype).double(), **TOL[t.dtype])
