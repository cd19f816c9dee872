"""CLIP -> CLIP patch: route a ComfyUI Qwen3.5 CLIP's ``generate`` through the engine.

``patch_clip`` clones the CLIP and adds two object patches on the clone's ModelPatcher (ComfyUI
applies them while that clone is loaded and restores the originals when another patcher of the
same model is loaded), so the input CLIP and every other clone keep core behaviour:

* ``<clip_attr>.generate(tokens, ...)`` (``SDClipModel.generate``, reached by ``CLIP.generate`` and
  therefore by core ``TextGenerate``): builds the embeddings AND the MRoPE image positions with
  ComfyUI's own ``process_tokens``, then calls the engine;
* ``<clip_attr>.transformer.generate(embeds, ...)`` (``BaseGenerate.generate``) for callers that go
  straight to the transformer with embeddings; it accepts the keyword arguments the ComfyUI
  versions pass there (``initial_tokens``, ``execution_dtype``, ``position_ids``, ``embeds_info``,
  ``min_tokens``, ``stop_tokens``, ``mtp``...).

Nothing global is modified.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from . import comfy_bridge as bridge

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PatchSettings:
    """What the patch node chose: MTP depth ("auto"/"off"/1..5) and attention backend."""

    mtp: str | int = "auto"
    attention: str = "auto"

    def checked(self) -> PatchSettings:
        """Validated copy (ValueError naming the bad option)."""
        mtp = bridge.parse_mtp(self.mtp)
        if self.attention not in bridge.ATTENTION_CHOICES:
            raise ValueError(f"attention must be one of {', '.join(bridge.ATTENTION_CHOICES)}; "
                             f"got {self.attention!r}")
        return PatchSettings(mtp, self.attention)


def _decoder(tokenizer):
    """Preview text for token ids (special tokens hidden), or None without a tokenizer."""
    if tokenizer is None or not hasattr(tokenizer, "decode"):
        return None

    def decode(ids):
        try:
            return tokenizer.decode(ids, skip_special_tokens=True)
        except Exception as exc:  # noqa: BLE001 - a preview must never break generation
            log.debug("preview decode failed: %s", exc)
            return ""

    return decode


class _EngineGenerate:
    """Shared part of the two replacements: settings, preview decoder and the engine call."""

    def __init__(self, target: bridge.Qwen35Target, settings: PatchSettings, tokenizer=None):
        self.target = target
        self.settings = settings
        self.tokenizer = tokenizer

    def _run(self, embeds, position_ids, caller_kwargs: dict, **sampling):
        mtp = _caller_mtp(self.settings.mtp, caller_kwargs.pop("mtp", None))
        _ignore_extra(caller_kwargs)
        return bridge.run_engine(
            self.target, embeds, mtp=mtp, attention=self.settings.attention, position_ids=position_ids,
            decode=_decoder(self.tokenizer), label="Qwen3.5 length-aware generate", **sampling)


class TokensGenerate(_EngineGenerate):
    """Replacement for ``SDClipModel.generate(tokens, do_sample, max_length, ...)``."""

    def __call__(self, tokens, do_sample=True, max_length=256, temperature=1.0, top_k=50, top_p=0.95,
                 min_p=0.0, repetition_penalty=1.0, seed=None, presence_penalty=0.0, **kwargs):
        clip_model = self.target.clip_model
        device = getattr(clip_model, "execution_device", None)
        if device is None:
            device = clip_model.transformer.get_input_embeddings().weight.device
        embeds, position_ids = bridge.prompt_embeds(self.target, tokens, device)
        return self._run(
            embeds, position_ids, kwargs, do_sample=do_sample, max_length=max_length, temperature=temperature,
            top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty, seed=seed,
            presence_penalty=presence_penalty)


class EmbedsGenerate(_EngineGenerate):
    """Replacement for ``BaseGenerate.generate(embeds, do_sample, max_length, ...)``."""

    def __call__(self, embeds=None, do_sample=True, max_length=256, temperature=1.0, top_k=50, top_p=0.9,
                 min_p=0.0, repetition_penalty=1.0, seed=42, stop_tokens=None, initial_tokens=(),
                 execution_dtype=None, min_tokens=0, presence_penalty=0.0, initial_input_ids=None,
                 position_ids=None, deepstack_embeds=None, visual_pos_masks=None, embeds_info=None, **kwargs):
        if embeds is None:
            raise ValueError("generate() needs prompt embeddings (embeds=...).")
        if initial_input_ids is not None or deepstack_embeds is not None:
            raise bridge.Qwen35Unsupported(
                "This generate() call passes initial_input_ids/deepstack_embeds, which Qwen3.5 never "
                "uses; remove the 'Length-aware decode (Qwen3.5)' node for this model.")
        if embeds.ndim == 2:
            embeds = embeds.unsqueeze(0)
        if position_ids is None and embeds_info:
            position_ids = bridge.mrope_positions(embeds_info, embeds.shape[1], embeds.device)
        return self._run(
            embeds, position_ids, kwargs, do_sample=do_sample, max_length=max_length, temperature=temperature,
            top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty, seed=seed,
            presence_penalty=presence_penalty, stop_tokens=stop_tokens, initial_tokens=initial_tokens,
            min_tokens=min_tokens, execution_dtype=execution_dtype)


def _caller_mtp(patch_mtp, caller_mtp):
    """The patch node's MTP choice wins; a caller's value is only used under "auto"."""
    if patch_mtp != "auto" or caller_mtp is None:
        return patch_mtp
    try:
        return bridge.parse_mtp(caller_mtp)
    except ValueError:
        if caller_mtp in (True, False, 0):
            return "auto" if caller_mtp else "off"
        log.warning("ignoring the caller's mtp=%r (not auto/off/1..5)", caller_mtp)
        return patch_mtp


def _ignore_extra(kwargs: Mapping) -> None:
    if kwargs:
        log.debug("length-aware generate ignores arguments it does not use: %s", sorted(kwargs))


def patch_clip(clip, *, mtp="auto", attention="auto"):
    """Return a clone of ``clip`` whose Qwen3.5 ``generate`` runs on the engine; ``clip`` is untouched.

    Raises ``Qwen35Unsupported`` (a ValueError) before cloning when ``clip`` is not Qwen3.5 or its
    internals are unknown, and ValueError for a bad option.
    """
    settings = PatchSettings(mtp, attention).checked()
    target = bridge.find_qwen35(clip)
    for obj, name in ((target.clip_model, "generate"), (target.transformer, "generate")):
        if not callable(getattr(obj, name, None)):
            raise bridge.Qwen35Unsupported(
                f"{type(obj).__name__} has no {name}(): this ComfyUI version cannot generate text with "
                "Qwen3.5; update ComfyUI.")
    patched = clip.clone()
    if not hasattr(patched, "patcher") or not hasattr(patched.patcher, "add_object_patch"):
        raise bridge.Qwen35Unsupported("This ComfyUI's CLIP patcher has no add_object_patch(); update ComfyUI.")
    tokenizer = getattr(clip, "tokenizer", None)
    patched.patcher.add_object_patch(target.generate_path, TokensGenerate(target, settings, tokenizer))
    patched.patcher.add_object_patch(target.transformer_generate_path, EmbedsGenerate(target, settings, tokenizer))
    bridge.set_clip_info(patched, patched_generate=True, mtp=str(settings.mtp), attention=settings.attention)
    log.info("Qwen3.5 length-aware decode on %s (mtp=%s, attention=%s)", target.clip_attr, settings.mtp,
             settings.attention)
    return patched
