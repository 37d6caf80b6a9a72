"""fusegen: one elementwise expression in, a fused differentiable PyTorch op out.

    import fusegen
    fma = fusegen.fuse("a*b+c", name="fma")      # torch.ops.fusegen.fma
    y = fma(a, b, c)                             # forward and backward are fused kernels
"""

from .errors import FusegenError
from .version import FUSEGEN_VERSION
from .api import FusedOp, Request, fuse, fuse_many
from .decorator import build_pending, fused

__all__ = ["fuse", "fuse_many", "fused", "build_pending", "FusedOp", "Request", "FusegenError"]
__version__ = FUSEGEN_VERSION
