"""The Qwen-Image 2.1 prompt enhancer on a ComfyUI CLIP: chat text -> ComfyUI tokens -> the
length-aware patch -> engine -> thinking / answer / parsed JSON / latent size.

Presets carry the official sampling settings; the system prompt ``"official"`` is Qwen's own for the
preset, fetched once into the models folder (not bundled: Qwen Research License); text the user writes
replaces it. Edit mode takes up to 10 images. Thinking is on by default, as in the official pipeline.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..downloads import model_fetch
from ..engine import ThinkingBudget
from ..patches import clip_patch
from ..patches import comfy_bridge as bridge
from . import enhancer_images
from .enhancer_answer import check_megapixels, parse_answer, size_for_ratio, split_thinking

log = logging.getLogger(__name__)

#: The official sampling settings of the two enhancer modes ("custom" takes the node's own values).
PRESETS: dict[str, dict] = {
    "text-to-image": {"temperature": 1.0, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "presence_penalty": 1.5},
    "edit": {"temperature": 1.0, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "presence_penalty": 0.0},
}
PRESET_NAMES = (*PRESETS, "custom")
#: The system_prompt value that means "Qwen's official prompt for this preset" (fetched once, then offline).
OFFICIAL = "official"
VISION_BLOCK = "<|vision_start|><|image_pad|><|vision_end|>"
MAX_LENGTH_LIMIT = 65536
#: How the chat template closes a thinking block, and the token that ends it.
THINK_CLOSE, THINK_END = "\n</think>\n\n", "</think>"
_IM_START = "<|im_start|>"

_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty")


def preset_settings(name: str) -> dict:
    """The sampling settings of an official preset (a copy of ``PRESETS[name]``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESET_NAMES)}")
    return dict(PRESETS[name])


def sampling_settings(preset: str, custom: dict | None = None) -> dict:
    """The sampling settings a run uses: the preset's, or ``custom``'s values for preset ``"custom"``."""
    if preset == "custom":
        return {k: (custom or {})[k] for k in _SAMPLING_KEYS}
    return preset_settings(preset)


def chat_text(system_prompt: str, prompt: str, n_images: int, thinking: bool) -> str:
    """Qwen3.5 chat text in ComfyUI's tokenizer convention (one ``<|image_pad|>`` per image)."""
    parts = []
    if system_prompt.strip():
        parts.append(f"<|im_start|>system\n{system_prompt.strip()}<|im_end|>\n")
    parts.append(f"<|im_start|>user\n{VISION_BLOCK * n_images}{prompt}<|im_end|>\n<|im_start|>assistant\n")
    parts.append("<think>\n" if thinking else "<think>\n\n</think>\n\n")
    return "".join(parts)


def _models_dir() -> str:
    import folder_paths

    return folder_paths.models_dir


def resolve_system_prompt(system_prompt: str, preset: str) -> str:
    """The system prompt to use: Qwen's official one for ``"official"``, else the user's text.

    Empty is refused for the official presets (the enhancer without its instructions answers badly,
    and silently); ``custom`` may run without one.
    """
    text = (system_prompt or "").strip()
    if text.lower() == OFFICIAL:
        if preset not in model_fetch.PROMPT_REPOS:
            raise ValueError(f"system_prompt '{OFFICIAL}' needs preset text-to-image or edit (each has its own "
                             "official prompt); with preset 'custom' write the system prompt yourself.")
        return model_fetch.official_system_prompt(preset, _models_dir())
    if not text and preset in model_fetch.PROMPT_REPOS:
        raise ValueError(
            f"The system prompt is empty, so the {preset} enhancer would run without its instructions. Set "
            f"system_prompt to '{OFFICIAL}' (Qwen's prompt for this preset, fetched once from "
            f"{model_fetch.PROMPT_REPOS[preset]}) or write your own; only preset 'custom' runs without one.")
    return text


@dataclass
class EnhancerResult:
    rewritten_prompt: str
    thinking: str
    wh_ratio: str
    ratio_follow: str
    width: int
    height: int
    parse_ok: bool
    text: str
    stats: object = None


