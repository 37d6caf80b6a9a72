"""fusegen.optim on a GPU: AdamW, Lion and Adan against torch.optim.AdamW and the papers'
reference rules (tests/test_optim.py) with bf16 params and fp32 state and all fp32; a
capturable optimizer's step captured in a CUDA graph and replayed with a changing LR; a
torch.compile'd training step whose LR changes every step compiled once; the peers of
`fusegen bench optim` computing what fusegen computes.

    PYTHONPATH=. python -m pytest -m cuda tests/gpu/test_optim_cuda.py
"""

from __future__ import annotations

import json

import pytest
import torch

import fusegen
from test_optim import STEPS, TOL, adan_oracle, lion_oracle

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

KW = {"adamw": dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.05),
      "lion": dict(lr=3e-4, betas=(0.9, 0.99), weight_decay=0.5),
      "adan": dict(lr=2e-3, betas=(0.98, 0.92, 0.99), eps=1e-8, weight_decay=0.02)}
OURS = {"adamw": lambda ps, **kw: fusegen.optim.AdamW(ps, **kw), "lion": lambda ps, **kw: fusegen.optim.Lion(ps, **kw),
        "adan": lambda ps, **kw: fusegen.optim.Adan(ps, **kw)}
REFERENCE = {"adamw": lambda ps, **kw: torch.optim.AdamW(ps, **kw), "lion": lion_oracle, "adan": adan_oracle}
# fusegen's state name -> the reference's, compared after every step of the bf16 run
MOMENT = {"adamw": ("m", "exp_avg"), "lion": ("m", "m"), "adan": ("m", "exp_avg")}


def cuda_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 33)).cuda()


def loss_of(net, step):
    g = torch.Generator(device="cuda").manual_seed(100 + step)
    x = torch.randn(128, 64, device="cuda", generator=g)
    y = torch.randn(128, 33, device="cuda", generator=g)
    return torch.nn.functional.mse_loss(net(x), y)


@pytest.mark.parametrize("name", list(OURS))
def test_fp32_matches_the_reference(name):
    nets = [cuda_model(), cuda_model()]
    opts = [OURS[name](nets[0].parameters(), **KW[name]), REFERENCE[name](nets[1].parameters(), **KW[name])]
    for step in range(STEPS):
        for net, opt in zip(nets, opts):
            opt.zero_grad()
            loss_of(net, step).backward()
            opt.step()
    for a, b in zip(nets[0].parameters(), nets[1].parameters()):
        torch.testing.assert_close(a, b, **TOL[torch.float32])


@pytest.mark.parametrize("name", list(OURS))
def test_bf16_params_with_fp32_state(name):
    """bf16 params and grads, fp32 state, against the reference on an fp32 copy that starts
    every step from the rounded params: the update is computed in fp32 and rounded once."""
    torch.manual_seed(0)
    p32 = [torch.randn(shape, device="cuda").requires_grad_() for shape in ((512, 129), (4099,), (3, 5, 7))]
    p16 = [p.detach().to(torch.bfloat16).requires_grad_() for p in p32]
    for a in p32:
        a.data.copy_(a.detach().to(torch.bfloat16).float())
    ours, theirs = OURS[name](p16, **KW[name]), REFERENCE[name](p32, **KW[name])
    mine, its = MOMENT[name]
    for step in range(5):
        for a, b in zip(p32, p16):
            b.grad = torch.randn_like(b)
            a.grad = b.grad.float()
        ours.step()
        theirs.step()
        for a, b in zip(p32, p16):
            assert ours.state[b][mine].dtype == torch.float32
            torch.testing.assert_close(ours.state[b][mine], theirs.state[a][its], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(b, a.detach().to(torch.bfloat16), rtol=1.6e-2, atol=1e-5)
            a.data.copy_(b.float())


def test_cuda_graph_replays_a_changing_lr():
    """capturable=True: the LR, betas, weight decay and step counts are device tensors, so a
    captured step replays with the LR the scheduler fills in between, as eager steps would."""
    torch.manual_seed(0)
    shapes = ((1000, 33), (4099,), (64, 64))
    params = [torch.randn(s, device="cuda", requires_grad=True) for s in shapes]
    twins = [p.detach().clone().requires_grad_() for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = fusegen.optim.AdamW(params, lr=1e-2, weight_decay=0.1, capturable=True)
    ref = torch.optim.AdamW(twins, lr=1e-2, weight_decay=0.1)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.7 ** s) for o in (opt, ref)]
    grads = [[torch.randn_like(p) for p in params] for _ in range(6)]

    def feed(k):
        for p, q, g in zip(params, twins, grads[k]):
            p.grad.copy_(g)
            q.grad = g.clone()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    feed(0)
    with torch.cuda.stream(side):  # the first step creates the state, outside the capture
        opt.step()
    torch.cuda.current_stream().wait_stream(side)
    ref.step()
    for s in schedules:
        s.step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    for k in range(1, 6):
        feed(k)
        graph.replay()
        ref.step()
        for s in schedules:
            s.step()
    torch.cuda.synchronize()
    assert opt.state[params[0]]["step"].item() == 6
    for a, b in zip(params, twins):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", list(OURS))
