"""Standalone loading of Qwen3.5 safetensors (HF or ComfyUI layout) and MTP-head building.

Every tensor is checked against the shapes the inferred config implies before anything is
built, so a bad file fails with one message naming the tensor, and nothing is half-loaded.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch

from .checkpoint_keys import canonical_map, layout_name
from .config import Qwen35Config
from .errors import Qwen35Error
from .modules import MTPHead, Qwen35ForGeneration, Qwen35TextModel

log = logging.getLogger(__name__)

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FLOAT_CODES = {"F32", "F16", "BF16", "F64"}


def _display(canon: str, layout: str) -> str:
    """How a canonical tensor name is spelled in a file of ``layout``."""
    if canon.startswith("mtp."):
        return canon
    if layout == "hf":
        return "lm_head.weight" if canon == "lm_head.weight" else f"model.language_model.{canon}"
    if layout == "comfyui":
        return f"model.{canon}"
    return canon


class _File:
    """An open safetensors file: canonical name -> original key, shapes and dtypes from the header."""

    def __init__(self, path: str):
        from safetensors import safe_open

        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise Qwen35Error(f"{self.path}: no such file")
        try:
            self.handle = safe_open(self.path, framework="pt", device="cpu")
            keys = list(self.handle.keys())
            self.shapes, self.codes = {}, {}
            for key in keys:
                sl = self.handle.get_slice(key)
                self.shapes[key] = tuple(sl.get_shape())
                self.codes[key] = str(sl.get_dtype())
        except Qwen35Error:
            raise
        except Exception as exc:  # safetensors raises its own error type for bad headers
            raise Qwen35Error(f"{self.path}: not a readable safetensors file ({type(exc).__name__}: {exc}); "
                              "the file may be truncated or corrupt: download it again") from exc
        quant = [k for k in keys if k.endswith(".comfy_quant")]
        if quant:
            raise Qwen35Error(f"{self.path}: quantized checkpoint ({quant[0]!r}); the standalone loader reads "
                              "bf16/fp16/fp32 weights only: load this file in ComfyUI instead")
        self.names = canonical_map(keys)
        self.layout = layout_name(keys)

    def shape_map(self, prefix_filter=None) -> dict[str, tuple[int, ...]]:
        return {c: self.shapes[k] for c, k in self.names.items() if prefix_filter is None or prefix_filter(c)}

    def tensor(self, canon: str, dtype: torch.dtype, device) -> torch.Tensor:
        key = self.names[canon]
        if self.codes[key] not in _FLOAT_CODES:
            raise Qwen35Error(f"{self.path}: tensor {key!r} has dtype {self.codes[key]}; expected a float type")
        try:
            t = self.handle.get_tensor(key)
        except Exception as exc:
            raise Qwen35Error(f"{self.path}: tensor {key!r} cannot be read ({exc}); the file may be truncated: "
                              "download it again") from exc
        return t.to(device=device, dtype=dtype)


def _check_shapes(expected: Mapping[str, tuple[int, ...]], found: Mapping[str, tuple[int, ...]], layout: str,
                  path: str, what: str) -> None:
    for name, shape in expected.items():
        if name not in found:
            raise Qwen35Error(f"{path}: missing tensor {_display(name, layout)!r} ({what}); the file is incomplete "
                              "or not this model")
        if tuple(found[name]) != tuple(shape):
            raise Qwen35Error(f"{path}: tensor {_display(name, layout)!r} has shape {tuple(found[name])}, "
                              f"expected {tuple(shape)} for this {what}")
    extra = sorted(set(found) - set(expected))
    if extra:
        raise Qwen35Error(f"{path}: unexpected tensor {_display(extra[0], layout)!r} (and {len(extra) - 1} more) "
                          f"for a Qwen3.5 {what}; this engine runs dense Qwen3.5 text decoders only")


def _check_dtype(dtype) -> None:
    if dtype not in _DTYPES:
        raise Qwen35Error(f"dtype must be one of torch.float32, torch.bfloat16, torch.float16; got {dtype}")


def _mtp_shapes(config: Qwen35Config, found: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    layers = {c.split(".")[2] for c in found if c.startswith("mtp.layers.")}
    if len(layers) > 1:
        raise Qwen35Error(f"MTP head has {len(layers)} layers; this engine supports exactly 1 (Qwen3.5)")
    return config.mtp_shapes(1)


def build_mtp_head(tensors: Mapping[str, torch.Tensor], config: Qwen35Config, *, dtype: torch.dtype = torch.float32,
                   device="cpu") -> MTPHead:
    """Build the MTP head from its tensors (keys ``mtp.*``; others are ignored).

    Every shape is checked against ``config`` first (Qwen35Error naming the tensor); the result
    has float weights in ``dtype`` on ``device``, ready to be attached as ``<decoder>.mtp``.
    """
    _check_dtype(dtype)
    mtp = {}
    for key, value in tensors.items():
        canon = key[len("model."):] if key.startswith("model.mtp.") else key
        if canon.startswith("mtp."):
            mtp[canon] = value
    if not mtp:
        raise Qwen35Error("no 'mtp.*' tensors given: this file has no MTP head (the base Qwen3.5 checkpoint "
                          "carries one)")
    shapes = {k: tuple(v.shape) for k, v in mtp.items()}
    _check_shapes(_mtp_shapes(config, shapes), shapes, "bare", "MTP tensors", "MTP head")
    for key, value in mtp.items():
        if not value.dtype.is_floating_point:
            raise Qwen35Error(f"MTP tensor {key!r} has dtype {value.dtype}; expected a float type")
    head = MTPHead(config, device="meta")
    state = {k[len("mtp."):]: v.to(device=device, dtype=dtype) for k, v in mtp.items()}
    head.load_state_dict(state, assign=True)
    return head.requires_grad_(False).eval()


def load_standalone(path, *, mtp_path=None, dtype: torch.dtype = torch.float32, device="cpu") -> Qwen35ForGeneration:
    """Load a Qwen3.5 text decoder from safetensors (HF or ComfyUI layout; vision tensors ignored).

    ``mtp_path``: a second file whose ``mtp.*`` tensors become the MTP head (grafted in memory;
    the first file is never rewritten); otherwise the head comes from ``path`` when present.
    Returns a module tree mirroring ComfyUI's ``Qwen35``: ``.model.{embed_tokens, layers, norm,
    lm_head?, mtp?, config}``. Raises Qwen35Error naming the tensor for any bad file.
    """
    _check_dtype(dtype)
    main = _File(path)
    text = main.shape_map(lambda c: not c.startswith("mtp."))
    config = Qwen35Config.from_state_dict(text)
    _check_shapes(config.text_shapes(), text, main.layout, main.path, f"Qwen3.5 {config.size_name} decoder")

    source = None
    if mtp_path is not None:
        source = _File(mtp_path)
        if not source.shape_map(lambda c: c.startswith("mtp.")):
            raise Qwen35Error(f"{source.path}: no 'mtp.*' tensors; pass the file that holds the MTP head")
        if main.shape_map(lambda c: c.startswith("mtp.")):
            log.info("load_standalone: MTP head taken from %s (the one in %s is ignored)", source.path, main.path)
    elif main.shape_map(lambda c: c.startswith("mtp.")):
        source = main
    if source is not None:
        found = source.shape_map(lambda c: c.startswith("mtp."))
        _check_shapes(_mtp_shapes(config, found), found, source.layout, source.path, "MTP head")

    model = Qwen35TextModel(config, device="meta")
    model.load_state_dict({c: main.tensor(c, dtype, device) for c in text}, assign=True)
    if source is not None:
        tensors = {c: source.tensor(c, dtype, device) for c in source.names if c.startswith("mtp.")}
        model.mtp = build_mtp_head(tensors, config, dtype=dtype, device=device)
        model.config = config = config.replace(mtp_num_hidden_layers=1)
    log.info("load_standalone: Qwen3.5 %s (%d layers, hidden %d, %s) from %s%s", config.size_name,
             config.num_hidden_layers, config.hidden_size, dtype, main.path,
             " with MTP head" if source is not None else "")
    return Qwen35ForGeneration(model).requires_grad_(False).eval()
