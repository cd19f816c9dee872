"""Write a Qwen3.5 text-encoder file in ComfyUI's 4-bit formats (``convrot_w4a4`` or ``nvfp4``) from the
official ``int8_convrot`` file or a bf16 / fp16 / fp32 one, layer by layer.

What is quantized: the decoder layers' Linear weights (``model.language_model.layers.N.*`` 2-D
projections: attention q/k/v/o, DeltaNet in/out, MLP gate/up/down) whose width the format takes
(convrot_w4a4: a multiple of 256, its ConvRot group; nvfp4: any). A 16-bit embedding table of a model
whose ``lm_head`` is its own tensor (9B) is written in ComfyUI's ``int8_tensorwise`` with one scale
per row (``EMBEDDING``: half its memory, 1 GB on the 9B; ComfyUI 0.29.0+ looks rows up in int8 and
dequantizes only those; 0.7% relative weight error on random weights, as the int8 projections). What
stays as the source holds it (int8_convrot or 16-bit): ``lm_head`` (measured on the random 9B, the
output projection's 4-bit error moves every logit and costs the most top-1 agreement:
``benchmarks/quant_quality.py``), a tied embedding (it is also the output projection, whose
per-token product would dequantize the whole table), norms, the DeltaNet conv and gate parameters
(a few KB each), ``mtp.*`` and ``model.visual.*``. ``plan`` lists the choice per tensor, with the reason.

The written file is what ComfyUI's own save path writes for a ``MixedPrecisionOps`` model holding
comfy-kitchen ``QuantizedTensor`` weights (``comfy/ops.py`` ``_quantized_weight_state_dict``): per
quantized layer ``<layer>.weight`` + ``<layer>.weight_scale`` (+ ``weight_scale_2`` for nvfp4) and a
``<layer>.comfy_quant`` uint8 JSON tensor (``{"format": "convrot_w4a4", "convrot_groupsize": 256}`` /
``{"format": "nvfp4"}``; kept int8 layers keep theirs), plus the header's ``_quantization_metadata``
(``{"format_version": "1.0", "layers": {...}}``, ComfyUI's QUANTIZATION.md), which
``comfy.utils.convert_old_quants`` turns back into the same per-layer entries. The values come from
comfy-kitchen's own quantizers (``QuantizedTensor.from_float``), on the GPU where there is one; a
convrot_w4a4 weight is first clipped row by row where that lowers its rounding error
(``w4a4_input``: 11.4% relative weight error instead of kitchen's 15.7-16.9% on random 9B-shaped rows).

Streamed: the header is computed first (every output shape follows from the source's), then each
tensor is read (``safe_open``: memory-mapped), converted and appended, so the peak is one layer's
float32 weight, not the model. Written to ``<out>.part``, flushed, then linked to its name, which
must not exist (a file is never overwritten); on an error or Cancel the ``.part`` file is removed.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..kernels.packed4 import FORMATS
from .quant_values import (
    GROUP,
    INT8_ROWS,
    int8_rows,
    nvfp4_input,
    planned,
    quantized,
    source_float,
    w4a4_input,
    weight_error,
)

log = logging.getLogger(__name__)

__all__ = ["FORMATS", "ConversionCancelled", "Step", "convert", "nvfp4_input", "output_name", "plan", "summary",
           "w4a4_input"]

_LAYER = re.compile(r"^model\.language_model\.layers\.\d+\.(self_attn|linear_attn|mlp)\.[a-z_]+\.weight$")
_ST = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
       torch.int8: "I8", torch.uint8: "U8", torch.int32: "I32", torch.int64: "I64", torch.bool: "BOOL",
       torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
_TORCH = {v: k for k, v in _ST.items()}
_SUFFIXES = (".int8_convrot", ".int8", ".bf16", ".fp16", ".fp32", ".convrot_w4a4", ".nvfp4")
EMBEDDING = "model.language_model.embed_tokens.weight"


class ConversionCancelled(Exception):
    """The user cancelled; nothing was written."""


@dataclass
class Step:
    """One source weight: ``action`` "quantize" (to the target format), "int8" (the embedding table, to
    per-row int8), "keep" (as stored, with its scale and comfy_quant entries), with ``why`` (kept: the
    reason) and the source's layer config (``conf``: its comfy_quant, None for a plain tensor)."""

    key: str
    action: str
    why: str
    conf: dict | None


def output_name(source: str | os.PathLike, fmt: str) -> str:
    """``<name>.<fmt>.safetensors`` for ``<name>[.int8_convrot|.bf16|...].safetensors``."""
    stem = Path(source).name
    stem = stem[: -len(".safetensors")] if stem.endswith(".safetensors") else stem
    for suffix in _SUFFIXES:
        if stem.endswith(suffix):
            stem = stem[: -len(suffix)]
            break
    return f"{stem}.{fmt}.safetensors"


