"""Minimal prompt-enhancer answer helpers, used only when ``engine.pe`` is not available.

Same contract as ``engine.pe``: ``split_thinking(text) -> (thinking, answer)``,
``parse_answer(answer) -> PEResult``, ``size_for_ratio(wh_ratio, megapixels, multiple=16) -> (w, h)``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

_RATIO = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*[:x/]\s*(\d+(?:\.\d+)?)\s*$")


@dataclass
class PEResult:
    rewritten_prompt: str
    wh_ratio: str | None
    ratio_follow: object
    parse_ok: bool
    raw: str


def split_thinking(text: str) -> tuple[str, str]:
    """Split at the last ``</think>``; the opening ``<think>`` is optional."""
    head, sep, tail = text.rpartition("</think>")
    if not sep:
        return "", text.strip()
    return head.replace("<think>", "", 1).strip(), tail.strip()


def parse_answer(answer: str) -> PEResult:
    """The last JSON object in ``answer`` with ``rewritten_prompt`` (or ``rewrited_prompt``)."""
    decoder = json.JSONDecoder()
    found = None
    for start in (m.start() for m in re.finditer(r"\{", answer)):
        try:
            obj, _ = decoder.raw_decode(answer[start:])
        except ValueError:
            continue
        if isinstance(obj, dict) and ("rewritten_prompt" in obj or "rewrited_prompt" in obj):
            found = obj
    if found is None:
        return PEResult(answer.strip(), None, None, False, answer)
    prompt = found.get("rewritten_prompt", found.get("rewrited_prompt"))
    ratio = found.get("wh_ratio")
    return PEResult(str(prompt).strip(), None if ratio is None else str(ratio), found.get("ratio_follow"),
                    bool(str(prompt).strip()), answer)


def size_for_ratio(wh_ratio, megapixels: float, multiple: int = 16) -> tuple[int, int]:
    """Width/height near ``megapixels`` (millions of pixels) with aspect ``wh_ratio`` ("16:9"), multiples of 16."""
    ratio = 1.0
    m = _RATIO.match(str(wh_ratio or ""))
    if m and float(m.group(2)) > 0:
        ratio = float(m.group(1)) / float(m.group(2))
    area = max(megapixels, 0.01) * 1e6
    w = math.sqrt(area * ratio)
    h = w / ratio
    return (max(multiple, int(round(w / multiple)) * multiple), max(multiple, int(round(h / multiple)) * multiple))
