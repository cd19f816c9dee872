"""Glue between a ComfyUI ``CLIP`` holding Qwen3.5 and the engine: find the model, build the prompt
embeddings and MRoPE positions the way ComfyUI does, cast ComfyUI's weights for the engine, report
progress, honour Cancel.

It imports ``comfy`` lazily, so the pack imports without ComfyUI (tests, scripts). Nothing here
patches anything: ``patches/clip_patch.py`` decides where these functions are plugged in.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..engine import ATTENTION_CHOICES, MTP_CHOICES, check_max_length, generate, parse_mtp
from ..engine.config import RELEASED_STOP_TOKENS
from . import comfy_weights, swap_patcher
from .stats_line import format_mtp, format_stats, log_line, status_lines, suspect_head_note

log = logging.getLogger(__name__)

#: Key under ``clip.patcher.model_options`` where the pack records what it knows about a CLIP.
INFO_KEY = "qwen35_fast"

__all__ = ["ATTENTION_CHOICES", "MTP_CHOICES", "parse_mtp",  # the nodes' options, from the engine
           "format_mtp", "format_stats", "status_lines"]

#: How the engine reads ComfyUI-loaded weights in place (one per process: it caches ConvRot matrices).
WEIGHTS = comfy_weights.Resolver()


class Qwen35Unsupported(ValueError):
    """The CLIP is not a Qwen3.5 text encoder, or its internals are not the ones this pack knows."""


@dataclass
class Qwen35Target:
    """Where Qwen3.5 lives inside a ComfyUI CLIP.

    ``clip_attr``: attribute of ``clip.cond_stage_model`` holding the ``SDClipModel`` (e.g.
    ``"qwen35_9b"``); ``clip_model``: that ``SDClipModel``; ``transformer``: its ``Qwen35``
    (``BaseGenerate``) instance; ``model``: the decoder module tree (``transformer.model``);
    ``patcher``: the CLIP's ModelPatcher (None when unknown); ``streamed``: why ComfyUI still streams
    its weights in per call (DynamicVRAM) after ``comfy_weights.resident_clip``, None otherwise.
    """

    clip_attr: str
    clip_model: Any
    transformer: Any
    model: Any
    patcher: Any = None
    streamed: str | None = None

    @property
    def generate_path(self) -> str:
        """Object-patch key of the ``SDClipModel.generate(tokens, ...)`` method."""
        return f"{self.clip_attr}.generate"

    @property
    def transformer_generate_path(self) -> str:
        """Object-patch key of the ``BaseGenerate.generate(embeds, ...)`` method."""
        return f"{self.clip_attr}.transformer.generate"


def find_qwen35(clip) -> Qwen35Target:
    """Locate Qwen3.5 inside ``clip`` (a ComfyUI CLIP); raise Qwen35Unsupported naming the fix."""
    if clip is None:
        raise Qwen35Unsupported("No CLIP was connected: connect the CLIP output of a Qwen3.5 loader.")
    csm = getattr(clip, "cond_stage_model", None)
    if csm is None or not hasattr(clip, "patcher"):
        raise Qwen35Unsupported(
            f"Expected a ComfyUI CLIP object, got {type(clip).__name__}. Connect the CLIP output of "
            "'Load Qwen3.5 CLIP (MTP)' or the core 'Load CLIP' node.")
    clip_attr = getattr(csm, "clip", None)
    clip_model = getattr(csm, clip_attr, None) if isinstance(clip_attr, str) else None
    transformer = getattr(clip_model, "transformer", None)
    model = getattr(transformer, "model", None)
    if transformer is None or model is None or not hasattr(model, "layers"):
        raise Qwen35Unsupported(
            f"This CLIP ({type(csm).__name__}) is not a single text-generation model this pack "
            "understands. Load a Qwen3.5 text encoder (e.g. qwen3.5_9b_qwen_image_2.1_pe_t2i) with "
            "'Load Qwen3.5 CLIP (MTP)' or core 'Load CLIP'; if it is one, your ComfyUI version "
            "arranges its internals differently: update ComfyUI or report the version.")
    layers = list(model.layers)
    if not any(hasattr(layer, "linear_attn") for layer in layers) or not hasattr(transformer, "generate"):
        raise Qwen35Unsupported(
            f"The connected CLIP is {type(transformer).__name__} ({clip_attr}), not Qwen3.5. This node "
            "needs a Qwen3.5 text encoder such as qwen3.5_9b_qwen_image_2.1_pe_t2i.int8_convrot."
            "safetensors; load it with 'Load Qwen3.5 CLIP (MTP)'.")
    for name in ("process_tokens",):
        if not hasattr(clip_model, name):
            raise Qwen35Unsupported(
                f"{type(clip_model).__name__} has no {name}(): this ComfyUI version is not supported "
                "by the pack; update ComfyUI.")
    return Qwen35Target(clip_attr, clip_model, transformer, model, getattr(clip, "patcher", None))


# ---------------------------------------------------------------------------------------------
# What the pack knows about a CLIP (recorded by the loader, cloned with the patcher)


def clip_info(clip) -> dict:
    """The pack's record for ``clip`` (empty dict when it was not loaded by the pack's loader)."""
    options = getattr(getattr(clip, "patcher", None), "model_options", None) or {}
    info = options.get(INFO_KEY)
    return dict(info) if isinstance(info, Mapping) else {}


def set_clip_info(clip, **values) -> None:
    """Merge ``values`` into the pack's record for ``clip`` (kept on clones of its patcher)."""
    options = clip.patcher.model_options
    info = dict(options.get(INFO_KEY) or {})
    info.update(values)
    options[INFO_KEY] = info


