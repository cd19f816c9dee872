"""What the 4-bit converter (``convert_4bit``) checks before and while it writes, each failure a
:class:`ConversionError` whose message names the file or tensor and the fix: the source (a
readable safetensors file by safetensors' own header rules, a Qwen3.5 text encoder, well-formed
per-layer ``comfy_quant`` entries), the output (a folder that exists, a name that is not the
source's and is not taken), the device, and the weights' values (NaN / inf are refused, naming
every tensor that holds them: a converted copy would carry them into every answer).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..downloads.hub_client import FetchError
from ..downloads.safetensors_header import local_header

QWEN35_KEY = "model.language_model.layers.0.linear_attn.A_log"
SCALE_SUFFIXES = (".weight_scale", ".weight_scale_2", ".input_scale")
FINITE_SLICE = 1 << 24  # elements checked at a time (64 MB of float32)


class ConversionError(ValueError):
    """A conversion that cannot run or whose result would be wrong; nothing was written."""


class NonFinite(ConversionError):
    """Source weights holding NaN or infinite values (``names``: the tensors)."""

    def __init__(self, source: str, names: list[str]):
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        super().__init__(f"{source} holds NaN or infinite values in {len(names)} tensor(s): {shown}. A 4-bit copy "
                         "would carry them into every answer, so nothing was written. Convert an intact copy of "
                         "the model (fetched again from where it came from).")
        self.names = names


def source_path(source: str | os.PathLike) -> Path:
    """``source`` as a Path, when it is a readable file."""
    path = Path(source)
    if not path.exists():
        raise ConversionError(f"{path} does not exist: pick the Qwen3.5 .safetensors file to convert.")
    if not path.is_file():
        raise ConversionError(f"{path} is not a file: pick the Qwen3.5 .safetensors file to convert.")
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise ConversionError(f"Cannot read {path} ({exc.strerror or exc}); check its permissions.") from exc
    return path


def source_header(path: Path) -> dict:
    """The checked safetensors header of ``path`` (safetensors' own rules: ``safetensors_header``)."""
    try:
        return local_header(str(path), fix="it cannot be converted: pick an intact Qwen3.5 .safetensors file "
                                           "(an int8_convrot, bf16, fp16 or fp32 one)")
    except FetchError as exc:
        raise ConversionError(str(exc)) from exc


def qwen35(path: Path, keys) -> None:
    if QWEN35_KEY not in keys:
        raise ConversionError(f"{path.name} is not a Qwen3.5 text encoder (it has no {QWEN35_KEY}): pick the "
                              "Qwen3.5 file (e.g. qwen3.5_9b_qwen_image_2.1_pe_t2i.int8_convrot.safetensors).")


def layer_conf(path: Path, name: str, raw) -> dict:
    """A ``comfy_quant`` entry (a dict with a string ``format``), or ConversionError naming it."""
    try:
        conf = json.loads(raw) if isinstance(raw, (str, bytes)) else raw
    except (UnicodeDecodeError, ValueError) as exc:
        raise ConversionError(f"{path.name}: {name} is not a comfy_quant JSON entry; the file is damaged, "
                              "convert an intact copy.") from exc
    if not isinstance(conf, dict) or not isinstance(conf.get("format"), str):
        raise ConversionError(f"{path.name}: {name} is not a comfy_quant entry (an object with a 'format'); the "
                              "file is damaged, convert an intact copy.")
    return conf


def int8_layer(path: Path, key: str, conf: dict, shape, keys) -> None:
    """An int8_tensorwise source layer the converter can dequantize: its scale is there and its
    ConvRot group (if any) a power of two dividing its width."""
    layer = key[: -len(".weight")]
    if layer + ".weight_scale" not in keys:
        raise ConversionError(f"{path.name}: the int8 layer {layer} has no {layer}.weight_scale; the file is "
                              "damaged, convert an intact copy.")
    params = conf.get("params") if isinstance(conf.get("params"), dict) else {}
    if conf.get("convrot", params.get("convrot", False)):
        group = conf.get("convrot_groupsize", 256)
        if not isinstance(group, int) or isinstance(group, bool) or group <= 0 or group & (group - 1) or \
                shape[1] % group:
            raise ConversionError(f"{path.name}: {layer} names ConvRot group {group!r}, which does not divide its "
                                  f"width {shape[1]}; the file is damaged, convert an intact copy.")


def output_path(source: Path, out_dir: str | os.PathLike, name: str, fmt: str) -> Path:
    """``out_dir/name``, when ``out_dir`` is a folder and the name is neither the source nor taken."""
    folder = Path(out_dir)
    if not folder.is_dir():
        raise ConversionError(f"The output folder {folder} does not exist or is not a folder: create it or pick "
                              "another one.")
    dst = folder / name
    if dst.resolve() == source.resolve() or (dst.exists() and os.path.samefile(dst, source)):
        raise ConversionError(f"{source.name} is already a {fmt} file: its {fmt} copy would be the file itself, so "
                              "there is nothing to write. Pick the other format, or convert the int8 / 16-bit file "
                              "it was made from.")
    if dst.exists() or dst.is_symlink():
        raise ConversionError(f"{dst} exists; it is never overwritten. Move or rename it to write it again.")
    return dst


def device(name: str | torch.device | None) -> torch.device:
    """Where comfy-kitchen quantizes: ``name``, default CUDA when there is one, else the CPU."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise ConversionError(f"{name!r} is not a device: use 'cpu' or 'cuda'.") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConversionError(f"Device {name!r} is not available here (no CUDA GPU): use 'cpu'.")
    return dev


def finite(t: torch.Tensor) -> bool:
    """True when every value of ``t`` is finite (integer tensors always are); checked in slices, so
    the memory needed is one slice, not a copy of the tensor."""
    if t.is_floating_point():
        flat = t.reshape(-1)
        for lo in range(0, flat.numel(), FINITE_SLICE):
            if not bool(torch.isfinite(flat[lo:lo + FINITE_SLICE].float()).all()):
                return False
    return True
