"""A real ComfyUI tree in this process, checkpoints in its int8_convrot format, and what the tests
that run it share: greedy sampling arguments and a log-line filter (test helpers)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

#: Greedy decoding, spelled as core ComfyUI's ``generate`` takes its sampling arguments.
GREEDY = dict(do_sample=False, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, seed=0,
              presence_penalty=0.0)


def log_lines(caplog, needle: str) -> list[str]:
    """The captured log messages that contain ``needle``, oldest first."""
    return [r.getMessage() for r in caplog.records if needle in r.getMessage()]


def import_comfyui(tree: str):
    """Import ComfyUI from ``tree`` (CPU mode where there is no CUDA) and return its ``comfy`` package
    with ``ops``, ``sd``, ``model_management``, ``utils`` and ``text_encoders.qwen35`` loaded; skips
    when another ``comfy`` (the test stub) is already imported or the tree does not import here."""
    loaded = sys.modules.get("comfy")
    where = [str(Path(x).resolve()) for x in getattr(loaded, "__path__", None) or [getattr(loaded, "__file__", "")]]
    if loaded is not None and not any(w.startswith(str(Path(tree).resolve())) for w in where):
        pytest.skip("another 'comfy' package (the test stub) is already imported: run this file on its own")
    sys.path.insert(0, tree)
    try:
        import comfy.cli_args

        if not torch.cuda.is_available():
            comfy.cli_args.args.cpu = True
        import comfy.model_management
        import comfy.ops
        import comfy.sd
        import comfy.text_encoders.qwen35
        import comfy.utils
    except ImportError as exc:
        pytest.skip(f"ComfyUI at {tree} cannot be imported here ({exc}); use ComfyUI's Python")
    return comfy


def fp8_scaled(tensors: dict, dtype: torch.dtype = torch.float8_e4m3fn) -> dict:
    """Every Linear weight (2-D, not the embedding) as ComfyUI's save path writes a per-tensor fp8
    format: ``<layer>.weight`` in ``dtype``, a float32 ``<layer>.weight_scale`` and a
    ``<layer>.comfy_quant`` JSON tensor (``{"format": "float8_e4m3fn"}``), quantized by comfy-kitchen
    as ComfyUI's fp8 layouts quantize (scale = amax / the format's max)."""
    import comfy_kitchen as ck

    conf = {"format": str(dtype).replace("torch.", "")}
    marker = torch.tensor(list(json.dumps(conf).encode("utf-8")), dtype=torch.uint8)
    out = {}
    for key, w in tensors.items():
        if key.endswith(".weight") and w.ndim == 2 and "embed_tokens" not in key:
            scale = (w.abs().amax() / torch.finfo(dtype).max).float()
            out[key] = ck.quantize_per_tensor_fp8(w, scale, dtype)
            out[key + "_scale"] = scale
            out[key[: -len("weight")] + "comfy_quant"] = marker.clone()
        else:
            out[key] = w
    return out


def int8_convrot(tensors: dict, group: int = 256) -> dict:
    """Every Linear weight (2-D, not the embedding) as ComfyUI's save path writes int8_tensorwise +
    ConvRot: int8 ``<layer>.weight``, float32 per-row ``<layer>.weight_scale`` and a
    ``<layer>.comfy_quant`` JSON tensor, quantized by comfy-kitchen."""
    from comfy_kitchen.tensor import QuantizedTensor

    conf = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": group}
    marker = torch.tensor(list(json.dumps(conf).encode("utf-8")), dtype=torch.uint8)
    out = {}
    for key, w in tensors.items():
        if key.endswith(".weight") and w.ndim == 2 and "embed_tokens" not in key:
            qt = QuantizedTensor.from_float(w, "TensorWiseINT8Layout", is_weight=True, per_channel=True,
                                            convrot=True, convrot_groupsize=group)
            out.update(qt.state_dict(key))  # "<layer>.weight" int8 and "<layer>.weight_scale" float32
            out[key[: -len("weight")] + "comfy_quant"] = marker.clone()
        else:
            out[key] = w
    return out


#: ComfyUI's 4-bit formats -> comfy-kitchen's layout class names (``comfy/quant_ops.py`` QUANT_ALGOS).
FOUR_BIT_LAYOUTS = {"convrot_w4a4": "TensorCoreConvRotW4A4Layout", "nvfp4": "TensorCoreNVFP4Layout"}


def mixed_formats(tensors: dict, fmt_of, group: int = 256) -> dict:
    """Linear weights (2-D, not the embedding) in the format ``fmt_of(key)`` names, layer by layer, as
    ComfyUI's save path writes them: ``convrot_w4a4`` (int8-packed int4 ``<layer>.weight``, float32
    per-row ``weight_scale``, ``{"format": "convrot_w4a4", "convrot_groupsize": G}``), ``nvfp4``
    (uint8 ``weight``, float8 ``weight_scale``, float32 ``weight_scale_2``), ``int8`` (as
    ``int8_convrot``); None keeps the tensor. Quantized by comfy-kitchen."""
    from comfy_kitchen.tensor import QuantizedTensor

    out = {}
    for key, w in tensors.items():
        fmt = fmt_of(key) if key.endswith(".weight") and w.ndim == 2 and "embed_tokens" not in key else None
        if fmt is None:
            out[key] = w
            continue
        if fmt == "int8":
            out.update(int8_convrot({key: w}, group))
            continue
        kw = {"convrot_groupsize": group} if fmt == "convrot_w4a4" else {}
        out.update(QuantizedTensor.from_float(w, FOUR_BIT_LAYOUTS[fmt], **kw).state_dict(key))
        conf = dict({"format": fmt}, **kw)
        out[key[: -len("weight")] + "comfy_quant"] = torch.tensor(list(json.dumps(conf).encode("utf-8")),
                                                                   dtype=torch.uint8)
    return out


def comfy_qwen35(comfy, sd, d, ops=None, layout=None):
    """ComfyUI's ``Qwen35`` (no vision tower) with ``ops`` (default ``manual_cast``), loaded from
    ``sd`` in ComfyUI's key layout (``layout(sd)`` first when given, e.g. int8 quantization)."""
    from .tiny import to_layout

    comfy_ops, qwen35 = comfy
    ops = comfy_ops.manual_cast if ops is None else ops
    cfg = qwen35.Qwen35Config(
        vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
        num_hidden_layers=d["num_hidden_layers"], num_attention_heads=d["num_attention_heads"],
        num_key_value_heads=d["num_key_value_heads"], head_dim=d["head_dim"],
        linear_num_key_heads=d["linear_num_key_heads"], linear_num_value_heads=d["linear_num_value_heads"],
        linear_key_head_dim=d["linear_key_head_dim"], linear_value_head_dim=d["linear_value_head_dim"],
        layer_types=list(d["layer_types"]), lm_head=not d["tied"], stop_tokens=[])

    class Tiny(qwen35.Qwen35):  # ComfyUI's class without its (large) vision tower
        def __init__(self):
            torch.nn.Module.__init__(self)
            self.num_layers = cfg.num_hidden_layers
            self.model = qwen35.Qwen35Transformer(cfg, device="cpu", dtype=torch.float32, ops=ops)
            self.dtype = torch.float32
            self.mtp = None  # newer core's own MTP head slot (built by load_clip from mtp.* tensors)

    model = Tiny()
    text = {k: v for k, v in sd.items() if not k.startswith("mtp.")}
    text = to_layout(text, "comfyui")
    missing, unexpected = model.load_state_dict(text if layout is None else layout(text), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return model
