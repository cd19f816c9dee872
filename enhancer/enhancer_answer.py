"""Qwen-Image 2.1 prompt-enhancer answers: thinking split, answer parsing, latent sizes.

Pure Python (no torch). The enhancer thinks first (``<think> ... </think>``), then answers with
prose and a JSON object ``{"rewritten_prompt": ..., "wh_ratio": ...[, "ratio_follow": ...]}``.
Model output is not always valid JSON, so ``parse_answer`` reads the last object with a lenient
parser (single quotes, trailing commas, raw newlines and stray quotes inside strings, a truncated
tail) and, failing that, salvages the prompt string after its key. It never evaluates code.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass

log = logging.getLogger(__name__)

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
_END_MARKERS = ("<|im_end|>", "<|endoftext|>")
PROMPT_KEYS = ("rewritten_prompt", "rewrited_prompt")

MIN_MEGAPIXELS = 0.01
MAX_MEGAPIXELS = 16.0
MAX_ASPECT = 8.0


@dataclass
class PEResult:
    """What the enhancer answered. ``parse_ok`` False means ``rewritten_prompt`` is the raw answer."""

    rewritten_prompt: str
    wh_ratio: str | None
    ratio_follow: str | bool | None
    parse_ok: bool
    raw: str


# --------------------------------------------------------------------------------------------
# Thinking
# --------------------------------------------------------------------------------------------

def split_thinking(text: str) -> tuple[str, str]:
    """Split generated text into ``(thinking, answer)``, both stripped.

    The prompt usually ends with ``<think>``, so the text starts inside the think block and the
    first ``</think>`` ends it. A leading ``<think>`` is dropped. Without ``</think>``: a text that
    opened with ``<think>`` is all (unfinished) thinking; a text with no tag at all is returned as
    the answer, so a JSON object at its end can still be found. Trailing ``<|im_end|>`` /
    ``<|endoftext|>`` markers are removed. Logs no warning for an unfinished block: the caller says
    why and what to do (``prompt_enhancer.finish_answer``: raise max_length).
    """
    if not isinstance(text, str):
        raise ValueError(f"split_thinking: text must be a str, got {type(text).__name__}")
    body = text.strip()
    changed = True
    while changed:
        changed = False
        for marker in _END_MARKERS:
            if body.endswith(marker):
                body = body[: -len(marker)].rstrip()
                changed = True
    opened = body.startswith(THINK_OPEN)
    if opened:
        body = body[len(THINK_OPEN):]
    head, sep, tail = body.partition(THINK_CLOSE)
    if sep:
        return head.strip(), tail.strip()
    if opened:
        log.debug("split_thinking: thinking never ended (no %s); the answer is empty", THINK_CLOSE)
        return body.strip(), ""
    return "", body.strip()


# --------------------------------------------------------------------------------------------
# Lenient JSON
# --------------------------------------------------------------------------------------------

class _Broken(Exception):
    """The text at this position is not an object, even leniently."""


_NUMBER = re.compile(r"-?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")
_WORDS = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f", "/": "/", "\\": "\\", '"': '"', "'": "'"}
_MAX_DEPTH = 32
_SCAN_BUDGET = 2  # failed object candidates may scan this many times the answer's length in total
# What may follow a closing quote: the end, "}", "]" or ":"; or a comma and then the end, a
# bracket, a number, or a (quoted or bare) key and its colon; or a quoted key and its colon
# with the comma missing. Anything else means the quote was an unescaped one inside the text.
_KEY = r"""(?:["'][^"'\n]{1,64}["']|[A-Za-z_][\w-]{0,63})\s*:"""
_AFTER_CLOSE = re.compile(
    r"""\s*(?:\Z|[}\]:]|,\s*(?:\Z|[{}\[\]\d-]|""" + _KEY + r"""|["'][^"'\n]{0,64}["']?\s*\Z)"""
    r"""|["'][^"'\n]{1,64}["']\s*:)""")


class _LenientReader:
    """Recursive-descent reader of JSON-like text; ``truncated`` is set when the text ran out."""

    def __init__(self, text: str, pos: int = 0):
        self.text = text
        self.pos = pos
        self.truncated = False

    def _ws(self) -> str | None:
        n = len(self.text)
        while self.pos < n and self.text[self.pos].isspace():
            self.pos += 1
        return self.text[self.pos] if self.pos < n else None

    def value(self, depth: int = 0):
        if depth > _MAX_DEPTH:
            raise _Broken("nested too deep")
        c = self._ws()
        if c is None:
            self.truncated = True
            return None
        if c == "{":
            return self.obj(depth)
        if c == "[":
            return self.arr(depth)
        if c in "\"'":
            return self.string()
        m = _NUMBER.match(self.text, self.pos)
        if m:
            self.pos = m.end()
            s = m.group()
            return float(s) if any(ch in s for ch in ".eE") else int(s)
        m = _WORD.match(self.text, self.pos)
        if m and m.group() in _WORDS:
            self.pos = m.end()
            return _WORDS[m.group()]
        raise _Broken(f"unexpected {c!r}")

    def _at_end(self, close: str) -> bool:
        """Skip whitespace and commas (separators, trailing or doubled); True when the container
        ends here: at ``close`` (consumed) or where the text runs out (marked truncated)."""
        while True:
            c = self._ws()
            if c is None:
                self.truncated = True
                return True
            if c == close:
                self.pos += 1
                return True
            if c != ",":
                return False
            self.pos += 1

    def obj(self, depth: int) -> dict:
        self.pos += 1  # "{"
        out: dict = {}
        while not self._at_end("}"):
            c = self.text[self.pos]
            if c in "\"'":
                key = self.string()
            else:
                m = _WORD.match(self.text, self.pos)
                if not m:
                    raise _Broken(f"expected a key, got {c!r}")
                key = m.group()
                self.pos = m.end()
            if self.truncated:
                return out
            c = self._ws()
            if c is None:
                self.truncated = True
                return out
            if c != ":":
                raise _Broken(f"expected ':' after key {key!r}")
            self.pos += 1
            out[key] = self.value(depth + 1)
            if self.truncated:
                return out
        return out

    def arr(self, depth: int) -> list:
        self.pos += 1  # "["
        out: list = []
        while not self._at_end("]"):
            out.append(self.value(depth + 1))
            if self.truncated:
                return out
        return out

    def string(self) -> str:
        quote = self.text[self.pos]
        self.pos += 1
        text, n = self.text, len(self.text)
        chars: list[str] = []
        while self.pos < n:
            c = text[self.pos]
            if c == "\\" and self.pos + 1 < n:
                e = text[self.pos + 1]
                if e == "u" and re.fullmatch(r"[0-9a-fA-F]{4}", text[self.pos + 2: self.pos + 6]):
                    chars.append(chr(int(text[self.pos + 2: self.pos + 6], 16)))
                    self.pos += 6
                    continue
                chars.append(_ESCAPES.get(e, e))
                self.pos += 2
                continue
            if c == quote and self._closes(self.pos + 1):
                self.pos += 1
                return _join_surrogates("".join(chars))
            chars.append(c)
            self.pos += 1
        self.truncated = True
        return _join_surrogates("".join(chars))

    def _closes(self, pos: int) -> bool:
        """A quote ends its string only if what follows fits JSON; else it is a stray inner quote."""
        return _AFTER_CLOSE.match(self.text, pos) is not None


def _join_surrogates(s: str) -> str:
    """Combine ``\\ud83d\\ude00``-style surrogate pairs into one character."""
    if not any("\ud800" <= ch <= "\udfff" for ch in s):
        return s
    return s.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _objects(text: str) -> list[tuple[dict, bool]]:
    """Every top-level object in ``text`` in order, as ``(dict, complete)``, in time linear in ``len(text)``.

    Each candidate ``{`` is read by the lenient reader (nesting bounded by ``_MAX_DEPTH``, so no
    recursion limit is reached); an object it reads whole is then decoded strictly from exactly its
    own span, and the strict result is kept when that succeeds. Failed candidates may scan at most
    ``_SCAN_BUDGET`` times the text in total; past that, the objects found so far are returned.
    """
    found = []
    decoder = json.JSONDecoder()
    budget = _SCAN_BUDGET * len(text) + 4096
    pos = text.find("{")
    while pos != -1:
        reader = _LenientReader(text, pos)
        try:
            obj = reader.value()
        except _Broken:
            budget -= reader.pos - pos + 1
            if budget < 0:
                log.warning("parse_answer: the answer is too irregular to scan completely; reading what was found")
                break
            pos = text.find("{", pos + 1)
            continue
        if not reader.truncated:
            try:
                strict, _ = decoder.raw_decode(text[pos:reader.pos])
                if isinstance(strict, dict):
                    obj = strict
            except (ValueError, RecursionError):
                pass
        found.append((obj, not reader.truncated))
        pos = text.find("{", reader.pos) if not reader.truncated else -1
    return found


def _find_key(obj, keys: tuple[str, ...], depth: int = 0):
    """Value of the first of ``keys`` in ``obj`` or in a nested dict (case-insensitive keys)."""
    if not isinstance(obj, dict) or depth > 3:
        return None
    lowered = {str(k).strip().lower(): v for k, v in obj.items()}
    for key in keys:
        if key in lowered:
            return lowered[key]
    for v in obj.values():
        hit = _find_key(v, keys, depth + 1)
        if hit is not None:
            return hit
    return None


_SALVAGE = re.compile(r"""["']?\b(?:rewritten|rewrited)_prompt\b["']?\s*[:=]\s*(["'])""", re.IGNORECASE)
_RATIO_SALVAGE = re.compile(r"""["']?\bwh_ratio\b["']?\s*[:=]\s*["']?([^"',}\n]+)""", re.IGNORECASE)


def _salvage(answer: str) -> tuple[str | None, str | None]:
    """Regex fallback: the prompt string after the last prompt key, and a wh_ratio if present."""
    matches = list(_SALVAGE.finditer(answer))
    if not matches:
        return None, None
    reader = _LenientReader(answer, matches[-1].start(1))
    prompt = reader.string()
    ratios = list(_RATIO_SALVAGE.finditer(answer))
    return prompt, (ratios[-1].group(1).strip() if ratios else None)


def _as_text(v) -> str | None:
    if v is None or isinstance(v, str):
        return v.strip() if isinstance(v, str) else None
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (int, float)):
        return str(v)
    return json.dumps(v, ensure_ascii=False)


