"""Input images of the edit enhancer: up to 10, any size, in the order the prompt refers to them.

Qwen's reference (``prompt_rewrite/pe_core.py`` of QwenLM/Qwen-Image-2.1) puts the images first in
the user turn, in order, and its system prompt has the model call them ``<image1>``, ``<image2>``,
...; each image is downscaled to at most 1024 x 1024 pixels of area (its training size) keeping the
aspect ratio. The answer's ``ratio_follow`` (e.g. ``"<image1>"``) names the image whose shape the
output keeps.
"""

from __future__ import annotations

import math
import re

MAX_IMAGES = 10
MAX_PIXELS = 1024 * 1024
_REF = re.compile(r"<image(\d+)>", re.IGNORECASE)


def prepare_images(inputs) -> list:
    """IMAGE inputs (each ``[B, H, W, C]`` or None), in order, as single images ``[1, h, w, C]`` of at most 1 MP.

    A batch counts as that many images. ValueError naming the fix beyond ``MAX_IMAGES`` or for an empty image.
    """
    images = []
    for item in inputs:
        if item is None:
            continue
        if getattr(item, "ndim", 0) != 4 or item.shape[-1] not in (3, 4):
            raise ValueError("images must be IMAGE tensors [B, H, W, C]; connect Load Image nodes.")
        if item.shape[0] < 1 or item.shape[1] < 1 or item.shape[2] < 1:
            raise ValueError(f"An input image is empty (shape {tuple(item.shape)}): connect an image with at least "
                             "one pixel, or disconnect it.")
        images.extend(item[i:i + 1, ..., :3] for i in range(item.shape[0]))
    if len(images) > MAX_IMAGES:
        raise ValueError(f"The edit enhancer takes at most {MAX_IMAGES} images, got {len(images)}: disconnect some "
                         "(or split a batch) and refer to the rest as <image1>..<image10> in the prompt.")
    return [_fit(img) for img in images]


def _fit(image):
    """Downscale ``[1, H, W, C]`` so H*W <= MAX_PIXELS (aspect kept); smaller images are returned as they are."""
    h, w = int(image.shape[1]), int(image.shape[2])
    if h * w <= MAX_PIXELS:
        return image
    import torch.nn.functional as F

    s = math.sqrt(MAX_PIXELS / (h * w))
    nh, nw = max(1, int(h * s)), max(1, int(w * s))
    out = F.interpolate(image.movedim(-1, 1).float(), size=(nh, nw), mode="bicubic", antialias=True,
                        align_corners=False)
    return out.clamp(0, 1).movedim(1, -1).to(image.dtype)


def check_image_references(prompt: str, n_images: int) -> None:
    """ValueError when the prompt names ``<imageK>`` for a K beyond the connected images."""
    refs = sorted({int(m) for m in _REF.findall(prompt or "")})
    missing = [k for k in refs if not 1 <= k <= n_images]
    if missing:
        have = f"{n_images} image" + ("" if n_images == 1 else "s")
        raise ValueError(f"The prompt refers to <image{missing[0]}> but {have} {'is' if n_images == 1 else 'are'} "
                         f"connected: connect image{missing[0]} or change the prompt (images are numbered "
                         "<image1>.. in the order of the inputs).")


def followed_image(ratio_follow, n_images: int) -> int | None:
    """0-based index of the image ``ratio_follow`` names (``"<image2>"``, ``"image2"``, ``2``), else None."""
    if ratio_follow is None or isinstance(ratio_follow, bool):
        return None
    m = re.search(r"(\d+)", str(ratio_follow))
    if not m:
        return None
    k = int(m.group(1))
    return k - 1 if 1 <= k <= n_images else None


def image_ratio(image) -> str:
    """``"W:H"`` of an image ``[1, H, W, C]`` (reduced), for size_for_ratio."""
    h, w = int(image.shape[1]), int(image.shape[2])
    g = math.gcd(w, h) or 1
    return f"{w // g}:{h // g}"
