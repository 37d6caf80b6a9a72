"""fusegen.Optimizer and fusegen.optim (AdamW, Lion, Adan) on the CPU: each against its
reference over 20 steps of a small model (torch.optim.AdamW; Lion and Adan as their papers'
reference code steps, written here in eager torch), param groups, LR schedulers, skipped
params, state dicts, capturable hyper-parameters under torch.compile, DTensor params.
The step ops are built once for the module (fusegen.optim builds each once per process).
The CUDA twin is tests/gpu/test_optim_cuda.py."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import fusegen
from fusegen.optim import algorithms

STEPS = 20
# 20 steps through a model whose loss depends on the params: per-step rounding (the kernel's
# operation order against torch's) compounds, fp32 to ~1e-6 relative.
TOL = {torch.float64: dict(rtol=1e-9, atol=1e-11), torch.float32: dict(rtol=2e-5, atol=2e-6)}

SGD_MOMENTUM = "b = mu*b + g + wd*p; p = p - lr*b"  # torch.optim.SGD(momentum=mu, weight_decay=wd)


@pytest.fixture(scope="module")
def ops():
    """Every step op of the module, built (or loaded) once."""
    built = {program.name: algorithms.step_op(program) for program in algorithms.PROGRAMS}
    built["sgd"] = fusegen.fuse(SGD_MOMENTUM, name="optim_test_sgd_momentum", inputs="p,g,b", scalars="lr,mu,wd")
    return built


# -- the models and the oracles ---------------------------------------------------------------

def model(dtype, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3)).to(dtype)


def batch(dtype, step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 6, generator=g, dtype=dtype), torch.randn(16, 3, generator=g, dtype=dtype)


def train(net, opt, dtype, steps=STEPS, scheduler=None, frozen=None):
    """`steps` steps of MSE; `frozen(step)`: params whose grad is dropped at that step."""
    for step in range(steps):
        x, y = batch(dtype, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        for p in frozen(step) if frozen else ():
            p.grad = None
        opt.step()
        if scheduler is not None:
            scheduler.step()
    return [p.detach().clone() for p in net.parameters()]


class EagerOracle(torch.optim.Optimizer):
    """An update rule written per param in eager torch, state created as its paper's code does."""

    def __init__(self, params, rule, init, **defaults):
        self.rule, self.init = rule, init
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(self.init(p), step=0)
                state["step"] += 1
                self.rule(p, p.grad, state, group)


def lion_rule(p, g, state, group):  # Chen et al. 2023, Algorithm 2
    beta1, beta2 = group["betas"]
    m = state["m"]
    c = beta1 * m + (1 - beta1) * g
    p.sub_(group["lr"] * (torch.sign(c) + group["weight_decay"] * p))
    m.mul_(beta2).add_(g, alpha=1 - beta2)


def adan_rule(p, g, state, group):  # sail-sg/Adan, _single_tensor_adan
    beta1, beta2, beta3 = group["betas"]
    t, lr, wd = state["step"], group["lr"], group["weight_decay"]
    diff = g - state["pre_grad"]
    update = g + beta2 * diff
    state["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)
    state["exp_avg_diff"].mul_(beta2).add_(diff, alpha=1 - beta2)
    state["exp_avg_sq"].mul_(beta3).addcmul_(update, update, value=1 - beta3)
    denom = (state["exp_avg_sq"].sqrt() / (1 - beta3 ** t) ** 0.5).add_(group["eps"])
    update = (state["exp_avg"] / (1 - beta1 ** t) + beta2 * state["exp_avg_diff"] / (1 - beta2 ** t)).div_(denom)
    if group["no_prox"]:
        p.mul_(1 - lr * wd).add_(update, alpha=-lr)
    else:
        p.add_(update, alpha=-lr).div_(1 + lr * wd)
    state["pre_grad"].copy_(g)


def lion_oracle(params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
    return EagerOracle(params, lion_rule, lambda p: {"m": torch.zeros_like(p)}, lr=lr, betas=betas,
                       weight_decay=weight_decay)


def adan_oracle(params, lr=1e-3, betas=(0.98, 0.92, 0.99), eps=1e-8, weight_decay=0.0, no_prox=False):
    def init(p):
        return {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p),
                "exp_avg_diff": torch.zeros_like(p), "pre_grad": p.grad.clone()}
    return EagerOracle(params, adan_rule, init, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                       no_prox=no_prox)


def groups(net, **second):
    """Two param groups: the first layer with the defaults, the last with `second`."""
    first, *_, last = net
    return [{"params": list(first.parameters())}, {"params": list(last.parameters()), **second}]


def assert_params_close(got, want, dtype):
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL[dtype])