def source_files(clip) -> list[str]:
    """Checkpoint paths ComfyUI loaded ``clip`` from, when it recorded them (``load_clip`` does)."""
    init = getattr(getattr(clip, "patcher", None), "cached_patcher_init", None)
    try:
        paths = init[1][0]
    except (TypeError, IndexError, KeyError):
        return []
    if isinstance(paths, (str, bytes)):
        return [paths]
    return [p for p in paths if isinstance(p, str)] if isinstance(paths, Sequence) else []


def has_vision_weights(clip) -> bool | None:
    """True/False when known whether the checkpoint behind ``clip`` carries ``model.visual.*``.

    Uses the loader's record, else the safetensors headers of the files ComfyUI loaded; None when
    neither is available (then the caller cannot tell and should not refuse).
    """
    info = clip_info(clip)
    if "vision" in info:
        return bool(info["vision"])
    files = [p for p in source_files(clip) if p.endswith(".safetensors")]
    if not files:
        return None
    from safetensors import safe_open

    try:
        for path in files:
            with safe_open(path, framework="pt") as f:
                if any(k.startswith(("model.visual.", "visual.")) for k in f.keys()):
                    return True
    except (OSError, RuntimeError, ValueError) as exc:
        log.debug("could not read %s to look for vision weights: %s", files, exc)
        return None
    return False


def has_images(tokens) -> bool:
    """True when ComfyUI ``tokens`` (from ``clip.tokenize``) carry image embeds."""
    rows = next(iter(tokens.values())) if isinstance(tokens, Mapping) else tokens
    for row in rows:
        for item in row:
            value = item[0] if isinstance(item, tuple) else item
            if isinstance(value, Mapping) and value.get("type") == "image":
                return True
    return False


# ---------------------------------------------------------------------------------------------
# Prompt -> embeddings + positions (ComfyUI's own path)


def prompt_embeds(target: Qwen35Target, tokens, device):
    """Embed ComfyUI ``tokens`` exactly as ``SDClipModel.generate`` does.

    Returns ``(embeds [1, T, H] float32, position_ids [3, T] int64 or None)``; position ids are the
    MRoPE ids ComfyUI's Qwen3.5 forward uses for image prompts (None for text-only prompts, where
    MRoPE reduces to 1-D positions 0..T-1).
    """
    rows = next(iter(tokens.values())) if isinstance(tokens, Mapping) else tokens
    tokens_only = [[t[0] if isinstance(t, tuple) else t for t in row] for row in rows]
    out = target.clip_model.process_tokens(tokens_only, device=device)
    embeds = out[0]
    embeds_info = out[3] if len(out) > 3 else []
    return embeds, mrope_positions(embeds_info, embeds.shape[1], embeds.device)


