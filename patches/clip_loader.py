"""Load a Qwen3.5 text encoder as a core ComfyUI CLIP, with at most one MTP head.

The CLIP comes from ``comfy.sd.load_clip`` (so ComfyUI's memory management, quantized ops and
"Unload models" keep working). Newer ComfyUI builds its own MTP head (``Qwen35.mtp``) when the file
has ``mtp.*`` tensors: the engine then drafts with that module, and a chosen head file is loaded
into it instead of adding a second head. Otherwise the head (from the main file, else the optional
second file) is built by the engine and grafted.
"""

from __future__ import annotations

import inspect
import logging
import os
from dataclasses import dataclass

from . import comfy_bridge as bridge
from . import mtp_graft, swap_patcher

log = logging.getLogger(__name__)

NO_MTP_FILE = "none"


@dataclass
class LoadResult:
    clip: object
    status: str
    mtp: bool


def load_qwen35_clip(clip_path: str, mtp_path: str | None = None, *, device: str = "default",
                     embedding_directory=None) -> LoadResult:
    """Load ``clip_path`` (must be Qwen3.5) and graft ``mtp.*`` from it or from ``mtp_path``; the
    ``mtp_path`` header is checked (``mtp_graft.check_head_header``) before ``comfy.sd.load_clip`` runs."""
    import comfy.sd

    name = os.path.basename(clip_path)
    keys = mtp_graft.file_keys(clip_path)
    if not mtp_graft.is_qwen35_file(keys):
        raise ValueError(
            f"{name} is not a Qwen3.5 checkpoint (no {mtp_graft.QWEN35_MARKER}). Pick a Qwen3.5 text "
            "encoder such as qwen3.5_9b_qwen_image_2.1_pe_t2i.int8_convrot.safetensors; other text "
            "encoders load with core 'Load CLIP'.")
    main_has_mtp = any(k.startswith(mtp_graft.MTP_PREFIXES) for k in keys)
    if mtp_path is not None:  # a wrong head fails here, in seconds, not after the main checkpoint loaded
        mtp_graft.check_head_header(mtp_path, clip_path)

    model_options = {}
    if device == "cpu":
        import torch

        model_options["load_device"] = model_options["offload_device"] = torch.device("cpu")
    resident = {}
    if "disable_dynamic" in inspect.signature(comfy.sd.load_clip).parameters:
        # A classic ModelPatcher (the whole model loaded on the GPU when it fits, partly otherwise),
        # not DynamicVRAM's per-call streaming: the decode kernels read resident weights in place.
        resident["disable_dynamic"] = True
    clip = comfy.sd.load_clip(ckpt_paths=[clip_path], embedding_directory=embedding_directory,
                              clip_type=getattr(comfy.sd.CLIPType, "QWEN_IMAGE", comfy.sd.CLIPType.STABLE_DIFFUSION),
                              model_options=model_options, **resident)
    bridge.find_qwen35(clip)  # the loaded object must be what the engine binds to
    swap_patcher.install(clip.patcher)  # ComfyUI's own loads and unloads, its weights moved at the bus's speed
    vision = any(k.startswith("model.visual.") for k in keys)

    core_head = mtp_graft.core_mtp_head(clip)
    has_head, n, source, how = False, 0, None, ""
    if mtp_path is not None:
        source = os.path.basename(mtp_path)
        tensors = mtp_graft.read_mtp_tensors(mtp_path)
        if core_head is not None:
            n, how = mtp_graft.replace_core_head(clip, tensors, source=source), "loaded into ComfyUI's own head"
        else:
            n, how = mtp_graft.graft_mtp(clip, tensors, source=source), "grafted"
        has_head = True
    elif core_head is not None:  # ComfyUI built the head from the main file: use it as is
        source, how, has_head = name, "ComfyUI's own head", True
        n = sum(p.numel() for p in core_head.parameters())
    elif main_has_mtp:
        source = name
        n, how = mtp_graft.graft_mtp(clip, mtp_graft.read_mtp_tensors(clip_path), source=source), "grafted"
        has_head = True
    if has_head:
        status = f"{name}: Qwen3.5 loaded, MTP head from {source} ({how}, {n / 1e6:.0f} M parameters)"
    else:
        status = (f"{name}: Qwen3.5 loaded without an MTP head: MTP is off. Pick mtp_head 'download "
                  "(Qwen/Qwen3.5-9B)' (about 0.5 GB, once) or a head file to speed up decoding.")
        log.warning("%s", status)
    bridge.set_clip_info(clip, vision=vision, mtp=has_head, source=name)
    log.info("%s", status)
    return LoadResult(clip, status, has_head)
