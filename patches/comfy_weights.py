"""Resolve the weights of a ComfyUI-loaded Qwen3.5 into plain tensors the engine's decode kernels read.

ComfyUI's ``ModelPatcher.load`` writes ``comfy_cast_weights=True`` on every Linear/Embedding/Conv1d
and ``comfy_force_cast_weights=True`` on every module of a loaded CLIP (``CLIP.__init__`` sets a
compute dtype), whatever the file's format: those flags say "may cast", nothing about where a
weight is or what a call would add. What
decides whether the fast path may read a module's weight itself is in the module and its weight:

* no per-call work ComfyUI would add: no ``weight_function`` / ``bias_function`` patches (LoRA,
  hooks), no lowvram patch functions, no forced casting;
* the weight is resident: on the execution device, not streamed in per call (DynamicVRAM's
  ``_v``) and not left on the CPU by a partial (lowvram) load;
* a format the kernels read as stored: a plain tensor in the execution dtype, comfy-kitchen's
  ``TensorWiseINT8Layout`` (int8 rows, a float32 scale per row or per tensor, optionally ConvRot),
  or ComfyUI's fp8 layouts (``TensorCoreFP8Layout`` and its E4M3 / E5M2 names: float8 rows and one
  float32 scale; ``capabilities.fp8_reason`` says on which GPUs), or the 4-bit layouts
  (``TensorCoreConvRotW4A4Layout``: packed int4 rows, a float32 scale per row, ConvRot;
  ``TensorCoreNVFP4Layout``: packed E2M1, swizzled E4M3 block scales, a float32 tensor scale), read
  by ``kernels/gemv4.py`` on any GPU Triton runs on, layer by layer (a file may mix formats).

A resolved module gives a ``PlainLinear`` over the same storage (no copy); anything else keeps
ComfyUI's own module call, and ``resolve`` says why, naming the module.
"""

from __future__ import annotations

import logging

import torch

from ..engine import held
from ..engine.errors import exception_line
from ..engine.plain_weights import PlainLinear, StandaloneWeights, int8_linear_record
from ..kernels import say_once
from ..kernels.capabilities import fp8_reason
from ..kernels.convrot import convrot_group_ok
from ..kernels.packed4 import Packed4, packed_reason
from . import swap_patcher

log = logging.getLogger(__name__)


def _offloaded(where: torch.device, device: torch.device) -> str:
    """Why a weight on ``where`` is not read in place when the step runs on ``device``."""
    return (f"its weight lives on {where}, not {device} (the model is partly offloaded: free VRAM or unload "
            "other models)")

INT8_LAYOUT = "TensorWiseINT8Layout"
#: ComfyUI's per-tensor fp8 layouts (``comfy/quant_ops.py``) and their storage dtypes.
FP8_LAYOUTS = {"TensorCoreFP8Layout": torch.float8_e4m3fn, "TensorCoreFP8E4M3Layout": torch.float8_e4m3fn,
               "TensorCoreFP8E5M2Layout": torch.float8_e5m2}
#: ComfyUI's 4-bit layouts (comfy-kitchen's class names) -> the format name ``kernels/packed4.py`` reads.
W4_LAYOUTS = {"TensorCoreConvRotW4A4Layout": "convrot_w4a4", "TensorCoreNVFP4Layout": "nvfp4"}
_STANDALONE = StandaloneWeights()


def per_call_work(module) -> str | None:
    """Why ComfyUI would do work on ``module``'s weight at every call (None when it would not)."""
    if getattr(module, "_v", None) is not None:
        return "ComfyUI streams its weights in per call (DynamicVRAM)"
    if getattr(module, "weight_function", None) or getattr(module, "bias_function", None):
        return "it has per-call weight patches (LoRA or hooks)"
    if getattr(module, "weight_lowvram_function", None) is not None or \
            getattr(module, "bias_lowvram_function", None) is not None:
        return "it has lowvram weight patches"
    return None