def check_prompt(prompt: str, max_length: int) -> None:
    """ValueError naming the fix for an empty prompt or a max_length out of range (every backend)."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("The prompt is empty: type what the image should show (or what to change in the "
                         "input image).")
    if not isinstance(max_length, int) or isinstance(max_length, bool) or not 1 <= max_length <= MAX_LENGTH_LIMIT:
        raise ValueError(f"max_length must be between 1 and {MAX_LENGTH_LIMIT}, got {max_length!r}. The "
                         "official settings use 16256 (text-to-image) and 24000 (edit).")


def check_inputs(clip, prompt: str, images, max_length: int) -> bridge.Qwen35Target:
    """Validate before any work; raise ValueError naming the fix."""
    target = bridge.find_qwen35(clip)
    check_prompt(prompt, max_length)
    if images:
        if bridge.has_vision_weights(clip) is False:
            raise ValueError(
                "Images were connected but this Qwen3.5 checkpoint has no vision weights (model.visual.*). "
                "Use the edit prompt-enhancer file (qwen3.5_9b_qwen_image_2.1_pe_i2i.int8_convrot."
                "safetensors) or disconnect the images.")
    return target


def text_ids(clip, text: str) -> list[int]:
    """``text``'s token ids as ComfyUI's Qwen3.5 tokenizer writes them, with no chat template (its
    tokenizer leaves text that starts with ``<|im_start|>`` as it is; that first id is dropped).
    ``Qwen35Unsupported`` where the ids do not decode back to ``text``."""
    rows = next(iter(clip.tokenize(_IM_START + text).values()))
    ids = [int(t[0]) for row in rows for t in row if isinstance(t[0], int)]
    if ids and clip.decode(ids[:1], skip_special_tokens=False) == _IM_START:
        ids = ids[1:]
    if not ids or clip.decode(ids, skip_special_tokens=False) != text:
        raise bridge.Qwen35Unsupported(f"ComfyUI's tokenizer does not write {text!r} as Qwen3.5's tokenizer does: "
                                       "set thinking_budget to 0 or update ComfyUI.")
    return ids


def check_thinking_budget(tokens) -> int:
    """``tokens`` (0: no limit), or ValueError naming the range (every backend)."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 <= tokens <= MAX_LENGTH_LIMIT:
        raise ValueError(f"thinking_budget must be between 0 (no limit) and {MAX_LENGTH_LIMIT}, got {tokens!r}.")
    return tokens


def thinking_budget_of(clip, tokens: int):
    """An ``engine.ThinkingBudget`` of ``tokens`` thinking tokens for this CLIP's tokenizer (``THINK_CLOSE``
    written at the budget), or None for 0. ValueError naming the fix for a bad value."""
    if not check_thinking_budget(tokens):
        return None
    close, end = text_ids(clip, THINK_CLOSE), text_ids(clip, THINK_END)
    if len(end) != 1 or end[0] not in close:
        raise bridge.Qwen35Unsupported(f"ComfyUI's tokenizer has no single {THINK_END} token: set thinking_budget "
                                       "to 0 or update ComfyUI.")
    return ThinkingBudget(tokens, tuple(close), end[0])