def mrope_positions(embeds_info, seq_len: int, device):
    """ComfyUI's MRoPE ids ``[3, seq_len]`` (int64) for ``embeds_info``; None without images."""
    if not embeds_info or not any(e.get("type") == "image" for e in embeds_info):
        return None
    try:
        from comfy.text_encoders.qwen_vl import qwen2vl_mrope_position_ids
    except ImportError as exc:
        raise Qwen35Unsupported(
            "This ComfyUI has no comfy.text_encoders.qwen_vl.qwen2vl_mrope_position_ids, so image "
            "positions cannot be computed: update ComfyUI to use images with Qwen3.5.") from exc
    ids = qwen2vl_mrope_position_ids(embeds_info, seq_len, device)
    return None if ids is None else ids.round().long()


# ---------------------------------------------------------------------------------------------
# Progress, Cancel, live preview


def executing_node_id() -> str | None:
    """Id of the node ComfyUI is executing now, when this ComfyUI exposes it."""
    try:
        from comfy_execution.utils import get_executing_context
    except ImportError:
        return None
    ctx = get_executing_context()
    return None if ctx is None else getattr(ctx, "node_id", None)


def _send_text(text: str, node_id: str | None) -> bool:
    """Show ``text`` under node ``node_id`` (PromptServer progress text, where it exists)."""
    if node_id is None:
        return False
    try:
        from server import PromptServer
    except ImportError:
        return False
    server = getattr(PromptServer, "instance", None)
    send = getattr(server, "send_progress_text", None)
    if send is None:
        return False
    try:
        send(text, node_id)
    except Exception as exc:  # noqa: BLE001 - a preview must never break generation
        log.debug("progress text not sent: %s", exc)
        return False
    return True


def show_status(text: str, node_id: str | None = None) -> bool:
    """Show ``text`` under node ``node_id`` (default: the executing node) as progress text, where it can."""
    return _send_text(text, node_id or executing_node_id())


def show_warning(text: str) -> bool:
    """Show a warning under the executing node (live text), where this ComfyUI can."""
    return _send_text(f"Warning: {text}", executing_node_id())


@dataclass
class Progress:
    """Per-step callback for ``engine.generate``: progress bar, Cancel and live text preview.

    ``decode(token_ids) -> str`` renders the preview; ``preview_every_s`` throttles it.
    """

    total: int
    decode: Callable[[list[int]], str] | None = None
    node_id: str | None = None
    preview_every_s: float = 0.5
    _bar: Any = field(default=None, init=False, repr=False)
    _last_preview: float = field(default=0.0, init=False, repr=False)
    _done: int = field(default=0, init=False, repr=False)

    def __post_init__(self):
        import comfy.utils

        if self.node_id is None:
            self.node_id = executing_node_id()
        self._bar = comfy.utils.ProgressBar(self.total)

    def __call__(self, all_tokens, new_tokens, stats) -> None:
        import comfy.model_management

        self._done += len(new_tokens)
        self._bar.update_absolute(min(self._done, self.total), self.total)
        now = time.perf_counter()
        if self.decode is not None and now - self._last_preview >= self.preview_every_s:
            self._last_preview = now
            _send_text(self.decode(list(all_tokens)), self.node_id)
        comfy.model_management.throw_exception_if_processing_interrupted()

    def finish(self, token_ids: list[int], status: Sequence[str] = ()) -> None:
        """Final text under the node: the ``status`` lines (``stats_line.status_lines``: notes to act on,
        then tokens, tok/s and MTP acceptance) FIRST, where the node's short preview shows them, then a
        blank line and the whole generated text (not throttled)."""
        text = self.decode(list(token_ids)) if self.decode is not None else ""
        head = "\n".join(status)
        if head or text:
            _send_text(f"{head}\n\n{text}".rstrip() if head else text, self.node_id)


# ---------------------------------------------------------------------------------------------
# ComfyUI's weights for the engine


@contextlib.contextmanager
def comfy_weight_cast(module, h):
    """The engine's ``weight_cast`` hook: ``module``'s weight as ComfyUI's ops cast it for ``h``
    (its dtype and device; offloaded weights streamed in) when ComfyUI casts that module per call,
    else None. Released when the block ends (``BaseGenerate.logits`` does the same)."""
    if not getattr(module, "comfy_cast_weights", False):
        yield None
        return
    import comfy.ops

    res = comfy.ops.cast_bias_weight(module, h, offloadable=True)
    try:
        yield res[0]
    finally:
        if len(res) > 2 and hasattr(comfy.ops, "uncast_bias_weight"):
            comfy.ops.uncast_bias_weight(module, res[0], None, res[2])