#: Attribute of a DynamicVRAM CLIP's model holding the classic ModelPatcher ``resident_clip`` reloaded
#: for it (one per model, shared by every clone after; it dies with the model).
RESIDENT_ATTR = "qwen35_fast_resident"


def is_dynamic(patcher) -> bool:
    """True for a ModelPatcher that streams its weights in per call (ComfyUI's DynamicVRAM)."""
    return bool(getattr(patcher, "is_dynamic", lambda: False)())


def _whole_fit(patcher) -> str | None:
    """Why ``patcher``'s model cannot be loaded whole on its GPU even with every other model unloaded
    (None when it can): its size plus a tenth must fit the device's memory less ComfyUI's minimum
    inference memory."""
    import comfy.model_management as mm

    gb = 2**30
    size, total = patcher.model_size(), mm.get_total_memory(patcher.load_device)
    keep = mm.minimum_inference_memory()
    if size * 1.1 + keep <= total:
        return None
    return (f"the model ({size / gb:.1f} GB) does not fit whole on this GPU ({total / gb:.1f} GB, "
            f"{keep / gb:.1f} GB of it kept for inference); a smaller file (int8_convrot) or a GPU with more "
            "memory would")


def resident_clip(clip):
    """``clip`` in a form whose weights the decode kernels can read in place: ``(clip, None)`` for a
    CLIP that is not streamed per call; for one ComfyUI loaded with DynamicVRAM (``ModelPatcherDynamic``:
    weights on the CPU, streamed in per call), ``(resident, None)``, a clone of ``clip`` whose patcher is
    a classic ``ModelPatcher`` over the same files reloaded by ComfyUI itself (``ModelPatcher.clone(
    disable_dynamic=True)``, which calls the loader's ``cached_patcher_init`` with ``disable_dynamic=True``,
    as core does for hooks), carrying ``clip``'s patches; or ``(clip, why)`` when it stays streamed (no
    ``cached_patcher_init``, the model does not fit whole on the GPU, or the reload failed).

    The reload happens once per model: its ModelPatcher is kept on the DynamicVRAM model
    (``RESIDENT_ATTR``) and every later clone is made over the same weights (``model_override``), with
    that patcher as its parent, so ComfyUI's model management loads, offloads and frees it like any
    model it loaded. The DynamicVRAM model keeps only its file mapping and whatever VRAM its pages still
    hold, which ComfyUI frees first when it loads the resident one."""
    patcher = getattr(clip, "patcher", None)
    if not is_dynamic(patcher):
        return clip, None
    if getattr(patcher, "cached_patcher_init", None) is None:
        return clip, ("ComfyUI has no way to reload it without DynamicVRAM (its loader set no "
                      "cached_patcher_init): load it with core 'Load CLIP' or 'Load Qwen3.5 CLIP (MTP)', or start "
                      "ComfyUI with --disable-dynamic-vram")
    why = _whole_fit(patcher)
    if why is not None:
        return clip, why
    model = patcher.model
    owner = getattr(model, RESIDENT_ATTR, None)
    try:
        if owner is None:
            gb = 2**30
            log.info("Qwen3.5: reloading the model without DynamicVRAM (%.1f GB, once) so the decode kernels "
                     "read its weights in place", patcher.model_size() / gb)
            owner = patcher.clone(disable_dynamic=True)
            owner.parent = None  # the owner of these weights, as a loader's patcher is
            swap_patcher.install(owner)  # its clones inherit the class: every load of these weights moves them fast
        resident = clip.clone()
        resident.patcher = patcher.clone(disable_dynamic=True, model_override=owner.get_clone_model_override())
    except Exception as exc:  # noqa: BLE001 - any loader fault leaves the streamed CLIP, said once
        return clip, (f"ComfyUI could not reload it without DynamicVRAM ({exception_line(exc)}): start ComfyUI "
                      "with --disable-dynamic-vram")
    # A clone that dies hands its place in ComfyUI's loaded models to its parent: the patcher that
    # owns the same weights, not the DynamicVRAM one (whose model is another).
    resident.patcher.parent = owner
    resident.cond_stage_model = resident.patcher.model  # CLIP.clone(disable_dynamic=True) keeps the old one
    setattr(model, RESIDENT_ATTR, owner)
    return resident, None