def parse_answer(answer: str) -> PEResult:
    """Read the enhancer's answer (text after ``</think>``) into a ``PEResult``.

    Uses the last JSON object that carries ``rewritten_prompt`` (or the misspelled
    ``rewrited_prompt``), fenced or not, valid or leniently repaired, even if truncated; then a
    regex salvage of the prompt string; else the stripped answer with ``parse_ok=False`` (a warning,
    except for an empty answer, which its caller explains).
    """
    if not isinstance(answer, str):
        raise ValueError(f"parse_answer: answer must be a str, got {type(answer).__name__}")
    for obj, complete in reversed(_objects(answer)):
        prompt = _find_key(obj, PROMPT_KEYS)
        if not isinstance(prompt, str) or not prompt.strip():
            continue
        if not complete:
            log.warning("parse_answer: the answer's JSON is truncated; using the prompt text recovered so far")
        follow = _find_key(obj, ("ratio_follow",))
        return PEResult(
            rewritten_prompt=prompt.strip(),
            wh_ratio=_as_text(_find_key(obj, ("wh_ratio",))),
            ratio_follow=follow if isinstance(follow, bool) else _as_text(follow),
            parse_ok=True,
            raw=answer,
        )
    prompt, ratio = _salvage(answer)
    if prompt and prompt.strip():
        log.warning("parse_answer: no readable JSON object; salvaged the prompt string after its key")
        return PEResult(prompt.strip(), ratio, None, True, answer)
    if answer.strip():  # an empty answer is the caller's to explain (its cause: the budget ran out)
        log.warning("parse_answer: no rewritten prompt found in the answer; using the raw answer")
    return PEResult(answer.strip(), None, None, False, answer)


