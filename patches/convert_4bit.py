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
float32 weight, not the model. One writer per output: the conversion holds the output's lock (the
one downloads take, ``downloads.file_lock``; a second conversion of the same output waits, then
finds the output written and stops with a ConversionError), writes a part file of its own, and
verifies the written file against what was meant to be written before linking it to its name,
which must not exist (``convert_file``: a file is never overwritten); on an error or Cancel the
part file is removed. Source weights holding NaN or infinite values are refused, every such
tensor named (nothing is clamped: such a file is damaged). Every bad input (not a safetensors file,
a broken header, not Qwen3.5, the output being the source, a missing source or folder) is a
``ConversionError`` naming the file and the fix (``convert_checks``).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from ..downloads import file_lock
from ..downloads.hub_client import FetchError
from ..kernels.packed4 import FORMATS
from . import convert_checks as checks
from .convert_checks import ConversionError, NonFinite
from .convert_file import ConvertedFile, remove_stale_parts
from .quant_values import (
    GROUP,
    INT8_ROWS,
    NonFiniteWeight,
    int8_rows,
    nvfp4_input,
    planned,
    quantized,
    source_float,
    w4a4_input,
    weight_error,
)

log = logging.getLogger(__name__)

__all__ = ["FORMATS", "ConversionCancelled", "ConversionError", "NonFinite", "Step", "convert", "nvfp4_input",
           "output_name", "plan", "summary", "w4a4_input"]

_LAYER = re.compile(r"^model\.language_model\.layers\.\d+\.(self_attn|linear_attn|mlp)\.[a-z_]+\.weight$")
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


@contextmanager
def _opened(path: Path) -> Iterator:
    """``safe_open`` of a source whose header passed ``convert_checks.source_header``."""
    from safetensors import safe_open

    try:
        f = safe_open(str(path), framework="pt")
    except Exception as exc:  # noqa: BLE001 - safetensors' own verdict on the file, whatever its type
        raise ConversionError(f"safetensors cannot read {path} ({type(exc).__name__}: {exc}); convert an intact "
                              "copy.") from exc
    with f:
        yield f


def _source_confs(path: Path, f, keys: list[str]) -> dict[str, dict]:
    """``layer -> comfy_quant`` of the source: its per-layer tensors, then its header's metadata
    (which wins, as in ``comfy.utils.convert_old_quants``); ConversionError naming a malformed one."""
    confs = {}
    for k in keys:
        if k.endswith(".comfy_quant"):
            t = f.get_tensor(k)
            raw = bytes(t.reshape(-1).tolist()) if t.dtype == torch.uint8 else b""
            confs[k[: -len(".comfy_quant")]] = checks.layer_conf(path, k, raw)
    meta = (f.metadata() or {}).get("_quantization_metadata")
    if meta:
        entries = _json(path, meta).get("layers", {})
        if not isinstance(entries, dict):
            raise ConversionError(f"{path.name}: _quantization_metadata has no 'layers' object; the file is damaged, "
                                  "convert an intact copy.")
        confs.update({layer: checks.layer_conf(path, f"_quantization_metadata[{layer!r}]", conf)
                      for layer, conf in entries.items()})
    return confs


def _json(path: Path, raw: str) -> dict:
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise ConversionError(f"{path.name}: _quantization_metadata is not JSON; the file is damaged, convert an "
                              "intact copy.") from exc
    if not isinstance(value, dict):
        raise ConversionError(f"{path.name}: _quantization_metadata is not a JSON object; the file is damaged, "
                              "convert an intact copy.")
    return value


def plan(source: str | os.PathLike, fmt: str) -> list[Step]:
    """What ``convert`` does with each weight of ``source`` (see the module docstring); ConversionError
    (naming the fix) for a source that is not an intact Qwen3.5 safetensors file or an unknown format."""
    if fmt not in FORMATS:
        raise ConversionError(f"unknown 4-bit format {fmt!r}: one of {', '.join(FORMATS)}")
    path = checks.source_path(source)
    checks.qwen35(path, checks.source_header(path))
    with _opened(path) as f:
        keys = list(f.keys())
        confs = _source_confs(path, f, keys)
        steps = []
        for key in keys:
            if key.endswith((".comfy_quant", *checks.SCALE_SUFFIXES)):
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
                if conf is not None:
                    checks.int8_layer(path, key, conf, shape, keys)
                steps.append(Step(key, "quantize", "", conf))
    return steps


