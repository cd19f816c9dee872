"""The MTP head (``mtp.*`` tensors) of a freshly loaded ComfyUI Qwen3.5 CLIP: never two of them.

ComfyUI 0.29.0 drops ``mtp.*`` keys, and the Comfy-Org prompt-enhancer files carry none, so the pack
reads them itself (only the ``mtp.*`` entries, through safetensors' ``safe_open``), builds the head
with the engine and attaches it as ``mtp`` of the decoder module tree, where the engine's binding
looks for it. Newer ComfyUI builds its own head (``Qwen35.mtp``, with ComfyUI's ops, used by core's
MTP loop): the binding finds it there, and a chosen head file is loaded into that module
(``replace_core_head``) rather than grafted beside it. The files are never rewritten. Beside a 4-bit
model (``four_bit``), where Triton runs, the grafted head's projections are held as int8 rows, one
scale per row (``engine.modules.Int8Linear``): 0.24 GB instead of 0.49 on the 9B, and fewer bytes
per draft.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

from ..engine import Qwen35Error, bind, build_mtp_head, int8_head
from ..kernels.capabilities import triton_module
from . import comfy_bridge as bridge
from .comfy_weights import W4_LAYOUTS

log = logging.getLogger(__name__)

MTP_PREFIXES = ("mtp.", "model.mtp.")
QWEN35_MARKER = "model.language_model.layers.0.linear_attn.A_log"


class MTPHeadError(ValueError):
    """The MTP file is missing, unreadable, has no ``mtp.*`` tensors, or does not fit the model."""


def file_keys(path: str) -> list[str]:
    """Tensor names in a safetensors file (header only); ValueError naming the file when unreadable."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            return list(f.keys())
    except Exception as exc:  # noqa: BLE001 - any parse failure is a bad file for the user
        raise MTPHeadError(f"Cannot read {path!r} as safetensors ({exc}). Re-download the file.") from exc


_QUANT_WEIGHT_DTYPES = ("I8", "F8_E4M3", "F8_E5M2")  # a weight quantized the ComfyUI way (``.comfy_quant``)


def check_head_header(mtp_path: str, main_path: str) -> None:
    """Before the main checkpoint loads: MTPHeadError naming ``mtp_path`` and the fix unless its header
    alone (no tensor data read) is a valid safetensors header with ``mtp.*`` tensors (``model.mtp.``
    folded) in float dtypes (a layer quantized the ComfyUI way: int8 / fp8 weight beside its
    ``.comfy_quant`` marker) and, when the text encoder's size can be told from ``main_path``'s header,
    exactly the names and shapes of that size's head. Values (NaN / inf) are checked when read."""
    from ..downloads.head_check import FLOAT_DTYPES
    from ..downloads.hub_client import FetchError
    from ..downloads.safetensors_header import local_header, tensor_shapes
    from ..engine import Qwen35Config

    name, main = os.path.basename(mtp_path), os.path.basename(main_path)
    fix = ("Pick the MTP head of the same Qwen3.5 size (for the 9B prompt enhancer: 'download (Qwen/Qwen3.5-9B)', "
           "or make one with the pack's tools/extract_mtp_head.py), or set mtp_head to 'none'.")
    try:
        header = local_header(mtp_path)
    except FetchError as exc:
        raise MTPHeadError(f"The MTP head file {name} cannot be read: {exc} {fix}") from exc
    head = {"mtp." + k[len(p):]: v for k, v in header.items() for p in MTP_PREFIXES if k.startswith(p)}
    if not head:
        raise MTPHeadError(f"{name} has no mtp.* tensors. Use a file holding the MTP head of Qwen/Qwen3.5-9B "
                           "(pick 'download (Qwen/Qwen3.5-9B)', or make one with the pack's "
                           "tools/extract_mtp_head.py), or set mtp_head to 'none'.")
    quantized = {k[: -len("comfy_quant")] for k in head if k.endswith(".comfy_quant")}
    dense = {}
    for key, entry in head.items():
        layer = key.rsplit(".", 1)[0] + "."
        if layer in quantized and key.endswith(_QUANT_AUX):
            continue
        dense[key] = tuple(int(s) for s in entry["shape"])
        allowed = FLOAT_DTYPES + (_QUANT_WEIGHT_DTYPES if layer in quantized else ())
        if entry["dtype"] not in allowed:
            raise MTPHeadError(f"{name}: {key} is stored as {entry['dtype']}, not a float dtype "
                               f"({', '.join(FLOAT_DTYPES)}); the file is not an MTP head. {fix}")
    try:
        want = Qwen35Config.from_state_dict(tensor_shapes(local_header(main_path))).mtp_shapes()
    except (FetchError, Qwen35Error, KeyError, ValueError) as exc:
        log.info("%s: the model size cannot be told from its header (%s); %s is checked after loading", main, exc,
                 name)
        return
    bad = [f"{k} is missing" for k in want if k not in dense]
    bad += [f"{k} has shape {dense[k]}, the model needs {tuple(s)}" for k, s in want.items()
            if k in dense and dense[k] != tuple(s)]
    bad += [f"{k} is not part of this model's head" for k in dense if k not in want]
    if bad:
        raise MTPHeadError(f"The MTP head in {name} does not fit {main} (checked from the headers, before loading): "
                           f"{bad[0]}" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "") + f". {fix}")


