"""The tensors a converted Qwen3.5 layer is written as (``convert_4bit.py``), Triton-free: the float32
weight ComfyUI computes with for a source layer (``source_float``), comfy-kitchen's quantizers on it
(``quantized``: convrot_w4a4 after ``w4a4_input``'s row clipping, nvfp4 after ``nvfp4_input``, the
embedding table's per-row int8 in slices by ``int8_rows``), the dtype and shape each written tensor
has (``planned``, for the header written before any value) and the relative weight error of what
was written (``weight_error``).
"""

from __future__ import annotations

import torch

from ..kernels.packed4 import round_up

__all__ = ["CLIP_RATIOS", "EMBEDDING_ROWS", "GROUP", "INT8_ROWS", "NonFiniteWeight", "int8_rows", "nvfp4_input",
           "planned", "quantized", "source_float", "w4a4_input", "weight_error"]

GROUP = 256  # ConvRot group of the written convrot_w4a4 layers (ComfyUI's default)
INT8_ROWS = {"format": "int8_tensorwise"}  # the embedding's comfy_quant: int8, one float32 scale per row


def source_float(f, key: str, conf: dict | None) -> torch.Tensor:
    """The float32 weight ComfyUI computes with for ``key`` (an int8_tensorwise layer dequantized by
    comfy-kitchen as ComfyUI does, ConvRot included)."""
    w = f.get_tensor(key)
    if conf is None:
        return w.float()
    from comfy_kitchen.tensor import QuantizedTensor, TensorWiseINT8Layout

    layer = key[: -len(".weight")]
    convrot = bool(conf.get("convrot", (conf.get("params") or {}).get("convrot", False)))
    params = TensorWiseINT8Layout.Params(
        scale=f.get_tensor(layer + ".weight_scale").float(), orig_dtype=torch.float32, orig_shape=tuple(w.shape),
        convrot=convrot, convrot_groupsize=int(conf.get("convrot_groupsize", 256)))
    return QuantizedTensor(w, "TensorWiseINT8Layout", params).dequantize().float()