def _marker(conf: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(conf).encode("utf-8")), dtype=torch.uint8)


def convert(source: str | os.PathLike, out_dir: str | os.PathLike, fmt: str, *,
            progress: Callable[[int, int, str], None] | None = None, cancelled: Callable[[], bool] | None = None,
            device: str | torch.device | None = None, errors: dict[str, float] | None = None) -> Path:
    """Write ``out_dir/output_name(source, fmt)`` (see the module docstring) and return its path.
    ``progress(done, total, key)`` after each source weight; ``cancelled()`` True stops (also while
    waiting for another conversion of the same output; the part file is removed,
    ``ConversionCancelled`` raised). ``device``: where kitchen quantizes (default: CUDA when there is
    one). ``errors``: filled with each quantized layer's relative weight error ``|W4 - W| / |W|`` (W4
    as ComfyUI dequantizes the written tensors). ConversionError (nothing written) for every bad
    input, an existing output (never overwritten), NaN / inf weights (``NonFinite``) or a written
    file that is not what was meant to be written."""
    steps = plan(source, fmt)
    src = Path(source)
    dst = checks.output_path(src, out_dir, output_name(src, fmt), fmt)
    if not any(s.action == "quantize" for s in steps):
        whys = sorted({s.why for s in steps if s.action == "keep" and s.why.startswith(("already", "width"))})
        raise ConversionError(f"{src.name} has no decoder projection that can be written as {fmt} ("
                              f"{'; '.join(whys) or 'none found'}): nothing to convert.")
    dev = checks.device(device)

    def check() -> None:
        if cancelled is not None and cancelled():
            raise ConversionCancelled(f"cancelled: {dst.name} was not written")

    try:
        with file_lock.locked(str(dst), check, what=f"the conversion into {dst.name}"):
            if dst.exists() or dst.is_symlink():
                raise ConversionError(f"{dst} was written by another conversion while this one waited for it; it was "
                                      "left as it is (use it, or move it away and convert again).")
            remove_stale_parts(dst)
            out = ConvertedFile(dst)
            try:
                _write(src, out, steps, fmt, dev, check, progress, errors)
                out.finish()
            except BaseException:
                out.discard()
                raise
    except FetchError as exc:  # the lock file: a symbolic link there, or a folder that cannot be written
        raise ConversionError(str(exc)) from exc
    log.info("Qwen3.5: wrote %s (%s; %d layers quantized%s)", dst, fmt, sum(s.action == "quantize" for s in steps),
             ", the embedding in int8" if any(s.action == "int8" for s in steps) else "")
    return dst


