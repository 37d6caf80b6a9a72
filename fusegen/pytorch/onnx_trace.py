"""A FusedOp call under torch.onnx.export: the op, or its expression's ATen ops.

torch.onnx.export(..., dynamo=True) asks its registry for each graph node's ONNX; nothing
registers fusegen's ops there unless `custom_translation_table=fusegen.onnx_translations()`
is passed. Without it, a FusedOp or @fused call under the export traces as its expression's
ATen ops (the composite, as "decompose" mode does under torch.compile), which torch's own
ONNX functions translate: a plain export works, with eager's arithmetic (fp16/bf16 computed
in fp16/bf16; the table's translation computes in float, as the kernels do). With the table,
the op stays one node and the table's translation is used.

autograd.call asks `onnx_composite` while torch traces; this module imports neither
autograd.py nor derivatives.py.
"""

from __future__ import annotations

import torch


def onnx_composite(name: str) -> bool:
    """Whether a FusedOp call of `name` should trace as its composite: under an ONNX export
    whose registry has no translation for the op."""
    if not torch.onnx.is_in_onnx_export():
        return False
    registry = _onnx_registry()
    overload = getattr(getattr(torch.ops.fusegen, name), "default")
    try:
        return registry is None or not registry.is_registered(overload)
    except Exception:  # a registry of another torch: the composite exports everywhere
        return True


def _onnx_registry():
    """The registry of the torch.onnx export in progress (its `_core.export` frame holds it:
    the exporter has no API that hands it out), or None."""
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "export" and code.co_filename.endswith(("_core.py",)) \
                and "onnx" in code.co_filename and "registry" in frame.f_locals:
            return frame.f_locals["registry"]
        frame = frame.f_back
    return None