def quantized(w: torch.Tensor, fmt: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(``{suffix: tensor}`` as ComfyUI's state_dict writes the layer, its comfy_quant) from kitchen;
    ``fmt`` a 4-bit format or "int8" (the embedding table)."""
    from comfy_kitchen.tensor import QuantizedTensor

    if fmt == "int8":  # the embedding: kitchen's row-wise int8 (ComfyUI's int8_tensorwise, a scale per row)
        qt = QuantizedTensor.from_float(w, "TensorWiseINT8Layout", per_channel=True)
        conf = dict(INT8_ROWS)
    elif fmt == "convrot_w4a4":
        qt = QuantizedTensor.from_float(w4a4_input(w), "TensorCoreConvRotW4A4Layout", convrot_groupsize=GROUP)
        conf = {"format": fmt, "convrot_groupsize": GROUP}
    else:
        qt = QuantizedTensor.from_float(nvfp4_input(w), "TensorCoreNVFP4Layout")
        conf = {"format": fmt}
    return qt.state_dict(""), conf


#: the clipping thresholds ``w4a4_input`` tries, as fractions of a rotated row's largest magnitude
CLIP_RATIOS = tuple(0.5 + 0.05 * i for i in range(11))


def w4a4_input(w: torch.Tensor) -> torch.Tensor:
    """``w`` ``[n, k]`` as the converter gives it to comfy-kitchen's convrot_w4a4 quantizer: each row,
    ConvRot-rotated in groups of ``GROUP`` as kitchen rotates it, clipped at the threshold (a
    ``CLIP_RATIOS`` fraction of its largest magnitude, 1.0 included) whose int4 rounding (kitchen's:
    scale = largest magnitude / 7, round, clamp to +-7) has the least squared error, then rotated
    back. Kitchen's absmax of the row is then that threshold: the stored format is unchanged, and a
    row of Gaussian-like values loses about a quarter of its rounding error (one scale per row spends
    most of its 15 levels on a few outliers otherwise). float32 out; rows of another width unchanged."""
    from ..kernels.convrot import hadamard

    n, k = w.shape
    if k % GROUP:
        return w
    h = hadamard(GROUP, dtype=torch.float32, device=w.device)
    r = (w.float().reshape(n, k // GROUP, GROUP) @ h.T).reshape(n, k)
    amax = r.abs().amax(1, keepdim=True).clamp_min(1e-10)
    best, keep = torch.full_like(amax, float("inf")), amax
    for ratio in CLIP_RATIOS:
        t = amax * ratio
        err = ((r / (t / 7)).round().clamp(-7, 7) * (t / 7) - r).square().sum(1, keepdim=True)
        better = err < best
        best, keep = torch.where(better, err, best), torch.where(better, t, keep)
    r = torch.minimum(torch.maximum(r, -keep), keep)
    return (r.reshape(n, k // GROUP, GROUP) @ h).reshape(n, k)


def nvfp4_input(w: torch.Tensor) -> torch.Tensor:
    """``w`` as comfy-kitchen's NVFP4 quantizer takes it: its CUDA kernel takes bf16 / fp16 only
    (float32 raises "Unsupported dtype code"), so a float32 weight on a GPU is rounded to bf16 first
    (2^-9 relative, far below the 4-bit step); elsewhere as it is."""
    return w.to(torch.bfloat16) if w.is_cuda and w.dtype == torch.float32 else w


def planned(fmt: str, n: int, k: int) -> dict[str, tuple[str, list[int]]]:
    """The safetensors dtype and shape of each tensor a quantized ``[n, k]`` layer writes (``fmt`` "int8":
    the embedding's per-row int8)."""
    if fmt == "int8":
        return {"": ("I8", [n, k]), "_scale": ("F32", [n, 1])}
    if fmt == "convrot_w4a4":
        return {"": ("I8", [n, k // 2]), "_scale": ("F32", [n])}
    n16, k16 = round_up(n, 16), round_up(k, 16)
    return {"": ("U8", [n16, k16 // 2]), "_scale": ("F8_E4M3", [round_up(n16, 128), round_up(k16 // 16, 4)]),
            "_scale_2": ("F32", [])}


class NonFiniteWeight(ValueError):
    """The source weight ``key`` holds NaN or infinite values."""

    def __init__(self, key: str):
        super().__init__(f"{key} holds NaN or infinite values")
        self.key = key


EMBEDDING_ROWS = 16384  # rows of the embedding table quantized at a time (256 MB of float32 at 4096 wide)


def int8_rows(f, key: str, dev: torch.device) -> tuple[dict[str, torch.Tensor], float]:
    """({suffix: tensor} of the float table ``key`` in per-row int8, its relative weight error), the
    rows read, quantized and checked ``EMBEDDING_ROWS`` at a time (each row has its own scale, so
    the result is the whole table's): the peak is one slice, not the 4 GB float32 table of the 9B.
    NonFiniteWeight when a value of the table is NaN or infinite."""
    sl = f.get_slice(key)
    rows = sl.get_shape()[0]
    parts, sq_err, sq_ref = {}, 0.0, 0.0
    for lo in range(0, rows, EMBEDDING_ROWS):
        w = sl[lo:lo + EMBEDDING_ROWS].float().to(dev)
        if not bool(torch.isfinite(w).all()):
            raise NonFiniteWeight(key)
        tensors, _ = quantized(w, "int8")
        for suffix, t in tensors.items():
            parts.setdefault(suffix, []).append(t.cpu())
        wq = tensors[""].float() * tensors["_scale"].float()
        sq_err += float((wq - w).square().sum())
        sq_ref += float(w.square().sum())
    return {k: torch.cat(v) for k, v in parts.items()}, (sq_err / max(sq_ref, 1e-60)) ** 0.5


def weight_error(tensors: dict, fmt: str, w: torch.Tensor) -> float:
    """|W4 - W| / |W| with W4 as ComfyUI dequantizes the written tensors."""
    from ..kernels.packed4 import Packed4, dequantize

    n, k = w.shape
    p = Packed4(fmt, tensors[""], tensors["_scale"] if fmt == "convrot_w4a4" else tensors["_scale_2"],
                tensors.get("_scale") if fmt == "nvfp4" else None, n, k, GROUP if fmt == "convrot_w4a4" else 0)
    w = w.float().cpu()
    return float((dequantize(p) - w).norm() / w.norm().clamp_min(1e-30))