def _source_confs(f, keys: list[str]) -> dict[str, dict]:
    """``layer -> comfy_quant`` of the source: its per-layer tensors, then its header's metadata
    (which wins, as in ``comfy.utils.convert_old_quants``)."""
    confs = {k[: -len(".comfy_quant")]: json.loads(bytes(f.get_tensor(k).tolist()).decode("utf-8"))
             for k in keys if k.endswith(".comfy_quant")}
    meta = (f.metadata() or {}).get("_quantization_metadata")
    if meta:
        confs.update(json.loads(meta).get("layers", {}))
    return confs


def plan(source: str | os.PathLike, fmt: str) -> list[Step]:
    """What ``convert`` does with each weight of ``source`` (see the module docstring)."""
    from safetensors import safe_open

    if fmt not in FORMATS:
        raise ValueError(f"unknown 4-bit format {fmt!r}: one of {', '.join(FORMATS)}")
    with safe_open(str(source), framework="pt") as f:
        keys = list(f.keys())
        confs = _source_confs(f, keys)
        if "model.language_model.layers.0.linear_attn.A_log" not in keys:
            raise ValueError(f"{source} is not a Qwen3.5 text encoder (no "
                             "model.language_model.layers.0.linear_attn.A_log): pick the Qwen3.5 file")
        steps = []
        for key in keys:
            if key.endswith((".comfy_quant", ".weight_scale", ".weight_scale_2", ".input_scale")):
                continue
            layer = key[: -len(".weight")] if key.endswith(".weight") else key
            conf = confs.get(layer)
            shape = f.get_slice(key).get_shape()
            if key == EMBEDDING and conf is None and len(shape) == 2:
                if "lm_head.weight" in keys:
                    steps.append(Step(key, "int8", "", None))
                else:
                    steps.append(Step(key, "keep", "the embedding is also the output projection (tied): an int8 "
                                                   "table would be dequantized whole for every token's logits", conf))
            elif not _LAYER.match(key) or len(shape) != 2:
                steps.append(Step(key, "keep", "not a decoder-layer projection (embedding, lm_head, norms, conv, "
                                               "gates, MTP head, vision tower stay as the source has them)", conf))
            elif conf is not None and conf.get("format") not in ("int8_tensorwise",):
                steps.append(Step(key, "keep", f"already {conf.get('format')} in the source", conf))
            elif fmt == "convrot_w4a4" and shape[1] % GROUP:
                steps.append(Step(key, "keep", f"width {shape[1]} is no multiple of the ConvRot group {GROUP}", conf))
            else:
                steps.append(Step(key, "quantize", "", conf))
    return steps


def _marker(conf: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(conf).encode("utf-8")), dtype=torch.uint8)