def make_resident(patcher, streamed: str | None = None) -> str | None:
    """Load a partly loaded (lowvram) CLIP fully through ComfyUI's own model management when the
    free VRAM allows, so the decode kernels can read every weight in place. Returns None when the
    model is (now) fully loaded or not ComfyUI's, else why it stays partly offloaded (the module
    path then runs for the offloaded layers, and the engine's log line names them). A DynamicVRAM
    patcher (one ``resident_clip`` left streamed, ``streamed`` saying why) is not loaded: the reason
    is said once. Also has ComfyUI's unload of the model (``detach``) free the decode stack the
    engine keeps between generations (``release_kept``)."""
    if patcher is None or not hasattr(patcher, "loaded_size") or not hasattr(patcher, "model_size"):
        return None
    _release_on_detach(patcher)
    if is_dynamic(patcher):
        why = ("ComfyUI streams this model's weights in per call (DynamicVRAM), so every layer runs through "
               "its module call: " + (streamed or "connect the CLIP through the 'Length-aware decode (Qwen3.5)' "
                                                   "node, which loads it resident, or start ComfyUI with "
                                                   "--disable-dynamic-vram"))
        say_once(log, f"Qwen3.5: {why}")
        return why
    import comfy.model_management as mm

    total, loaded = patcher.model_size(), patcher.loaded_size()
    if loaded >= total or mm.is_device_cpu(patcher.load_device):
        return None
    free = mm.get_free_memory(patcher.load_device)
    if free < (total - loaded) * 1.1:
        why = (f"only {loaded / 2**30:.1f} of {total / 2**30:.1f} GB of the model fit on the GPU next to the other "
               f"models ({free / 2**30:.1f} GB free); the offloaded layers run through ComfyUI's module calls")
        log.warning("Qwen3.5: %s", why)
        return why
    mm.load_models_gpu([patcher], force_full_load=True)
    log.info("Qwen3.5: loaded the whole model on the GPU (%.1f GB) so the decode kernels read it in place",
             total / 2**30)
    return None


#: The key of ``release_kept`` among a patcher's detach callbacks.
DETACH_KEY = "qwen35_fast_kept_stack"


def release_kept(patcher, unpatch_all: bool = True, *_args) -> None:
    """ComfyUI's ``ON_DETACH`` callback: free the decode stack kept on the patcher's Qwen3.5
    (``engine/held.py``) when ComfyUI unloads the model (``unpatch_all``: its weights go back to the
    offload device). ComfyUI 0.29.0 also detaches a loaded model without unpatching whenever it is
    loaded again (every ``CLIP.generate``); its weights stay, and the next generation's check of
    them decides whether the kept stack still fits."""
    model = getattr(patcher, "model", None)
    if unpatch_all and model is not None and held.release_within(model):
        log.info("Qwen3.5: ComfyUI unloaded the model; the decode stack kept for it is freed")


def _release_on_detach(patcher) -> None:
    """Register ``release_kept`` once on ``patcher`` and on the loaded clones of its model (ComfyUI
    loads and unloads the clone a CLIP's ``generate`` ran with; clones made later copy it)."""
    try:
        import comfy.model_management as mm
        from comfy.patcher_extension import CallbacksMP
    except ImportError:
        return
    loaded = [lm.model for lm in getattr(mm, "current_loaded_models", ())
              if getattr(getattr(lm, "model", None), "model", None) is patcher.model]
    for p in [patcher, *loaded]:
        if hasattr(p, "add_callback_with_key") and release_kept not in \
                p.callbacks.get(CallbacksMP.ON_DETACH, {}).get(DETACH_KEY, []):
            p.add_callback_with_key(CallbacksMP.ON_DETACH, DETACH_KEY, release_kept)