def is_qwen35_file(keys: Iterable[str]) -> bool:
    """True when the tensor names are those of a Qwen3.5 checkpoint ComfyUI recognises."""
    return QWEN35_MARKER in set(keys)


def read_mtp_tensors(path: str, device="cpu") -> dict:
    """Only the ``mtp.*`` tensors of ``path`` (``model.mtp.`` folded to ``mtp.``); {} when none.
    Quantized layers (ComfyUI's per-layer ``.comfy_quant`` marker) come back dequantized; a tensor
    with NaN or inf values is refused (``refuse_non_finite``)."""
    from safetensors import safe_open

    out = {}
    try:
        with safe_open(path, framework="pt", device=str(device)) as f:
            for key in f.keys():
                for prefix in MTP_PREFIXES:
                    if key.startswith(prefix):
                        out["mtp." + key[len(prefix):]] = f.get_tensor(key)
                        break
    except Exception as exc:  # noqa: BLE001
        raise MTPHeadError(f"Cannot read the MTP head from {path!r} ({exc}).") from exc
    return refuse_non_finite(dequantized(out, source=path), source=path)


def refuse_non_finite(tensors: dict, *, source: str = "") -> dict:
    """``tensors`` unchanged; MTPHeadError naming the first floating tensor holding NaN or inf (such a head
    drafts garbage, so MTP would accept nothing and only cost time)."""
    import torch

    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise MTPHeadError(f"{source}: {name} holds NaN or infinite values, so MTP with this head would accept "
                               "no draft. Re-download the head (delete the file and pick 'download (...)'), or set "
                               "mtp_head to 'none'.")
    return tensors


def dequantized(tensors: dict, *, source: str = "", dtype=None) -> dict:
    """``tensors`` with every ComfyUI-quantized layer (``<layer>.comfy_quant`` JSON, ``<layer>.weight``,
    ``<layer>.weight_scale``) replaced by its dense ``<layer>.weight`` (bf16 unless ``dtype``), the way
    ComfyUI's own ops dequantize it (int8_tensorwise with or without ConvRot, fp8)."""
    import json

    import torch

    markers = [k for k in tensors if k.endswith(".comfy_quant")]
    if not markers:
        return tensors
    out = dict(tensors)
    dtype = dtype or torch.bfloat16
    for key in markers:
        layer = key[: -len("comfy_quant")]
        try:
            conf = json.loads(bytes(out.pop(key).tolist()).decode("utf-8"))
        except (TypeError, ValueError, OverflowError) as exc:
            raise MTPHeadError(f"{source}: the quantization marker {key!r} is not JSON text; the file is corrupt. "
                               "Re-download it, or use a bf16 MTP head file.") from exc
        if not isinstance(conf, dict):
            raise MTPHeadError(f"{source}: the quantization marker {key!r} is not a JSON object; the file is "
                               "corrupt. Re-download it, or use a bf16 MTP head file.")
        fmt = conf.get("format")
        weight, scale = out.pop(layer + "weight", None), out.pop(layer + "weight_scale", None)
        if weight is None or scale is None:
            raise MTPHeadError(f"{source}: quantized layer {layer[:-1]} lacks its weight or weight_scale.")
        params = conf.get("params") if isinstance(conf.get("params"), dict) else {}
        convrot = bool(conf.get("convrot", params.get("convrot", False)))
        if fmt == "int8_tensorwise" and convrot:
            try:
                from comfy.quant_ops import QuantizedTensor, get_layout_class
            except ImportError as exc:
                raise MTPHeadError(f"{source}: {layer}weight is int8 ConvRot, which needs ComfyUI's "
                                   "comfy-kitchen to read; update ComfyUI.") from exc
            group = int(conf.get("convrot_groupsize", params.get("convrot_groupsize", 256)))
            layout = "TensorWiseINT8Layout"
            p = get_layout_class(layout).Params(scale=scale.float(), orig_dtype=dtype, orig_shape=tuple(weight.shape),
                                                convrot=True, convrot_groupsize=group)
            out[layer + "weight"] = QuantizedTensor(weight, layout, p).dequantize().to(dtype)
        elif fmt in ("int8_tensorwise", "float8_e4m3fn", "float8_e5m2"):
            out[layer + "weight"] = (weight.float() * scale.float()).to(dtype)
        else:
            raise MTPHeadError(f"{source}: MTP layer {layer[:-1]} is stored as {fmt!r}, which this pack cannot "
                               "read; use a bf16 MTP head file.")
    return out


def _engine_config(target: bridge.Qwen35Target):
    """The engine's config for the loaded ComfyUI model (through its binding)."""
    binding = bind(target.transformer)
    config = getattr(binding, "config", None)
    if config is None:
        raise bridge.Qwen35Unsupported("The engine binding exposes no config; cannot size the MTP head.")
    return config