def _write(src: Path, out: ConvertedFile, steps: list[Step], fmt: str, dev: torch.device, check: Callable[[], None],
           progress, errors) -> None:
    """Every tensor of ``steps`` into ``out``, header first; NonFinite naming every source tensor that
    holds NaN / inf (after the first one is met, the rest of the source is only scanned)."""
    specs, order, layers = {}, [], {}
    with _opened(src) as f:
        keys = set(f.keys())
        meta = {k: v for k, v in (f.metadata() or {}).items() if k != "_quantization_metadata"}
        for s in steps:  # the header first: every output's dtype and shape
            layer = s.key[: -len(".weight")]
            if s.action in ("quantize", "int8"):
                n, k = f.get_slice(s.key).get_shape()
                for suffix, spec in planned(_target(s, fmt), n, k).items():
                    specs[s.key + suffix] = spec
                    order.append((s.key + suffix, s))
                conf = dict(INT8_ROWS) if s.action == "int8" else \
                    {"format": fmt, "convrot_groupsize": GROUP} if fmt == "convrot_w4a4" else {"format": fmt}
            else:
                conf = s.conf
                for name in _stored(s, keys):
                    sl = f.get_slice(name)
                    specs[name] = (sl.get_dtype(), list(sl.get_shape()))
                    order.append((name, s))
            if conf is not None:
                layers[layer] = conf
                name = layer + ".comfy_quant"
                specs[name] = ("U8", [len(json.dumps(conf).encode("utf-8"))])
                order.append((name, None))
        meta["_quantization_metadata"] = json.dumps({"format_version": "1.0", "layers": layers})
        out.header(specs, [name for name, _ in order], meta)
        last = {s.key: name for name, s in order if s is not None}  # a step's last tensor
        done, cache, bad, seen = 0, {}, [], set()
        for name, s in order:
            check()
            if s is None:
                t = _marker(layers[name[: -len(".comfy_quant")]])
            elif s.action == "keep":
                seen.add(s.key)
                t = f.get_tensor(name)
                if not checks.finite(t):
                    bad.append(name)
                    break
            else:
                seen.add(s.key)
                if s.key not in cache:
                    cache.clear()
                    try:
                        cache[s.key] = _quantize(f, s, fmt, dev, keys, errors)
                    except NonFiniteWeight as exc:
                        bad.append(exc.key)
                        break
                t = cache[s.key][name[len(s.key):]]
            out.append(name, t)
            if s is not None and last[s.key] == name:
                done += 1
                if progress is not None:
                    progress(done, len(steps), s.key)
        if bad:
            for s in steps:
                if s.key not in seen:
                    check()
                    bad += [name for name in _stored(s, keys) if not _finite_stored(f, name)]
            raise NonFinite(src.name, bad)


def _stored(step: Step, keys) -> list[str]:
    """The source tensors of ``step``: its weight, then its scales when it is a quantized layer."""
    layer = step.key[: -len(".weight")]
    return [step.key] + [layer + x for x in checks.SCALE_SUFFIXES if step.conf is not None and layer + x in keys]


def _finite_stored(f, name: str) -> bool:
    """True when the source tensor ``name`` holds only finite values (read in slices of rows)."""
    sl = f.get_slice(name)
    shape = sl.get_shape()
    if sl.get_dtype() not in ("BF16", "F16", "F32", "F64", "F8_E4M3", "F8_E5M2"):
        return True
    if len(shape) < 2:
        return checks.finite(f.get_tensor(name))
    rows = max(1, checks.FINITE_SLICE // max(1, int(torch.tensor(shape[1:]).prod())))
    return all(checks.finite(sl[lo:lo + rows]) for lo in range(0, shape[0], rows))


def _quantize(f, s: Step, fmt: str, dev: torch.device, keys, errors) -> dict[str, torch.Tensor]:
    """``{suffix: tensor}`` of step ``s`` as written (on the CPU); NonFiniteWeight for a source tensor
    holding NaN / inf, ConversionError when comfy-kitchen fails on the layer."""
    for name in _stored(s, keys)[1:]:  # an int8 layer's scales (its int8 values are always finite)
        if not _finite_stored(f, name):
            raise NonFiniteWeight(name)
    try:
        if s.action == "int8":
            tensors, err = int8_rows(f, s.key, dev)
        else:
            w = source_float(f, s.key, s.conf).to(dev)
            if not checks.finite(w):
                raise NonFiniteWeight(s.key)
            tensors, _ = quantized(w, _target(s, fmt))
            tensors = {k: v.cpu() for k, v in tensors.items()}
            err = weight_error(tensors, _target(s, fmt), w) if errors is not None else 0.0
    except NonFiniteWeight:
        raise
    except Exception as exc:  # noqa: BLE001 - comfy-kitchen's failure on this layer, named for the user
        raise ConversionError(f"{s.key}: comfy-kitchen could not convert it ({type(exc).__name__}: {exc}); nothing "
                              "was written. Check that the source file is intact and comfy-kitchen is the version "
                              "ComfyUI installs.") from exc
    for suffix, t in tensors.items():
        if not checks.finite(t):
            raise ConversionError(f"{s.key}{suffix}: comfy-kitchen produced NaN or infinite values from finite "
                                  "weights; nothing was written. Update comfy-kitchen, or report the layer.")
    if errors is not None:
        errors[s.key] = err
    return tensors


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
