"""Several decode rows times an int8 weight read in place, in plain torch (no Triton): the MTP verify
and catch-up rows of the path without the fused kernels, for the weights whose ComfyUI call of
several rows cannot be captured in a CUDA graph here (comfy-kitchen 0.2.24's int8 product at
K = 12288 on Hopper: ``graphs.GraphRunner`` finds them when a capture fails and routes them here).

The math of comfy-kitchen's ``int8_linear`` (ComfyUI's ``int8_tensorwise`` call): the input rotated
by the layer's ConvRot group (``kernels.convrot``, float32), quantized per row to int8 (scale =
row amax / 127, round half to even), ``torch._int_mm`` (cuBLASLt int8, int32 sums; its row count
padded to ``PAD_ROWS``, since it takes more than 16), then times the row scale and the weight's
per-output scale (float32), plus the bias, in the input's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.convrot import hadamard_cached, hadamard_rotate_torch
from .plain_weights import PlainLinear

#: Rows ``torch._int_mm`` is given (it needs more than 16; a multiple of 8).
PAD_ROWS = 32

def int8_rows_ok(plain: PlainLinear | None) -> bool:
    """True for an int8 weight ``[N, K]`` with one float32 scale per output this product reads."""
    return (plain is not None and plain.packed is None and plain.weight.dtype == torch.int8
            and plain.scale is not None and plain.scale.numel() == plain.weight.shape[0])


def int8_rows(x: torch.Tensor, plain: PlainLinear) -> torch.Tensor:
    """x ``[..., K]`` (at most ``PAD_ROWS`` rows, bf16 / fp16 / fp32) -> ``[..., N]`` in x's dtype."""
    k = x.shape[-1]
    rows = x.reshape(-1, k).float()
    m = rows.shape[0]
    if m > PAD_ROWS:
        raise ValueError(f"int8_rows takes at most {PAD_ROWS} rows, got {m}")
    if plain.convrot:
        rows = hadamard_rotate_torch(rows, hadamard_cached(plain.convrot, x.device, torch.float32))
    scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0
    q = (rows / scale).round_().clamp_(-127, 127).to(torch.int8)
    acc = torch._int_mm(F.pad(q, (0, 0, 0, PAD_ROWS - m)), plain.weight.t())[:m]
    y = acc.float() * scale * plain.scale.view(1, -1).float()
    if plain.bias is not None:
        y = y + plain.bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], -1)
