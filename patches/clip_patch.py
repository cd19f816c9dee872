"""CLIP -> CLIP patch: route every Qwen3.5 generation entry point of a ComfyUI CLIP through the engine.

``patch_clip`` clones the CLIP and adds object patches on the clone's ModelPatcher (ComfyUI applies
them while that clone is loaded and restores the originals when another patcher of the same model
is loaded), so the input CLIP and every other clone keep core behaviour. A DynamicVRAM CLIP is
cloned from ComfyUI's resident reload of it (``comfy_weights.resident_clip``) where it fits the
GPU. Entry points, with the argument sets the ComfyUI versions pass (0.29.0; the FixedKVBias and
FixedKVCache generations):

* ``<clip_attr>.generate(tokens, ...)`` (``SDClipModel.generate``, reached by ``CLIP.generate`` and
  therefore by core ``TextGenerate``; newer versions add ``mtp=``): builds the embeddings AND the
  MRoPE image positions with ComfyUI's own ``process_tokens``, then calls the engine;
* ``<clip_attr>.transformer.generate(embeds, ...)`` (``BaseGenerate.generate`` / ``Qwen35.generate``)
  for callers that go straight to the transformer with embeddings;
* ``<clip_attr>.transformer._generate_mtp(embeds, max_length, stop_tokens, sampling, fixed_depth
  [, position_ids])``, core's private MTP loop on versions that have one (other node packs call it
  directly).

An argument none of these versions passes raises ``Qwen35Unsupported`` on the patched clone (never a
silent fallback); the input CLIP is never touched. Nothing global is modified.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from . import comfy_bridge as bridge
from . import comfy_weights, swap_patcher

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PatchSettings:
    """What the patch node (or the enhancer) chose: MTP depth ("auto"/"off"/1..5), attention backend, and
    a thinking budget (``engine.ThinkingBudget``, None: none) that core's ``generate`` cannot carry."""

    mtp: str | int = "auto"
    attention: str = "auto"
    thinking_budget: object = None

    def checked(self) -> PatchSettings:
        """Validated copy (ValueError naming the bad option; the budget is checked by the engine)."""
        mtp = bridge.parse_mtp(self.mtp)
        if self.attention not in bridge.ATTENTION_CHOICES:
            raise ValueError(f"attention must be one of {', '.join(bridge.ATTENTION_CHOICES)}; "
                             f"got {self.attention!r}")
        return PatchSettings(mtp, self.attention, self.thinking_budget)


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
        self.report_to: tuple[str, str] | None = None  # (patch node id, its status line): see report_runs_to

    entry = "generate"

    def _run(self, embeds, position_ids, caller_kwargs: dict, **sampling):
        mtp = _caller_mtp(self.settings.mtp, caller_kwargs.pop("mtp", None))
        _refuse_unknown(self.entry, caller_kwargs)
        tokens = bridge.run_engine(
            self.target, embeds, mtp=mtp, attention=self.settings.attention, position_ids=position_ids,
            thinking_budget=self.settings.thinking_budget,
            decode=_decoder(self.tokenizer), label="Qwen3.5 length-aware generate", **sampling)
        if self.report_to is not None and self.report_to[0] != bridge.executing_node_id():
            node_id, status = self.report_to
            lines = bridge.status_lines(tokens.stats, tokens.stop_reason)
            lines[0] = f"Last run: {lines[0]}"
            bridge.show_status("\n".join([*tokens.notes, status.split("\n")[0], *lines]), node_id)
        return tokens


def report_runs_to(patched, node_id: str | None, status: str) -> None:
    """After each generation on ``patched`` (a ``patch_clip`` result) run by ANOTHER node (core Generate
    Text), show under node ``node_id`` (the patch node, which returned before the run) the run's notes
    to act on (a suspect head), then the first line of ``status`` (the MTP state: "MTP off: no head ..."
    stays in view), then "Last run: " and the run's summary (tokens, tok/s, MTP acceptance), then its
    details. ``node_id`` None: nothing is shown."""
    for patch in getattr(getattr(patched, "patcher", None), "object_patches", {}).values():
        if isinstance(patch, _EngineGenerate):
            patch.report_to = None if node_id is None else (str(node_id), status)


class TokensGenerate(_EngineGenerate):
    """Replacement for ``SDClipModel.generate(tokens, do_sample, max_length, ...[, mtp])``."""

    entry = "SDClipModel.generate"

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
    """Replacement for ``BaseGenerate.generate`` / ``Qwen35.generate(embeds, do_sample, max_length, ...[, mtp])``."""

    entry = "Qwen35.generate"

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