# ---------------------------------------------------------------------------------------------
# Generation through the engine


class TokenList(list):
    """Generated token ids (what core ``generate`` returns) plus the engine's ``stats`` and ``notes``
    (status lines to act on, e.g. ``stats_line.suspect_head_note``'s)."""

    stats: Any = None
    stop_reason: str | None = None
    notes: tuple = ()



def stop_tokens_of(target: Qwen35Target) -> list[int]:
    """The model's stop tokens (its config's, else the released Qwen3.5 ones)."""
    return list(getattr(getattr(target.model, "config", None), "stop_tokens", None) or RELEASED_STOP_TOKENS)


def default_execution_dtype(device):
    """The dtype core ``BaseGenerate.generate`` computes in on ``device`` (bf16 where supported)."""
    import torch

    try:
        import comfy.model_management as mm

        if mm.should_use_bf16(device):
            return torch.bfloat16
    except (ImportError, AttributeError):
        pass
    return torch.float32


def run_engine(target: Qwen35Target, embeds, *, do_sample: bool, max_length: int, temperature: float,
               top_k: int, top_p: float, min_p: float, repetition_penalty: float, seed, presence_penalty: float,
               mtp="auto", attention: str = "auto", position_ids=None, stop_tokens=None, initial_tokens=(),
               min_tokens: int = 0, execution_dtype=None, decode=None, label: str = "Qwen3.5",
               mtp_draft="argmax", draft_vocab="auto", thinking_budget=None) -> TokenList:
    """Generate with the engine on ComfyUI's loaded Qwen3.5, with progress/Cancel/preview and a log line.

    Arguments follow core ``BaseGenerate.generate``; ``seed=None`` (core's greedy call) means 0.
    The model is first made resident where ComfyUI left it partly loaded and VRAM allows
    (``comfy_weights.make_resident``; a DynamicVRAM CLIP is made resident by ``patch_clip``), and
    its weights are read in place by the decode kernels where they can be
    (``comfy_weights.Resolver``). ``mtp_draft``, ``draft_vocab``: see ``engine.generate``
    (benchmarks); ``thinking_budget``: None or an ``engine.ThinkingBudget``. Returns the token ids as a
    ``TokenList`` carrying the engine stats.
    """
    check_max_length(max_length)
    if stop_tokens is None:
        stop_tokens = stop_tokens_of(target)
    if execution_dtype is None:
        execution_dtype = default_execution_dtype(embeds.device)
    comfy_weights.make_resident(target.patcher, target.streamed)
    progress = Progress(max_length, decode=decode)
    result = generate(
        target.transformer, embeds, do_sample=bool(do_sample), max_length=max_length,
        temperature=float(temperature), top_k=top_k, top_p=float(top_p), min_p=float(min_p),
        repetition_penalty=float(repetition_penalty), seed=0 if seed is None else seed,
        stop_tokens=list(stop_tokens), min_tokens=int(min_tokens), presence_penalty=float(presence_penalty or 0.0),
        initial_tokens=list(initial_tokens or ()), mtp=parse_mtp(mtp), position_ids=position_ids,
        attention=attention, execution_dtype=execution_dtype, callback=progress, weight_cast=comfy_weight_cast,
        weights=WEIGHTS, mtp_draft=mtp_draft, draft_vocab=draft_vocab, thinking_budget=thinking_budget)
    tokens = TokenList(result.tokens)
    tokens.stats = result.stats
    tokens.stop_reason = getattr(result, "stop_reason", None)
    note = suspect_head_note(clip_info(target), result.stats)
    if note is not None:
        tokens.notes = (note,)
        log.warning("%s: %s", label, note)
    move_note, moved = swap_patcher.status_report(target.patcher.model) if target.patcher is not None else (None, None)
    tokens.notes += (move_note,) if move_note else ()
    progress.finish(tokens, status_lines(result.stats, tokens.stop_reason, tokens.notes) + ([moved] if moved else []))
    log.info("%s", log_line(label, result.stats, tokens.stop_reason))
    return tokens
