"""AOTInductor on CUDA in a process of its own: `python3 tests/gpu/aoti_probe.py control|fused DIR`.
`control` packages a model without fusegen ops (is AOTInductor itself sound here?), `fused`
the same model with two fused ops, called through AOTInductor's proxy executor. Prints
"aoti ok" and exits 0, or crashes in the step it names (faulthandler on)."""
import faulthandler
import sys

import torch

faulthandler.enable()
variant, folder = sys.argv[1], sys.argv[2]
if variant == "fused":
    import fusegen
    fusegen.fuse("a*b+c", name="ship_fma")
    fusegen.fuse("0.5*x*(1+tanh(0.7978845608*(x+0.044715*x*x*x)))", name="ship_gelu")
    fma, gelu = torch.ops.fusegen.ship_fma, torch.ops.fusegen.ship_gelu
else:
    fma = lambda a, b, c: a * b + c  # noqa: E731
    gelu = lambda x: 0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x * x * x)))  # noqa: E731


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 64, device="cuda")

    def forward(self, x, s, b):
        return gelu(fma(self.lin(x), s, b))


model = Block()
args = tuple(torch.randn(shape, device="cuda") for shape in [(128, 64), (64,), (128, 64)])
print("export", flush=True)
ep = torch.export.export(model, args)
print("compile", flush=True)
path = torch._inductor.aoti_compile_and_package(ep, package_path=f"{folder}/{variant}.pt2")
print("load", flush=True)
runner = torch._inductor.aoti_load_package(path)
print("run", flush=True)
fresh = tuple(torch.randn_like(a) for a in args)
with torch.no_grad():
    got = runner(*fresh)
    x = model.lin(fresh[0]) * fresh[1] + fresh[2]
    want = 0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x * x * x)))
torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
print("aoti ok", flush=True)
