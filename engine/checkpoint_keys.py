"""Checkpoint key layouts: map HF and ComfyUI tensor names onto one canonical text-model naming.

Canonical names are relative to the text decoder: ``embed_tokens.weight``, ``layers.N.<...>``,
``norm.weight``, ``lm_head.weight`` (untied sizes only) and ``mtp.<...>`` for the MTP head.

* HF layout (the released checkpoints): ``model.language_model.<name>``, ``lm_head.weight``,
  ``mtp.<name>``, ``model.visual.*`` (ignored).
* ComfyUI layout (what ``comfy.sd.load_clip`` keeps in memory): ``model.<name>``,
  ``model.lm_head.weight``, ``visual.*`` (ignored), ``mtp.<name>`` or ``model.mtp.<name>``.
* Bare canonical names are accepted as they are.
"""

from __future__ import annotations

from collections.abc import Iterable

from .errors import Qwen35Error

HF_PREFIX = "model.language_model."
_IGNORED = ("model.visual.", "visual.")


def canonical_key(key: str) -> str | None:
    """Canonical name of checkpoint key ``key``; None for vision tensors (not used by the text engine)."""
    if key.startswith(HF_PREFIX):
        return key[len(HF_PREFIX):]
    if key.startswith(_IGNORED):
        return None
    if key in ("lm_head.weight", "model.lm_head.weight"):
        return "lm_head.weight"
    if key.startswith("model.mtp."):
        return key[len("model."):]
    if key.startswith("model."):
        return key[len("model."):]
    return key


def canonical_map(keys: Iterable[str]) -> dict[str, str]:
    """``{canonical: original}`` for every key that the text engine reads (vision keys dropped).

    Raises Qwen35Error when two keys land on the same canonical name (a file mixing layouts).
    """
    out: dict[str, str] = {}
    for key in keys:
        canon = canonical_key(key)
        if canon is None:
            continue
        if canon in out:
            raise Qwen35Error(f"tensors {out[canon]!r} and {key!r} are the same weight in two layouts; "
                              "keep one layout per file (HF 'model.language_model.*' or ComfyUI 'model.*')")
        out[canon] = key
    return out


def layout_name(keys: Iterable[str]) -> str:
    """"hf" when any key uses the HF prefix, "comfyui" when keys start with ``model.``, else "bare"."""
    keys = list(keys)
    if any(k.startswith(HF_PREFIX) for k in keys):
        return "hf"
    if any(k.startswith("model.") for k in keys):
        return "comfyui"
    return "bare"