def _model_dtype_device(model):
    """dtype/device for the head: those of the model's norm weights (floating, never int8)."""
    import torch

    for p in model.parameters():
        if p.is_floating_point() and p.dtype in (torch.float16, torch.bfloat16, torch.float32):
            return p.dtype, p.device
    return torch.float32, torch.device("cpu")


def graft_mtp(clip, tensors: dict, *, source: str = "") -> int:
    """Build the MTP head from ``tensors`` and attach it to ``clip``'s Qwen3.5; return its parameter count.

    Raises MTPHeadError naming the file and the tensor when the head does not fit the model.
    """
    target = bridge.find_qwen35(clip)
    config = _engine_config(target)
    dtype, device = _model_dtype_device(target.model)
    try:
        head = build_mtp_head(tensors, config, dtype=dtype, device=device)
    except (Qwen35Error, KeyError, ValueError, RuntimeError) as exc:
        raise MTPHeadError(
            f"The MTP head in {source or 'the file'} does not fit this Qwen3.5 model: {exc}. Use the "
            "mtp.* tensors of the same Qwen3.5 size (for the 9B prompt enhancer: those of "
            "Qwen/Qwen3.5-9B).") from exc
    n = sum(p.numel() for p in head.parameters())
    if four_bit(target.model):
        why = triton_module("gemv")[1]
        if why is None:
            saved = int8_head(head)
            log.info("Qwen3.5 MTP head held as int8 rows beside the 4-bit model (%.2f GB less; it only drafts, "
                     "so the drafts' acceptance may change, the output never does)", saved / 1e9)
        else:  # its module call would widen every weight per draft: more bytes than the 16-bit head
            log.info("Qwen3.5 MTP head kept in %s beside the 4-bit model: int8 rows are read in place only by "
                     "the Triton kernels (%s)", dtype, why)
    target.model.mtp = head
    patcher = getattr(clip, "patcher", None)
    if getattr(patcher, "size", 0):  # ComfyUI's cached model size predates the head: counted anew at next use
        patcher.size = 0
    log.info("Qwen3.5 MTP head grafted from %s (%.1f M parameters)", source or "memory", n / 1e6)
    return n


def four_bit(model) -> bool:
    """True when any projection of ``model`` holds ComfyUI 4-bit weights (convrot_w4a4 / nvfp4): the
    grafted MTP head is then kept as int8 rows (``engine.modules.Int8Linear``), half its bf16 bytes,
    where the Triton kernels that read them in place import."""
    return any(getattr(getattr(m, "weight", None), "_layout_cls", None) in W4_LAYOUTS for m in model.modules())


def core_mtp_head(clip):
    """ComfyUI's own MTP head (``Qwen35.mtp``, built by newer core ``load_clip``), or None."""
    return getattr(bridge.find_qwen35(clip).transformer, "mtp", None)


_QUANT_AUX = ("comfy_quant", "weight_scale", "weight_scale_2", "input_scale")


def replace_core_head(clip, tensors: dict, *, source: str = "") -> int:
    """Load ``tensors`` (``mtp.*``) into ComfyUI's own MTP head of ``clip``; return its parameter count.

    Every tensor of the head must be in ``tensors`` with the same shape (MTPHeadError naming the first
    that is missing or differs, and any extra one), so core's MTP loop and the engine both run the
    chosen head and no second head exists.
    """
    head = core_mtp_head(clip)
    if head is None:
        raise MTPHeadError("This CLIP has no ComfyUI MTP head to replace.")
    new = {k[len("mtp."):]: v for k, v in tensors.items() if k.startswith("mtp.")}
    have = {k: tuple(v.shape) for k, v in head.state_dict().items() if not k.endswith(_QUANT_AUX)}
    bad = [f"mtp.{k} missing" for k in have if k not in new]
    bad += [f"mtp.{k} has shape {tuple(new[k].shape)}, the model needs {shape}" for k, shape in have.items()
            if k in new and tuple(new[k].shape) != shape]
    bad += [f"mtp.{k} is not part of this model's head" for k in new if k not in have and not k.endswith(_QUANT_AUX)]
    if bad:
        raise MTPHeadError(
            f"The MTP head in {source or 'the file'} does not fit this Qwen3.5 model: {bad[0]}"
            + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "") + ". Use the mtp.* tensors of the same "
            "Qwen3.5 size (for the 9B prompt enhancer: those of Qwen/Qwen3.5-9B).")
    missing, unexpected = head.load_state_dict(new, strict=False)
    missing = [k for k in missing if not k.endswith(_QUANT_AUX)]
    if missing or unexpected:
        raise MTPHeadError(f"The MTP head in {source or 'the file'} did not load: missing {missing}, "
                           f"unexpected {unexpected}.")
    n = sum(p.numel() for p in head.parameters())
    log.info("Qwen3.5 MTP head from %s loaded into ComfyUI's own head (%.1f M parameters)", source or "memory",
             n / 1e6)
    return n