# --------------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------------

_PAIR = re.compile(r"(\d+(?:\.\d+)?)\s*(?:[:/xX×*：／比]|\bby\b)\s*(\d+(?:\.\d+)?)")
_SINGLE = re.compile(r"\d+(?:\.\d+)?|\.\d+")


def parse_ratio(wh_ratio: str | float | None) -> float | None:
    """Width / height from ``"16:9"``, ``"16/9"``, ``"16x9"``, ``"1.78"``, ``1.78``; None if unreadable."""
    if wh_ratio is None or isinstance(wh_ratio, bool):
        return None
    if isinstance(wh_ratio, (int, float)):
        r = float(wh_ratio)
    elif isinstance(wh_ratio, str):
        m = _PAIR.search(wh_ratio)
        if m:
            num, den = float(m.group(1)), float(m.group(2))
            r = num / den if den > 0 else math.nan
        else:
            m = _SINGLE.search(wh_ratio)
            r = float(m.group()) if m else math.nan
    else:
        return None
    return r if math.isfinite(r) and r > 0 else None


def check_megapixels(megapixels) -> None:
    """ValueError naming the fix unless ``megapixels`` is a finite number in [MIN_MEGAPIXELS, MAX_MEGAPIXELS]
    (checked before a generation, since the size is computed after it)."""
    if (isinstance(megapixels, bool) or not isinstance(megapixels, (int, float)) or not math.isfinite(megapixels)
            or not MIN_MEGAPIXELS <= megapixels <= MAX_MEGAPIXELS):
        raise ValueError(f"megapixels must be a number in [{MIN_MEGAPIXELS}, {MAX_MEGAPIXELS}] (e.g. 1.0 for about "
                         f"1024x1024), got {megapixels!r}: set the enhancer's megapixels input to such a number.")


