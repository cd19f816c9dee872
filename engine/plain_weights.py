"""Linear weights as plain tensors the decode-row kernels read directly.

The engine calls a layer's own Linear module for prefill (and wherever no plain weight is known);
for decode, draft and verify rows (S <= 8) the fused path reads ``PlainLinear`` records instead:
the same storage the module holds (never a copy), in one of two formats:

* dense: ``weight`` ``[N, K]`` in the execution dtype -> the Triton GEMV (which an H200 measured
  ahead of cuBLAS's ``F.linear`` at every 9B decode shape, and grouped: ``benchmarks/int8_gemv.py``);
* int8: ``weight`` int8 ``[N, K]`` with a float32 ``scale`` per output row (``[N]``) or per tensor
  (``[]``), optionally ConvRot-rotated (``convrot`` = the group size G the rows were rotated in,
  ``W_rot = W @ H_G.T`` per group): x is rotated once per input (one launch), then the
  weight-only int8 GEMV runs;
* fp8: ``weight`` float8_e4m3fn / float8_e5m2 ``[N, K]`` with a float32 ``scale`` per tensor (the
  same GEMV, the bytes widened as fp8).
* 4-bit: ``packed`` a ``kernels.packed4.Packed4`` (ComfyUI's ``convrot_w4a4`` or ``nvfp4`` storage
  read in place; ``weight`` is its packed bytes, ``scale`` its scale, ``convrot`` its group) ->
  ``kernels/gemv4.py``.

Who knows a module's storage (ComfyUI's ops, quantized tensors, offloading) builds these records:
``StandaloneWeights`` for the engine's own modules, ``patches/comfy_weights.py`` for ComfyUI's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels.capabilities import QUANT_DTYPES
from ..kernels.packed4 import Packed4
from ..kernels.row_norm import RowNorm, factor


@dataclass(frozen=True)
class PlainLinear:
    """``y = x @ weight.T (* scale) + bias``; see the module docstring for the formats."""

    weight: torch.Tensor
    scale: torch.Tensor | None = None
    convrot: int = 0
    bias: torch.Tensor | None = None
    packed: Packed4 | None = None

    @property
    def quantized(self) -> bool:
        """int8, fp8 or 4-bit (with scales), as opposed to a weight in the execution dtype."""
        return self.packed is not None or self.weight.dtype in QUANT_DTYPES

    @property
    def shape(self) -> tuple[int, int]:
        """The logical ``(N, K)`` of the product (a 4-bit weight stores K / 2 bytes a row)."""
        return (self.packed.n, self.packed.k) if self.packed is not None else tuple(self.weight.shape)

    @property
    def kind(self) -> str:
        """The format, as the per-generation log line counts it: ``int8+ConvRot``, ``convrot_w4a4``,
        ``nvfp4``, ``float8_e4m3fn``, ``bfloat16``, ..."""
        if self.packed is not None:
            return self.packed.fmt
        if self.weight.dtype == torch.int8:
            return "int8" + ("+ConvRot" if self.convrot else "")
        return str(self.weight.dtype).replace("torch.", "")


def first_rows(w: PlainLinear, n: int) -> PlainLinear | None:
    """The product of ``w``'s first ``n`` output rows, reading the same storage (views); None for a
    4-bit weight, whose block scales are not stored row by row."""
    if w.packed is not None:
        return None
    scale = w.scale
    if scale is not None and scale.ndim and scale.shape[0] == w.weight.shape[0]:
        scale = scale[:n]
    return PlainLinear(w.weight[:n], scale, w.convrot, None if w.bias is None else w.bias[:n])


def split_of(w: PlainLinear, rows: int) -> int:
    """The launch table's K ranges for ``w``'s product of ``rows`` rows whose consumer sums partials."""
    from ..kernels import launch

    n, k = w.shape
    if w.packed is not None:
        return launch.gemv4(n, k, w.packed.fmt, rows, w.weight.device)[1]
    return launch.split_k(n, k, w.quantized, rows, w.weight.device)


def _kernels():
    from ..kernels import gemv

    return gemv


def linear_rows(x: torch.Tensor, w: PlainLinear, *, rotated: tuple[int, torch.Tensor] | None = None,
                split: int = 1, row_norm: RowNorm | None = None,
                prefetch: torch.Tensor | None = None, prefetch_bytes: int | None = None) -> torch.Tensor:
    """x ``[..., K]`` (at most 16 rows in all, execution dtype) -> ``[..., N]`` in x's dtype.
    ``rotated`` and ``row_norm`` as for ``linear_group``. ``split=P > 1`` with a bias-free weight the
    GEMV takes: float32 partial products ``[P', ..., N]`` over K ranges instead
    (``kernels.gemv.gemv_group``), for a consumer that sums them (``fused_ops.add_rms_norm``);
    otherwise the product as usual."""
    gemv = _kernels()
    if w.packed is not None:
        if split > 1 and w.bias is None:
            src, rot = _source(x, w.convrot, rotated)
            return _gemv4().gemv4_group(src, [w.packed], rotate=bool(rot), split=split, row_norm=row_norm,
                                        prefetch=prefetch, prefetch_bytes=prefetch_bytes)[0]
    elif split > 1 and w.bias is None and gemv.gemv_reason(x, w.weight, w.scale) is None:
        src, rot = _source(x, w.convrot, rotated)
        return gemv.gemv_group(src, [w.weight], scales=None if w.scale is None else [w.scale], convrot=rot,
                               split=split, row_norm=row_norm, prefetch=prefetch,
                               prefetch_bytes=prefetch_bytes)[0]
    return linear_group(x, [w], rotated=rotated, row_norm=row_norm, prefetch=prefetch,
                        prefetch_bytes=prefetch_bytes)[0]


def _gemv4():
    from ..kernels import gemv4

    return gemv4


def _source(x: torch.Tensor, group: int, rotated: tuple[int, torch.Tensor] | None) -> tuple[torch.Tensor, int]:
    """(the rows a ConvRot-``group`` product reads, the rotation it must still apply)."""
    if group and rotated is not None and rotated[0] == group:
        return rotated[1], 0
    return x, group


def linear_group(x: torch.Tensor, weights: Sequence[PlainLinear], *,
                 rotated: tuple[int, torch.Tensor] | None = None,
                 row_norm: RowNorm | None = None, prefetch: torch.Tensor | None = None,
                 prefetch_bytes: int | None = None) -> list[torch.Tensor]:
    """``[linear_rows(x, w) for w in weights]`` as few launches: the Triton GEMV takes up to four
    weights of one kind per launch (int8 of one ConvRot group size, x rotated once for them; fp8 of
    one format; or weights in x's dtype); weights it cannot take (another dtype) go through ``F.linear``.
    x ``[..., K]``, at most 16 rows. ``rotated=(G, x_rot)``: x already ConvRot-rotated in groups of
    G (by the kernel that produced x): the ConvRot-G weights read x_rot, no rotation launch.
    ``row_norm``: x (and x_rot) is an RMSNorm's output without its per-row factor
    (``kernels/row_norm.py``): every product is multiplied by it before the bias. ``prefetch``: the
    next product's weight, for the last GEMV launch to ask L2 for (``gemv_group(prefetch=)``; its first
    ``prefetch_bytes``, default the launch table's: ``kernels/launch.py``)."""
    gemv = _kernels()
    outs: list[torch.Tensor | None] = [None] * len(weights)
    kinds: dict[tuple, list[int]] = {}
    for i, w in enumerate(weights):
        if w.packed is not None:  # 4-bit: one launch per format and ConvRot group
            why = _gemv4().gemv4_reason(x, w.packed)
            if why is not None:
                raise ValueError(f"a {w.packed.fmt} projection the 4-bit GEMV cannot take: {why}")
            kinds.setdefault((w.packed.fmt, w.convrot), []).append(i)
            continue
        why = gemv.gemv_reason(x, w.weight, w.scale)
        if why is None:
            kinds.setdefault((w.weight.dtype, w.convrot), []).append(i)
        elif w.quantized:
            raise ValueError(f"a {w.weight.dtype} projection the GEMV cannot take: {why}")
        elif row_norm is None:
            outs[i] = F.linear(x, w.weight, w.bias)
        else:
            y = (F.linear(x, w.weight).float() * factor(row_norm)).to(x.dtype)
            outs[i] = y if w.bias is None else y + w.bias
    launches = [(group, idx[start:start + gemv.MAX_GROUP]) for (_, group), idx in kinds.items()
                for start in range(0, len(idx), gemv.MAX_GROUP)]
    for n, (group, part) in enumerate(launches):
        src, rot = _source(x, group, rotated)
        last = n == len(launches) - 1  # the launch the next product follows: it alone prefetches
        if weights[part[0]].packed is not None:
            ys = _gemv4().gemv4_group(src, [weights[i].packed for i in part], rotate=bool(rot), row_norm=row_norm,
                                      prefetch=prefetch if last else None, prefetch_bytes=prefetch_bytes)
            for i, y in zip(part, ys):
                b = weights[i].bias
                outs[i] = y if b is None else y + b
            continue
        ys = gemv.gemv_group(src, [weights[i].weight for i in part],
                             scales=[weights[i].scale for i in part] if weights[part[0]].quantized else None,
                             convrot=rot, row_norm=row_norm, prefetch=prefetch if last else None,
                             prefetch_bytes=prefetch_bytes)
        for i, y in zip(part, ys):
            b = weights[i].bias
            outs[i] = y if b is None else y + b
    return outs


def int8_linear_record(module, device: torch.device) -> tuple[PlainLinear | None, str | None] | None:
    """For a ``modules.Int8Linear``: its int8 rows and row scales as a ``PlainLinear`` (or ``(None,
    why not)``); None for any other module. Both weight hooks ask this first: an Int8Linear whose
    weight is no longer int8 (cast by someone) must not be read as a dense weight."""
    scale = getattr(module, "row_scale", None)
    if not isinstance(scale, torch.Tensor):
        return None
    w = module.weight
    if w.dtype != torch.int8 or scale.dtype != torch.float32:
        return None, f"its int8 rows were cast to {w.dtype} / {scale.dtype}"
    if w.device != device or scale.device != device:
        return None, f"its int8 rows live on {w.device}, not {device}"
    return PlainLinear(w.detach(), scale=scale.detach()), None


class StandaloneWeights:
    """How the engine reads the weights of the module trees it builds itself (``engine.modules``):
    the default weight hook of ``bind``. The application layer that loaded a model in its own
    formats passes an object with the same three methods (ComfyUI's: ``patches.comfy_weights.Resolver``).
    """

    def linear(self, module, device: torch.device, dtype: torch.dtype) -> tuple[PlainLinear | None, str | None]:
        """A Linear-like module's ``PlainLinear`` over its own storage, or ``(None, why not)``: then
        the module is called (it casts per call)."""
        int8 = int8_linear_record(module, device)
        if int8 is not None:
            return int8
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