class MTPLoopGenerate(_EngineGenerate):
    """Replacement for core's ``Qwen35._generate_mtp(embeds, max_length, stop_tokens, sampling=None,
    fixed_depth=None[, position_ids])``: ``sampling`` None is greedy, else a dict of core's sampling
    settings; ``fixed_depth`` is the caller's draft depth (used under mtp "auto")."""

    entry = "Qwen35._generate_mtp"
    SAMPLING_KEYS = frozenset({"temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                               "seed"})

    def __call__(self, embeds, max_length, stop_tokens=None, sampling=None, fixed_depth=None, position_ids=None,
                 **kwargs):
        if embeds.ndim == 2:
            embeds = embeds.unsqueeze(0)
        if sampling is not None:
            unknown = sorted(set(sampling) - self.SAMPLING_KEYS)
            if unknown:
                raise bridge.Qwen35Unsupported(
                    f"{self.entry}() got sampling settings {unknown} this pack does not know; remove the "
                    "'Length-aware decode (Qwen3.5)' node for this caller or update the pack.")
        s = dict(sampling or {})
        if fixed_depth is not None:
            kwargs["mtp"] = int(fixed_depth)
        return self._run(
            embeds, position_ids, kwargs, do_sample=sampling is not None, max_length=max_length,
            temperature=s.get("temperature", 1.0), top_k=s.get("top_k", 0), top_p=s.get("top_p", 1.0),
            min_p=s.get("min_p", 0.0), repetition_penalty=s.get("repetition_penalty", 1.0),
            seed=s.get("seed", 42), presence_penalty=s.get("presence_penalty", 0.0) or 0.0, stop_tokens=stop_tokens)


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


def _refuse_unknown(entry: str, kwargs: Mapping) -> None:
    if kwargs:
        raise bridge.Qwen35Unsupported(
            f"{entry}() got arguments the length-aware decode does not know: {sorted(kwargs)}. This ComfyUI "
            "(or the calling node) passes something newer than this pack supports: update the pack, or "
            "remove the 'Length-aware decode (Qwen3.5)' node for this model.")


def patch_status(clip, mtp: str) -> str:
    """The patch node's status: its first line whether MTP runs (the fix, when it cannot), short enough
    to stay in view under the node; a second line, where MTP cannot run, that decoding is length-aware."""
    target = bridge.find_qwen35(clip)
    has_head = getattr(target.model, "mtp", None) is not None or getattr(target.transformer, "mtp", None) is not None
    if str(mtp) == "off":
        return "MTP off (mtp = off); length-aware decode on."
    if not has_head:
        return ("MTP off: no head. Load the CLIP with 'Load Qwen3.5 CLIP (MTP)'.\n"
                "Length-aware decode on.")
    return f"MTP {mtp}; length-aware decode on."


def patch_clip(clip, *, mtp="auto", attention="auto", thinking_budget=None):
    """Return a clone of ``clip`` whose Qwen3.5 ``generate`` runs on the engine; ``clip`` is untouched.
    ``thinking_budget``: None or an ``engine.ThinkingBudget`` every generation on the clone keeps.

    For a CLIP ComfyUI loaded with DynamicVRAM (weights streamed in per call) the clone is of ComfyUI's
    resident reload of it, made once per model (``comfy_weights.resident_clip``), where the model fits
    whole on the GPU. Raises ``Qwen35Unsupported`` (a ValueError) before cloning when ``clip`` is not
    Qwen3.5 or its internals are unknown, and ValueError for a bad option.
    """
    settings = PatchSettings(mtp, attention, thinking_budget).checked()
    target = bridge.find_qwen35(clip)
    for obj, name in ((target.clip_model, "generate"), (target.transformer, "generate")):
        if not callable(getattr(obj, name, None)):
            raise bridge.Qwen35Unsupported(
                f"{type(obj).__name__} has no {name}(): this ComfyUI version cannot generate text with "
                "Qwen3.5; update ComfyUI.")
    source, streamed = comfy_weights.resident_clip(clip)  # after the checks: nothing reloaded for a refusal
    if source is clip:
        patched = clip.clone()
    else:  # a fresh clone over the resident reload
        patched, target = source, bridge.find_qwen35(source)
    target.streamed = streamed
    if not hasattr(patched, "patcher") or not hasattr(patched.patcher, "add_object_patch"):
        raise bridge.Qwen35Unsupported("This ComfyUI's CLIP patcher has no add_object_patch(); update ComfyUI.")
    swap_patcher.install(patched.patcher)  # its weights move at the bus's speed (ComfyUI still decides when)
    tokenizer = getattr(clip, "tokenizer", None)
    patched.patcher.add_object_patch(target.generate_path, TokensGenerate(target, settings, tokenizer))
    patched.patcher.add_object_patch(target.transformer_generate_path, EmbedsGenerate(target, settings, tokenizer))
    routed = ["generate(tokens)", "generate(embeds)"]
    if callable(getattr(target.transformer, "_generate_mtp", None)):  # core's own MTP loop (newer ComfyUI)
        patched.patcher.add_object_patch(f"{target.clip_attr}.transformer._generate_mtp",
                                         MTPLoopGenerate(target, settings, tokenizer))
        routed.append("_generate_mtp")
    bridge.set_clip_info(patched, patched_generate=True, mtp=str(settings.mtp), attention=settings.attention)
    log.info("Qwen3.5 length-aware decode on %s (mtp=%s, attention=%s; routed: %s)", target.clip_attr, settings.mtp,
             settings.attention, ", ".join(routed))
    return patched