# -- each optimizer against its reference -----------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_adamw_matches_torch(ops, dtype):
    """Two groups (the second with its own lr and weight decay), a LambdaLR schedule, and the
    first layer's bias without a gradient on every third step (skipped, its own step count)."""
    kw = dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.05)
    second = dict(lr=1e-2, weight_decay=0.2)
    nets = [model(dtype), model(dtype)]
    opts = [fusegen.optim.AdamW(groups(nets[0], **second), **kw), torch.optim.AdamW(groups(nets[1], **second), **kw)]
    results = []
    for net, opt in zip(nets, opts):
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + 0.1 * s))
        results.append(train(net, opt, dtype, scheduler=schedule,
                             frozen=lambda s, net=net: [net[0].bias] if s % 3 == 1 else []))
    assert_params_close(*results, dtype)
    for p, q in zip(nets[0].parameters(), nets[1].parameters()):
        ours, theirs = opts[0].state[p], opts[1].state[q]
        assert ours["step"] == theirs["step"]
        torch.testing.assert_close(ours["m"], theirs["exp_avg"], **TOL[dtype])
        torch.testing.assert_close(ours["v"], theirs["exp_avg_sq"], rtol=TOL[dtype]["rtol"], atol=1e-12)
    assert opts[0].state[nets[0][0].bias]["step"] == STEPS - 7  # frozen at steps 1, 4, ..., 19


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_lion_matches_the_published_rule(ops, dtype):
    kw = dict(lr=3e-4, betas=(0.9, 0.99), weight_decay=0.5)
    nets = [model(dtype), model(dtype)]
    opts = [fusegen.optim.Lion(groups(nets[0], lr=1e-3), **kw), lion_oracle(groups(nets[1], lr=1e-3), **kw)]
    assert_params_close(*(train(n, o, dtype) for n, o in zip(nets, opts)), dtype)


