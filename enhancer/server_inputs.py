"""One prompt's inputs for the server enhancer, checked before any request (as the local node checks them):
prompt and max_length, megapixels (NaN included), the seed range, the thinking switch, the preset and its
sampling values, the images and the prompt's ``<imageK>`` references. Each check raises ValueError naming the
input and the fix."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from . import enhancer_images
from .enhancer_answer import check_megapixels
from .prompt_enhancer import OFFICIAL, PRESET_NAMES, check_prompt, sampling_settings
from .server_api import SEED_MAX


@dataclass
class ServerJob:
    """One prompt's inputs, as the local enhancer takes them (``images``: IMAGE tensors ``[B, H, W, C]`` or None)."""

    prompt: str
    system_prompt: str = OFFICIAL
    preset: str = "text-to-image"
    custom: dict | None = None
    max_length: int = 16256
    seed: int = 42
    thinking: bool = True
    megapixels: float = 1.0
    images: list = field(default_factory=list)


def _real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_sampling(s: dict) -> None:
    """ValueError for sampling values the local enhancer refuses too (NaN, negatives, out of range)."""
    fix = "set it in the node's advanced inputs (used with preset 'custom')"
    if not _real(s["temperature"]) or s["temperature"] < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {s['temperature']!r}: {fix}.")
    k = s["top_k"]
    if isinstance(k, bool) or not (isinstance(k, int) or (isinstance(k, float) and k.is_integer())) or k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {k!r}: {fix}.")
    if not _real(s["top_p"]) or not 0 < s["top_p"] <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {s['top_p']!r}: {fix}.")
    if not _real(s["min_p"]) or not 0 <= s["min_p"] <= 1:
        raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {s['min_p']!r}: {fix}.")
    if not _real(s["presence_penalty"]):
        raise ValueError(f"presence_penalty must be a finite number (0 disables it), got "
                         f"{s['presence_penalty']!r}: {fix}.")


def check_job(job: ServerJob) -> tuple[dict, list]:
    """(the sampling settings, the images as ``[1, h, w, 3]`` of at most 1 MP) of a job whose every input is
    usable; ValueError naming the input and the fix otherwise."""
    check_prompt(job.prompt, job.max_length)
    check_megapixels(job.megapixels)
    seed = job.seed
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
        raise ValueError(f"seed must be an integer from 0 to {SEED_MAX} (sent to the server as it is; every "
                         f"supported server takes this range), got {seed!r}: set a seed in that range.")
    if not isinstance(job.thinking, bool):
        raise ValueError(f"thinking must be true or false, got {job.thinking!r}.")
    if job.preset not in PRESET_NAMES:
        raise ValueError(f"unknown preset {job.preset!r}; choose one of {', '.join(PRESET_NAMES)}.")
    settings = sampling_settings(job.preset, job.custom)
    check_sampling(settings)
    images = enhancer_images.prepare_images(job.images or [])
    enhancer_images.check_image_references(job.prompt, len(images))
    return {k: (int(v) if k == "top_k" else float(v)) for k, v in settings.items()}, images
