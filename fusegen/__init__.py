"""fusegen: one elementwise expression in, a fused differentiable PyTorch op out.

    import fusegen
    fma = fusegen.fuse("a*b+c", name="fma")      # torch.ops.fusegen.fma
    y = fma(a, b, c)                             # forward and backward are fused kernels

The public names are imported on first use (PEP 562), so `fusegen cache` and the other
commands that need no torch do not import it.
"""

from fusegen.errors import FusegenError
from fusegen.version import FUSEGEN_VERSION

__all__ = ["fuse", "fuse_many", "fused", "build_pending", "load", "ops", "FusedOp", "Request",
           "FusegenError", "onnx_translations"]
__version__ = FUSEGEN_VERSION
__all__ += ["Optimizer", "optim"]  # fused optimizers (fusegen/optim)

_LAZY = {"fuse": "api", "fuse_many": "api", "FusedOp": "api", "Request": "api", "load": "api",
         "fused": "frontend.decorator", "build_pending": "frontend.decorator", "onnx_translations": "pytorch.onnx"}
_LAZY["Optimizer"] = "optim"


def __getattr__(name: str):
    if name == "ops":
        import importlib
        return importlib.import_module(".ops", __name__)  # a module: `from fusegen.ops import fma` works too
    if name == "optim":
        import importlib
        return importlib.import_module(".optim", __name__)
    if name in _LAZY:
        import importlib
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value  # once: later lookups do not come here
        return value
    raise AttributeError(f"module 'fusegen' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | {"ops"})