def test_compiled_training_step_compiles_once(name):
    """torch.compile (inductor) of forward, backward and a capturable fusegen step; the LR
    changes every step, in place in its 0-d tensor as torch's schedulers change it: no graph
    after the first step's, and the params are those of eager steps."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    nets = [cuda_model(), cuda_model()]
    compiled_opt = OURS[name](nets[0].parameters(), capturable=True, **KW[name])
    eager_opt = OURS[name](nets[1].parameters(), **KW[name])
    base = KW[name]["lr"]
    counter = CompileCounterWithBackend("inductor")

    def train_step(net, opt, x, y):
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    compiled = torch.compile(train_step, backend=counter)
    frames = []
    for step in range(6):
        lr = base * 0.9 ** step
        compiled_opt.param_groups[0]["lr"].fill_(lr)
        eager_opt.param_groups[0]["lr"] = lr
        x, y = torch.randn(128, 64, device="cuda"), torch.randn(128, 33, device="cuda")
        compiled(nets[0], compiled_opt, x, y)
        train_step(nets[1], eager_opt, x, y)
        frames.append(counter.frame_count)
    assert frames[1:] == [frames[1]] * 5, frames
    for a, b in zip(nets[0].parameters(), nets[1].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()


@pytest.mark.parametrize("setup", ["bf16", "fp32"])
def test_bench_peers_compute_what_fusegen_computes(setup):
    """Three steps of each `fusegen bench optim` peer from the same params land where
    fusegen's optimizer does (torch's AdamW keeps bf16 state in the bf16 setup: looser)."""
    from fusegen.bench import optim as bench

    shapes = bench.llama_shapes(bench.QUICK)
    dtype = bench.SETUPS[setup]
    for name in bench.OPTIMIZERS:
        finals = {}
        for impl in bench.IMPLS:
            if bench.TORCH_ONLY.get(impl, name) != name:
                continue
            params = bench.make_params(shapes, dtype, "cuda")
            step, _, _ = bench._make(impl, name, params, "cuda")
            for _ in range(3):
                step()
            finals[impl] = params
        for impl, params in finals.items():
            loose = impl.startswith("torch-") and setup == "bf16"
            for a, b in zip(params, finals["fusegen"]):
                torch.testing.assert_close(a.float(), b.float(), rtol=2e-2 if dtype == torch.bfloat16 else 1e-4,
                                           atol=1e-2 if loose else 1e-4, msg=lambda m: f"{name} {impl}: {m}")
    torch._dynamo.reset()


def test_bench_optim_quick(tmp_path):
    from fusegen.bench.command import main as bench

    out = tmp_path / "optim.json"
    assert bench(["optim", "--quick", "--budget", "0.05", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert not result["skipped"], result["skipped"]
    rows = result["rows"]
    assert {(r["optimizer"], r["impl"]) for r in rows if r["setup"] == "bf16"} >= {
        ("adamw", "fusegen"), ("adamw", "torch-fused"), ("adamw", "torch-foreach"), ("lion", "compile"),
        ("adan", "compile"), ("adan", "foreach")}
    assert all(r["recompiles"] == 0 for r in rows if r["impl"] == "compile")
    assert all(r["pct_copy"] > 0 and r["bytes"] > 0 for r in rows)