def size_for_ratio(wh_ratio: str | float | None, megapixels: float, multiple: int = 16) -> tuple[int, int]:
    """``(width, height)`` in pixels: aspect ``wh_ratio``, area about ``megapixels * 1e6``.

    Each side is the ideal one rounded to the nearest multiple of ``multiple`` (halves round up,
    at least one multiple). A missing or unreadable ratio gives 1:1; ratios beyond 1:8 or 8:1 are
    clamped. ``megapixels`` must lie in [0.01, 16].
    """
    if isinstance(multiple, bool) or not isinstance(multiple, int) or not 1 <= multiple <= 512:
        raise ValueError(f"size_for_ratio: multiple must be an integer in [1, 512] (16 suits Qwen-Image), "
                         f"got {multiple!r}")
    check_megapixels(megapixels)
    r = parse_ratio(wh_ratio)
    if r is None:
        if wh_ratio is not None:
            log.warning("size_for_ratio: cannot read aspect ratio %r; using 1:1", wh_ratio)
        r = 1.0
    if not 1 / MAX_ASPECT <= r <= MAX_ASPECT:
        log.warning("size_for_ratio: aspect ratio %r is extreme; clamped to %g:1 at most", wh_ratio, MAX_ASPECT)
        r = min(max(r, 1 / MAX_ASPECT), MAX_ASPECT)
    area = megapixels * 1e6
    width = max(multiple, math.floor(math.sqrt(area * r) / multiple + 0.5) * multiple)
    height = max(multiple, math.floor(math.sqrt(area / r) / multiple + 0.5) * multiple)
    return int(width), int(height)