def enhance(clip, prompt: str, *, system_prompt: str = OFFICIAL, images=None, preset: str = "text-to-image",
            custom: dict | None = None, max_length: int = 16256, seed: int = 0, mtp="auto",
            attention: str = "auto", thinking: bool = True, megapixels: float = 1.0,
            thinking_budget: int = 0) -> EnhancerResult:
    """Run the prompt enhancer; ``custom`` sampling values are used when ``preset == "custom"``.
    ``thinking_budget``: 0 (no limit, official) or the thinking tokens after which the block is closed
    and the answer follows (with ``thinking`` only)."""
    check_megapixels(megapixels)  # the size is computed after the generation: refuse a bad value before it
    check_thinking_budget(thinking_budget)
    if images is not None and not isinstance(images, (list, tuple)):
        images = [images]
    image_list = enhancer_images.prepare_images(images or [])
    check_inputs(clip, prompt, image_list, max_length)
    enhancer_images.check_image_references(prompt, len(image_list))
    settings = sampling_settings(preset, custom)
    system = resolve_system_prompt(system_prompt, preset)
    text = chat_text(system, prompt, len(image_list), thinking)
    tokens = clip.tokenize(text, images=image_list) if image_list else clip.tokenize(text)
    if image_list and not bridge.has_images(tokens):
        raise bridge.Qwen35Unsupported("ComfyUI's tokenizer did not attach the images to the prompt: "
                                       "update ComfyUI to use images with Qwen3.5.")
    budget = thinking_budget_of(clip, thinking_budget) if thinking else None
    patched = clip_patch.patch_clip(clip, mtp=mtp, attention=attention, thinking_budget=budget)
    ids = patched.generate(tokens, do_sample=True, max_length=max_length, temperature=settings["temperature"],
                           top_k=settings["top_k"], top_p=settings["top_p"], min_p=settings["min_p"],
                           repetition_penalty=1.0, seed=seed, presence_penalty=settings["presence_penalty"])
    stats = getattr(ids, "stats", None)
    stops = set(bridge.stop_tokens_of(bridge.find_qwen35(clip)))
    body = list(ids)
    while body and body[-1] in stops:
        body.pop()
    text_out = clip.decode(body, skip_special_tokens=False)
    return finish_answer(text_out, prompt, thinking=thinking, image_list=image_list,
                         megapixels=megapixels, max_length=max_length, stats=stats)


def finish_answer(text_out: str, prompt: str, *, thinking: bool, image_list: list, megapixels: float,
                  max_length: int, stats=None) -> EnhancerResult:
    """The enhancer's outputs from the generated text (thinking block, answer JSON, latent size), for every
    backend. ``text_out`` starts inside the thinking block when ``thinking`` (the prompt opened it); an empty
    answer gives the user's ``prompt`` back with ``parse_ok`` False and a warning naming the fix."""
    if thinking and "<think>" not in text_out.split("</think>")[0]:
        text_out = "<think>\n" + text_out  # the prompt opened the block; let split_thinking see it
    thinking_text, answer = split_thinking(text_out)
    parsed = parse_answer(answer)
    ratio = parsed.wh_ratio if isinstance(parsed.wh_ratio, str) else (
        "" if parsed.wh_ratio is None else str(parsed.wh_ratio))
    follow = "" if parsed.ratio_follow in (None, False) else str(parsed.ratio_follow)
    followed = enhancer_images.followed_image(parsed.ratio_follow, len(image_list))
    if followed is not None:  # keep that input image's shape, as the official pipeline does
        width, height = size_for_ratio(enhancer_images.image_ratio(image_list[followed]), megapixels)
    else:
        width, height = size_for_ratio(parsed.wh_ratio, megapixels)
    rewritten, parse_ok = parsed.rewritten_prompt, bool(parsed.parse_ok)
    if not (rewritten or "").strip():
        # The token budget ended inside the thinking block (or the answer was empty): never hand an
        # empty prompt to the image model; fall back to the user's own prompt and say so.
        unfinished = thinking and "</think>" not in text_out
        # One warning for this cause (split_thinking and parse_answer stay quiet on it), advice first, one line.
        why = (f"the model was still thinking when its {max_length} tokens ran out"
               if unfinished else "the model gave an empty answer")
        message = (f"Raise max_length (official: 16256 text-to-image, 24000 edit): {why}, so your own prompt "
                   "was used unchanged (parse_ok False).")
        log.warning("Qwen3.5 prompt enhancer: %s", message)
        if getattr(stats, "steps", None) is not None:  # the local engine's stats: keep its line on the node too
            message += f"\n[{bridge.format_stats('Qwen3.5 prompt enhancer', stats)}]"
        bridge.show_warning(message)
        rewritten, parse_ok = prompt.strip(), False
    return EnhancerResult(rewritten, thinking_text, ratio, follow, int(width), int(height), parse_ok, text_out, stats)