class Resolver:
    """The weight hook the engine's ``bind`` takes for a ComfyUI-loaded tree (see
    ``engine.plain_weights.StandaloneWeights`` for the contract)."""

    def module_call_reason(self, module) -> str | None:
        """Why calling this ComfyUI module inside a CUDA graph is unsafe: ComfyUI streams its weights
        in or patches them per call (``per_call_work``). ``comfy_cast_weights`` alone is no reason:
        for a weight already on the call's device ``cast_bias_weight`` takes no offload stream and
        does no host work, and a dtype cast it does is device work that a replay repeats on the same
        storage (``graph_blocker`` checks that the weights are on the device)."""
        return per_call_work(module)

    def tensor_reason(self, module, device: torch.device) -> str | None:
        """None when a norm's / conv's own parameters can be read in place on ``device``."""
        why = per_call_work(module)
        if why is not None:
            return why
        for name, p in module.named_parameters(recurse=False):
            if p.device != device:
                return f"its {name} lives on {p.device}, not {device} (the model is partly offloaded)"
        return None

    def norm_scale(self, module, dtype: torch.dtype) -> torch.Tensor:
        """ComfyUI's ``RMSNorm`` multiplies by ``(w + 1)`` computed in the weight's dtype and cast to
        the input's dtype (``add=False``: ``w`` cast the same way); returned as float32. A module the
        engine built (a grafted MTP head) rounds as the engine's own norm does."""
        if type(module).__module__.split(".")[0] != "comfy":
            return _STANDALONE.norm_scale(module, dtype)
        w = module.weight.detach()
        return (w + 1.0 if module.add else w).to(dtype).float()

    def linear(self, module, device: torch.device, dtype: torch.dtype) -> tuple[PlainLinear | None, str | None]:
        """``(PlainLinear over the module's own storage, None)`` or ``(None, why it is not read in place)``."""
        why = per_call_work(module)
        if why is not None:
            return None, why
        int8 = int8_linear_record(module, device)
        if int8 is not None:  # the pack's own int8 MTP head (``mtp_graft``)
            return int8
        w, b = getattr(module, "weight", None), getattr(module, "bias", None)
        if not isinstance(w, torch.Tensor):
            return None, "it has no weight tensor"
        if b is not None and (type(b) not in (torch.Tensor, torch.nn.Parameter) or b.device != device
                              or b.dtype != dtype):
            return None, f"its bias is {b.dtype} on {b.device}, not {dtype} on {device}"
        bias = None if b is None else b.detach()
        layout = getattr(w, "_layout_cls", None)
        if layout is not None:
            return self._quantized(w, layout, bias, device, dtype)
        if type(w) not in (torch.Tensor, torch.nn.Parameter) or w.dim() != 2:
            return None, f"its weight is a {type(w).__name__}, not a plain matrix"
        if w.device != device:
            return None, _offloaded(w.device, device)
        if w.dtype != dtype:
            return None, f"its weight is {w.dtype} and the step runs in {dtype} (cast per call)"
        return PlainLinear(w.detach(), bias=bias), None

    def _quantized(self, w, layout: str, bias, device, dtype) -> tuple[PlainLinear | None, str | None]:
        if layout in FP8_LAYOUTS:
            return self._fp8(w, layout, bias, device)
        if layout in W4_LAYOUTS:
            return self._four_bit(w, W4_LAYOUTS[layout], bias, device)
        if layout != INT8_LAYOUT:
            return None, (f"its weight is {layout}, which the fast path does not read (int8_tensorwise, "
                          "per-tensor fp8, convrot_w4a4 and nvfp4 only)")
        q, params = getattr(w, "_qdata", None), getattr(w, "_params", None)
        scale = getattr(params, "scale", None)
        if not isinstance(q, torch.Tensor) or q.dtype != torch.int8 or q.dim() != 2 or \
                not isinstance(scale, torch.Tensor):
            return None, "its int8 weight does not hold int8 rows and a scale tensor"
        if getattr(params, "transposed", False) or tuple(getattr(params, "orig_shape", q.shape)) != tuple(q.shape):
            return None, "its int8 weight is stored transposed"
        if q.device != device or scale.device != device:
            return None, _offloaded(q.device, device)
        if scale.numel() not in (1, q.shape[0]) or q.stride(1) != 1:
            return None, f"its int8 scale {tuple(scale.shape)} is neither per tensor nor per row"
        if scale.dtype != torch.float32:
            return None, f"its int8 scale is {scale.dtype}, not float32"
        group = 0
        if getattr(params, "convrot", False):
            group = int(getattr(params, "convrot_groupsize", 256))
            if not convrot_group_ok(group):
                return None, f"its ConvRot group size {group} is not a power of 4"
            if q.shape[1] % group:
                return None, f"its ConvRot group {group} does not divide the width {q.shape[1]}"
        return PlainLinear(q, scale=scale.detach().reshape(-1), convrot=group, bias=bias), None

    def _fp8(self, w, layout: str, bias, device) -> tuple[PlainLinear | None, str | None]:
        """An fp8 ``QuantizedTensor``: ``_qdata`` float8 ``[N, K]``, ``_params.scale`` float32 ``[]``;
        ComfyUI dequantizes it as ``qdata * scale``."""
        q, params = getattr(w, "_qdata", None), getattr(w, "_params", None)
        scale = getattr(params, "scale", None)
        if not isinstance(q, torch.Tensor) or q.dtype != FP8_LAYOUTS[layout] or q.dim() != 2 or \
                not isinstance(scale, torch.Tensor):
            return None, f"its {layout} weight does not hold {FP8_LAYOUTS[layout]} rows and a scale tensor"
        if tuple(getattr(params, "orig_shape", q.shape)) != tuple(q.shape) or q.stride(1) != 1:
            return None, f"its {layout} weight is not stored as row-major [out, in]"
        if q.device != device or scale.device != device:
            return None, _offloaded(q.device, device)
        if scale.numel() != 1 or scale.dtype != torch.float32:
            return None, f"its fp8 scale is {scale.dtype} {tuple(scale.shape)}, not one float32"
        why = fp8_reason(device)
        if why is not None:
            return None, why
        return PlainLinear(q, scale=scale.detach().reshape(-1), bias=bias), None

    def _four_bit(self, w, fmt: str, bias, device) -> tuple[PlainLinear | None, str | None]:
        """A 4-bit ``QuantizedTensor`` (``kernels/packed4.py`` names its storage): a ``PlainLinear``
        whose ``packed`` record holds the same tensors (no copy)."""
        q, params = getattr(w, "_qdata", None), getattr(w, "_params", None)
        scale = getattr(params, "scale", None)
        shape = tuple(getattr(params, "orig_shape", ()) or ())
        if not isinstance(q, torch.Tensor) or not isinstance(scale, torch.Tensor) or len(shape) != 2:
            return None, f"its {fmt} weight does not hold packed rows, a scale tensor and a 2-D shape"
        if getattr(params, "transposed", False):
            return None, f"its {fmt} weight is stored transposed"
        block = getattr(params, "block_scale", None) if fmt == "nvfp4" else None
        group = int(getattr(params, "convrot_groupsize", 256)) if fmt == "convrot_w4a4" else 0
        if group and not convrot_group_ok(group):
            return None, f"its ConvRot group size {group} is not a power of 4"
        if q.device != device or scale.device != device or (block is not None and block.device != device):
            return None, _offloaded(q.device, device)
        packed = Packed4(fmt, q, scale.detach().reshape(-1) if fmt == "convrot_w4a4" else scale.detach(),
                         block, shape[0], shape[1], group)
        why = packed_reason(packed)
        if why is not None:
            return None, why
        return PlainLinear(q, scale=packed.scale, convrot=group, bias=bias, packed=packed), None