@pytest.mark.parametrize("no_prox", [False, True], ids=["proximal", "decoupled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_adan_matches_the_reference(ops, dtype, no_prox):
    kw = dict(lr=2e-3, betas=(0.98, 0.92, 0.99), eps=1e-8, weight_decay=0.02, no_prox=no_prox)
    nets = [model(dtype), model(dtype)]
    opts = [fusegen.optim.Adan(nets[0].parameters(), **kw), adan_oracle(nets[1].parameters(), **kw)]
    assert_params_close(*(train(n, o, dtype) for n, o in zip(nets, opts)), dtype)


def test_a_program_of_ones_own_matches_torch_sgd(ops):
    """fusegen.Optimizer with any step op: SGD with momentum and weight decay, written as two
    statements, is torch.optim.SGD (its momentum buffer starts as the first gradient, as the
    zeros here make it)."""
    nets = [model(torch.float64), model(torch.float64)]
    ours = fusegen.Optimizer(nets[0].parameters(), step=ops["sgd"], state=("b",),
                             scalars=lambda group, count: {"lr": group["lr"], "mu": group["momentum"],
                                                           "wd": group["weight_decay"]},
                             lr=0.05, momentum=0.9, weight_decay=1e-3)
    theirs = torch.optim.SGD(nets[1].parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    assert_params_close(train(nets[0], ours, torch.float64), train(nets[1], theirs, torch.float64), torch.float64)


def test_bf16_params_keep_fp32_state(ops):
    """bf16 params with fp32 moments (the default state_dtype), against torch.optim.AdamW on
    an fp32 copy: the update is computed in fp32 and rounded into the bf16 param once."""
    net = model(torch.float32)
    p32 = [p.detach().clone().requires_grad_() for p in net.parameters()]
    p16 = [p.detach().to(torch.bfloat16).requires_grad_() for p in p32]
    ours = fusegen.optim.AdamW(p16, lr=1e-2)
    theirs = torch.optim.AdamW(p32, lr=1e-2)
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        for a, b in zip(p32, p16):
            a.grad = torch.randn(a.shape, generator=g).to(torch.bfloat16).float()
            b.grad = a.grad.to(torch.bfloat16)
        ours.step()
        theirs.step()
        for a, b in zip(p32, p16):
            assert ours.state[b]["m"].dtype == ours.state[b]["v"].dtype == torch.float32
            torch.testing.assert_close(ours.state[b]["m"], theirs.state[a]["exp_avg"])
            # each step rounds the bf16 param: within a few bf16 ulps of the fp32 trajectory
            torch.testing.assert_close(b.float(), a.detach(), rtol=2e-2, atol=2e-2)
            a.data.copy_(b.float())  # the next step starts from the same (rounded) params
    keep = fusegen.optim.AdamW([torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)], state_dtype=None)
    keep.param_groups[0]["params"][0].grad = torch.ones(3, dtype=torch.bfloat16)
    keep.step()
    assert keep.state[keep.param_groups[0]["params"][0]]["m"].dtype == torch.bfloat16
    wide = fusegen.optim.AdamW([torch.zeros(3, dtype=torch.float64, requires_grad=True)])
    wide.param_groups[0]["params"][0].grad = torch.ones(3, dtype=torch.float64)
    wide.step()
    assert wide.state[wide.param_groups[0]["params"][0]]["v"].dtype == torch.float64  # never narrowed


# -- the torch.optim.Optimizer contract -------------------------------------------------------

def test_state_dict_round_trip(ops):
    """Five steps, a state dict (through torch.save), a new optimizer loading it: five more
    steps on each land on the same params; the state keeps its dtypes and step counts."""
    import io

    dtype = torch.float64
    net = model(dtype)
    opt = fusegen.optim.Adan(groups(net, lr=5e-3), lr=1e-3, weight_decay=0.01)
    train(net, opt, dtype, steps=5)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    twin = copy.deepcopy(net)
    restored = fusegen.optim.Adan(groups(twin), lr=1.0)  # the saved hyper-parameters win
    buffer.seek(0)
    restored.load_state_dict(torch.load(buffer))
    assert [g["lr"] for g in restored.param_groups] == [1e-3, 5e-3]
    p0 = next(twin.parameters())
    assert set(restored.state[p0]) == {"step", "m", "d", "n", "gp"} and restored.state[p0]["step"] == 5
    assert restored.state[p0]["step"].device.type == "cpu"
    assert_params_close(train(net, opt, dtype, steps=5), train(twin, restored, dtype, steps=5), dtype)


def test_state_dict_keeps_fp32_state_of_bf16_params(ops):
    """torch.optim would cast loaded state to the param's dtype; fusegen keeps state_dtype."""
    p = torch.randn(8, dtype=torch.bfloat16, requires_grad=True)
    opt = fusegen.optim.AdamW([p])
    p.grad = torch.randn(8, dtype=torch.bfloat16)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    q = p.detach().clone().requires_grad_()
    twin = fusegen.optim.AdamW([q])
    twin.load_state_dict(saved)
    assert twin.state[q]["m"].dtype == torch.float32
    torch.testing.assert_close(twin.state[q]["v"], saved["state"][0]["v"], rtol=0, atol=0)


def test_a_torch_adamw_state_dict_loads(ops):
    """torch.optim.AdamW's exp_avg and exp_avg_sq are fusegen.optim.AdamW's m and v: training
    resumes from a torch checkpoint where torch would have gone on."""
    dtype = torch.float64
    nets = [model(dtype), model(dtype)]
    theirs = torch.optim.AdamW(nets[0].parameters(), lr=1e-2)
    train(nets[0], theirs, dtype, steps=4)
    nets[1].load_state_dict(nets[0].state_dict())
    ours = fusegen.optim.AdamW(nets[1].parameters())
    ours.load_state_dict(copy.deepcopy(theirs.state_dict()))
    assert_params_close(train(nets[0], theirs, dtype, steps=4), train(nets[1], ours, dtype, steps=4), dtype)
    lion = fusegen.optim.Lion(nets[1].parameters())
    train(nets[1], lion, dtype, steps=1)
    with pytest.raises(ValueError, match=r"the state of param 0 has step, m; expected step, m, v \(missing v\)"):
        ours.load_state_dict(lion.state_dict())


def test_zero_grad_params_without_grad_and_empty_groups(ops):
    net = model(torch.float32)
    frozen = torch.nn.Parameter(torch.ones(4))
    opt = fusegen.optim.Lion([{"params": list(net.parameters())}, {"params": [frozen]}], lr=1e-3)
    before = frozen.detach().clone()
    train(net, opt, torch.float32, steps=2)
    assert frozen not in opt.state and torch.equal(frozen, before)
    opt.zero_grad()
    assert all(p.grad is None for p in net.parameters())


def test_capturable_holds_hyper_parameters_as_tensors(ops):
    """capturable=True: lr, betas, eps, weight decay and the step count are 0-d tensors; an LR
    scheduler fills the same lr tensor; the updates are those of the plain optimizer."""
    dtype = torch.float64
    nets = [model(dtype), model(dtype)]
    plain = fusegen.optim.AdamW(nets[0].parameters(), lr=1e-2, weight_decay=0.1)
    held = fusegen.optim.AdamW(nets[1].parameters(), lr=1e-2, weight_decay=0.1, capturable=True)
    group = held.param_groups[0]
    lr = group["lr"]
    assert isinstance(lr, torch.Tensor) and lr.dim() == 0 and all(isinstance(b, torch.Tensor) for b in group["betas"])
    results = []
    for net, opt in zip(nets, (plain, held)):
        schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        results.append(train(net, opt, dtype, steps=8, scheduler=schedule))
    assert group["lr"] is lr and float(lr) == pytest.approx(1e-2 * 0.5 ** 2)
    # the scalars are float32 tensors, as torch's capturable optimizers hold them
    assert_params_close(*results, torch.float32)
    twin = fusegen.optim.AdamW(copy.deepcopy(nets[1]).parameters(), capturable=True)
    twin.load_state_dict(held.state_dict())
    assert isinstance(twin.param_groups[0]["lr"], torch.Tensor)


def test_compiled_step_traces_once_whatever_the_lr(ops):
    """torch.compile of the optimizer step, capturable: a new LR (a scheduler fills the lr
    tensor) traces no new graph (dynamo's own backend: no C++ compiler needed)."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    net = model(torch.float32)
    opt = fusegen.optim.Lion(net.parameters(), lr=1e-3, capturable=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s)
    counter = CompileCounter()
    step = torch.compile(opt.step, backend=counter)
    frames = []
    for s in range(4):
        x, y = batch(torch.float32, s)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        step()
        schedule.step()
        frames.append(counter.frame_count)
    assert frames[0] >= 1 and frames[1:] == [frames[1]] * 3, frames
    torch._dynamo.reset()


def test_dtensor_params_step_their_local_shards(ops):
    """DTensor params (as FSDP2 shards them) on a one-rank gloo group: each param's local
    shard steps as a plain tensor would, the state is DTensor like the param."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch built without distributed")
    from dtensor_ranks import free_port
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor, init_device_mesh

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        plain = [torch.randn(6, 4, dtype=torch.float64, requires_grad=True) for _ in range(2)]
        sharded = [torch.nn.Parameter(distribute_tensor(p.detach().clone(), mesh, [Shard(0)])) for p in plain]
        opts = [fusegen.optim.AdamW(plain, lr=1e-2), fusegen.optim.AdamW(sharded, lr=1e-2)]
        for step in range(3):
            for p, q in zip(plain, sharded):
                p.grad = torch.randn(6, 4, dtype=torch.float64)
                q.grad = distribute_tensor(p.grad.clone(), mesh, [Shard(0)])
            for opt in opts:
                opt.step()
        for p, q in zip(plain, sharded):
            assert isinstance(opts[1].state[q]["m"], DTensor)
            torch.testing.assert_close(q.full_tensor(), p.detach(), rtol=0, atol=0)
        sharded[0].grad = torch.randn(6, 4, dtype=torch.float64)  # a plain gradient of a DTensor param
        with pytest.raises(RuntimeError, match="redistribute the gradient"):
            opts[1].step()
    finally:
        dist.destroy_process_group()


# -- errors -----------------------------------------------------------------------------------

def test_mismatched_programs_are_refused(ops):
    p = [torch.zeros(2, requires_grad=True)]
    adamw = ops["optim_adamw"]
    with pytest.raises(ValueError, match=r"nothing supplies its input 'v'"):
        fusegen.Optimizer(p, step=adamw, state=("m",), scalars=algorithms.adamw_scalars)
    with pytest.raises(ValueError, match=r"has no input 'w'"):
        fusegen.Optimizer(p, step=adamw, state=("m", "v", "w"), scalars=algorithms.adamw_scalars)
    with pytest.raises(ValueError, match=r"does not assign its parameter input 'g'"):
        fusegen.Optimizer(p, step=adamw, param="g", grad="p", scalars=algorithms.adamw_scalars)
    with pytest.raises(TypeError, match="needs scalars="):
        fusegen.Optimizer(p, step=adamw)
    with pytest.raises(TypeError, match="not the string"):
        fusegen.Optimizer(p, step=adamw, state="m", scalars=algorithms.adamw_scalars)
    wrong = fusegen.Optimizer(p, step=adamw, scalars=lambda group, count: {"lr": group["lr"]}, lr=1.0)
    p[0].grad = torch.ones(2)
    with pytest.raises(ValueError, match=r"returned lr; step op optim_adamw takes .*\(missing wd, beta1"):
        wrong.step()
    with pytest.raises(ValueError, match="invalid beta2"):
        fusegen.optim.AdamW(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="invalid lr"):
        fusegen.optim.Lion(p, lr=-1.0)


# -- the benchmark ----------------------------------------------------------------------------

def test_bench_optim_runs_on_the_cpu(ops, tmp_path, capsys):
    """`fusegen bench optim --device cpu`: a tiny parameter list, every optimizer, fusegen and
    the foreach peers (torch.compile's compiles would take minutes here; the GPU test runs them)."""
    from fusegen.bench.command import main as bench

    out = tmp_path / "optim.json"
    assert bench(["optim", "--device", "cpu", "--quick", "--impls", "fusegen,torch-foreach,foreach",
                  "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert {r["optimizer"] for r in rows} == {"adamw", "lion", "adan"}
    assert {r["impl"] for r in rows} == {"fusegen", "torch-foreach", "foreach"}
    assert all(r["ms"] > 0 and r["pct_copy"] > 0 and r["bytes"] > 0 for r in rows)
    assert "fusegen" in capsys.readouterr().out


@pytest.mark.parametrize("setup", ["bf16", "fp32"])
def test_bench_peers_compute_what_fusegen_computes(ops, setup, monkeypatch):
    """Three steps of each peer of `fusegen bench optim` from the same params land where
    fusegen's optimizer does; the compiled peer's update runs uncompiled here (inductor's
    C++ compiles would take minutes; tests/gpu/test_optim_cuda.py compiles it)."""
    from fusegen.bench import optim as bench

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    shapes = bench.llama_shapes(dict(vocab=50, dim=16, hidden=24, layers=1, kv=8))
    dtype = bench.SETUPS[setup]
    for name in bench.OPTIMIZERS:
        finals = {}
        for impl in bench.IMPLS:
            if bench.TORCH_ONLY.get(impl, name) != name:
                continue
            params = bench.make_params(shapes, dtype, "cpu")
            step, set_lr, _ = bench._make(impl, name, params, "cpu")
            for lr in (None, None, bench.LR_CHANGES[0]):
                if lr is not None:
                    set_lr(lr)
                step()
            finals[impl] = params
        for impl, params in finals.items():
            bf16_state = impl.startswith("torch-") and setup == "bf16"  # torch's AdamW: state in bf16
            for a, b in zip(params, finals["fusegen"]):
                torch.testing.assert_close(a.float(), b.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                                           atol=1e-3 if bf16_state else 1e-6, msg=lambda m: f"{name} {impl}: {m}")