def convert(source: str | os.PathLike, out_dir: str | os.PathLike, fmt: str, *,
            progress: Callable[[int, int, str], None] | None = None, cancelled: Callable[[], bool] | None = None,
            device: str | torch.device | None = None, errors: dict[str, float] | None = None) -> Path:
    """Write ``out_dir/output_name(source, fmt)`` (see the module docstring) and return its path.
    ``progress(done, total, key)`` after each source weight; ``cancelled()`` True stops (the
    ``.part`` file is removed, ``ConversionCancelled`` raised). ``device``: where kitchen quantizes
    (default: CUDA when there is one). ``errors``: filled with each quantized layer's relative weight
    error ``|W4 - W| / |W|`` (W4 as ComfyUI dequantizes the written tensors). FileExistsError when
    the output exists (delete or rename it first)."""
    from safetensors import safe_open

    steps = plan(source, fmt)
    dst = Path(out_dir) / output_name(source, fmt)
    if dst.exists():
        raise FileExistsError(f"{dst} exists; delete or rename it to write it again (it is never overwritten)")
    dev = torch.device(device) if device is not None else \
        torch.device("cuda" if torch.cuda.is_available() else "cpu")
    header, order, layers = {}, [], {}
    with safe_open(str(source), framework="pt") as f:
        keys = set(f.keys())
        meta = {k: v for k, v in (f.metadata() or {}).items() if k != "_quantization_metadata"}
        for s in steps:  # the header first: every output's dtype and shape
            layer = s.key[: -len(".weight")]
            if s.action in ("quantize", "int8"):
                n, k = f.get_slice(s.key).get_shape()
                for suffix, spec in planned(_target(s, fmt), n, k).items():
                    header[s.key + suffix] = spec
                    order.append((s.key + suffix, s))
                conf = dict(INT8_ROWS) if s.action == "int8" else \
                    {"format": fmt, "convrot_groupsize": GROUP} if fmt == "convrot_w4a4" else {"format": fmt}
            else:
                conf = s.conf
                for name in [s.key] + [layer + x for x in (".weight_scale", ".weight_scale_2", ".input_scale")
                                       if s.conf is not None and layer + x in keys]:
                    sl = f.get_slice(name)
                    header[name] = (sl.get_dtype(), list(sl.get_shape()))
                    order.append((name, s))
            if conf is not None:
                layers[layer] = conf
                name = layer + ".comfy_quant"
                header[name] = ("U8", [len(json.dumps(conf).encode("utf-8"))])
                order.append((name, None))
        meta["_quantization_metadata"] = json.dumps({"format_version": "1.0", "layers": layers})
        finish = {s.key: name for name, s in order if s is not None}  # a step's last tensor
        part = dst.with_name(dst.name + ".part")
        try:
            with open(part, "wb") as out:
                _write_header(out, header, order, meta)
                done, total, cache = 0, len(steps), {}
                for name, s in order:
                    if cancelled is not None and cancelled():
                        raise ConversionCancelled(f"cancelled: {dst.name} was not written")
                    if s is None:
                        t = _marker(layers[name[: -len(".comfy_quant")]])
                    elif s.action == "keep":
                        t = f.get_tensor(name)
                    else:
                        if s.key not in cache and s.action == "int8":
                            cache.clear()
                            cache[s.key], err = int8_rows(f, s.key, dev)
                            if errors is not None:
                                errors[s.key] = err
                        elif s.key not in cache:
                            cache.clear()
                            w = source_float(f, s.key, s.conf).to(dev)
                            tensors, _ = quantized(w, _target(s, fmt))
                            cache[s.key] = {k: v.cpu() for k, v in tensors.items()}
                            if errors is not None:
                                errors[s.key] = weight_error(cache[s.key], _target(s, fmt), w)
                        t = cache[s.key][name[len(s.key):]]
                    _append(out, name, t, header[name])
                    if s is not None and finish[s.key] == name:
                        done += 1
                        if progress is not None:
                            progress(done, total, s.key)
                out.flush()
                os.fsync(out.fileno())
            _publish(part, dst)
        except BaseException:
            part.unlink(missing_ok=True)
            raise
    log.info("Qwen3.5: wrote %s (%s; %d layers quantized%s)", dst, fmt, sum(s.action == "quantize" for s in steps),
             ", the embedding in int8" if any(s.action == "int8" for s in steps) else "")
    return dst


def _target(step: Step, fmt: str) -> str:
    """What a converted step is written as: ``fmt``, or "int8" for the embedding table."""
    return "int8" if step.action == "int8" else fmt


def summary(out: Path, steps: list[Step], errors: dict[str, float]) -> str:
    """One paragraph for the user: the file, how many weights were quantized (with their relative
    weight error), and what was kept and why."""
    done = [s for s in steps if s.action == "quantize"]
    kept: dict[str, int] = {}
    for s in steps:
        if s.action == "keep":
            kept[s.why] = kept.get(s.why, 0) + 1
    errs = sorted(errors[s.key] for s in done if s.key in errors)
    line = f"wrote {out.name}: {len(done)} projections in 4 bits"
    if errs:
        line += f" (relative weight error median {errs[len(errs) // 2]:.3f}, max {errs[-1]:.3f})"
    for s in steps:
        if s.action == "int8":
            err = f", relative weight error {errors[s.key]:.3f}" if s.key in errors else ""
            line += f"; the embedding table in int8, a scale per row (half its memory{err})"
    return line + "; kept as in the source: " + "; ".join(f"{n} ({why})" for why, n in kept.items())


def _write_header(out, header: dict, order: list, meta: dict) -> None:
    entries, pos = {"__metadata__": meta}, 0
    for name, _ in order:
        dtype, shape = header[name]
        size = _nbytes(dtype, shape)
        entries[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + size]}
        pos += size
    raw = json.dumps(entries, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    out.write(len(raw).to_bytes(8, "little") + raw)


def _nbytes(dtype: str, shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * _TORCH[dtype].itemsize


def _append(out, name: str, t: torch.Tensor, spec: tuple[str, list[int]]) -> None:
    """Write ``t``'s bytes, after checking it is what the header promised."""
    dtype, shape = spec
    if _ST.get(t.dtype) != dtype or list(t.shape) != list(shape):
        raise RuntimeError(f"{name}: comfy-kitchen produced {t.dtype} {tuple(t.shape)}, not {dtype} {shape} as "
                           "planned (an unsupported comfy-kitchen version?)")
    out.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def _publish(part: Path, dst: Path) -> None:
    """``part`` under the name ``dst``, which must not exist (a hard link fails if it does)."""
    appeared = FileExistsError(f"{dst} appeared while converting; it was left as it is (delete or rename it and "
                               "convert again)")
    try:
        os.link(part, dst)
    except FileExistsError:
        raise appeared from None
    except OSError:  # no hard links on this filesystem: a checked rename
        if dst.exists():
            raise appeared from None
        os.replace(part, dst)
        return
    part.unlink()
