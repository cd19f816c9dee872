"""Linear weights as plain tensors the decode-row kernels read directly.

The engine calls a layer's own Linear module for prefill (and wherever no plain weight is known);
for decode, draft and verify rows (S <= 8) the fused path reads ``PlainLinear`` records instead:
the same storage the module holds (never a copy), in one of two formats:

* dense: ``weight`` ``[N, K]`` in the execution dtype -> ``F.linear`` (cuBLAS);
* int8: ``weight`` int8 ``[N, K]`` with a float32 ``scale`` per output row (``[N]``) or per tensor
  (``[]``), optionally ConvRot-rotated (``rotation`` = the ``[G, G]`` Hadamard matrix the rows were
  rotated with; x is rotated once per input, then the weight-only int8 GEMV runs).

Who knows a module's storage (ComfyUI's ops, quantized tensors, offloading) builds these records:
``StandaloneWeights`` for the engine's own modules, ``patches/comfy_weights.py`` for ComfyUI's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PlainLinear:
    """``y = x @ weight.T (* scale) + bias``; see the module docstring for the formats."""

    weight: torch.Tensor
    scale: torch.Tensor | None = None
    rotation: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        return self.weight.dtype == torch.int8


def _kernels():
    from ..kernels import gemv

    return gemv


def linear_rows(x: torch.Tensor, w: PlainLinear) -> torch.Tensor:
    """x ``[..., K]`` (at most 16 rows in all, execution dtype) -> ``[..., N]`` in x's dtype."""
    return linear_group(x, [w])[0]


def linear_group(x: torch.Tensor, weights: Sequence[PlainLinear]) -> list[torch.Tensor]:
    """``[linear_rows(x, w) for w in weights]``; int8 weights sharing a rotation run as one launch
    (x rotated once), dense ones through ``F.linear``. x ``[..., K]``, at most 16 rows."""
    outs: list[torch.Tensor | None] = [None] * len(weights)
    quant: dict[int, list[int]] = {}
    for i, w in enumerate(weights):
        if w.quantized:
            quant.setdefault(id(w.rotation), []).append(i)
        else:
            outs[i] = F.linear(x, w.weight, w.bias)
    if quant:
        gemv = _kernels()
        for idx in quant.values():
            rot = weights[idx[0]].rotation
            xr = x if rot is None else gemv.hadamard_rotate(x, rot)
            for start in range(0, len(idx), gemv.MAX_GROUP):
                part = idx[start:start + gemv.MAX_GROUP]
                ys = gemv.gemv_group(xr, [weights[i].weight for i in part], scales=[weights[i].scale for i in part])
                for i, y in zip(part, ys):
                    b = weights[i].bias
                    outs[i] = y if b is None else y + b
    return outs


class StandaloneWeights:
    """How the engine reads the weights of the module trees it builds itself (``engine.modules``):
    the default weight hook of ``bind``. The application layer that loaded a model in its own
    formats passes an object with the same three methods (ComfyUI's: ``patches.comfy_weights.Resolver``).
    """

    def linear(self, module, device: torch.device, dtype: torch.dtype) -> tuple[PlainLinear | None, str | None]:
        """A Linear-like module's ``PlainLinear`` over its own storage, or ``(None, why not)``: then
        the module is called (it casts per call)."""
        w, b = getattr(module, "weight", None), getattr(module, "bias", None)
        if type(w) not in (torch.Tensor, torch.nn.Parameter) or w.dim() != 2:
            return None, f"{type(module).__name__} has no plain 2-D weight"
        if w.device != device or w.dtype != dtype:
            return None, f"its weight is {w.dtype} on {w.device} and the step runs in {dtype} on {device}"
        if b is not None and (b.device != device or b.dtype != dtype):
            return None, f"its bias is {b.dtype} on {b.device} and the step runs in {dtype} on {device}"
        return PlainLinear(w.detach(), bias=None if b is None else b.detach()), None

    def tensor_reason(self, module, device: torch.device) -> str | None:
        """None when ``module``'s own parameters (a norm's, a conv's) can be read as they are, on ``device``."""
        for name, p in module.named_parameters(recurse=False):
            if p.device != device:
                return f"its {name} lives on {p.device}, not {device}"
        return None

    def module_call_reason(self, module) -> str | None:
        """None when calling ``module`` inside a CUDA graph is safe (pure device work)."""
        return None

    def norm_scale(self, module, dtype: torch.dtype) -> torch.Tensor:
        """The float32 factor ``[dim]`` a (1 + w) / w RMSNorm module multiplies by, rounded as its
        forward rounds it (``engine.modules.RMSNorm``: float32 ``w + 1``)."""
        w = module.weight.detach()
        return w.float() + 1.0 if module.add else w.float()
