"""The server enhancer's words to the user, per prompt: the generated text as the local path decodes it,
and the status lines, the one to act on first (a failure, a run cut at max_length, images the server
dropped, an empty answer), then the summary (server, model, tokens, speed), then notes (fields the server
does not honour, what ``api`` "auto" found). Every text from the server is redacted before it is shown."""

from __future__ import annotations

from .server_api import ServerSpec
from .server_backend import StreamResult
from .server_keys import Secret, redact

OFFICIAL_LENGTHS = "official: 16256 text-to-image, 24000 edit"
TOKEN_PX = 32         # Qwen3.5's vision tower: 16-pixel patches merged 2 x 2, one token per 32 x 32 pixels
MIN_IMAGE_TOKENS = 64  # its processor's smallest image (256 x 256 pixels)
CHARS_PER_TOKEN_MAX = 8  # the text's tokens are at least its characters / 8 (Qwen's tokenizer: about 4)


def answer_text(result: StreamResult) -> str:
    """The generated text as the local path decodes it: inside the thinking block first (the prompt opened
    it), ``</think>`` where the server split the reasoning off, then the answer. Content alone that never
    closes a thinking block is the answer when the server finished it ("stop"): its thinking was not sent."""
    content = result.content
    if not result.reasoning:
        if "</think>" in content or result.finish_reason != "stop":
            return content
        return "\n</think>\n\n" + content
    closed = bool(content) or result.finish_reason == "stop"
    return result.reasoning + ("\n</think>\n\n" + content if closed else "")


def image_tokens(image_list: list) -> int:
    """About how many prompt tokens the images take on a Qwen3.5 vision server."""
    total = 0
    for img in image_list:
        h, w = int(img.shape[1]), int(img.shape[2])
        total += max(MIN_IMAGE_TOKENS, round(w / TOKEN_PX) * round(h / TOKEN_PX))
    return total


def images_dropped(result: StreamResult, image_list: list, text_chars: int) -> str | None:
    """A status line when the server's prompt token count is too small to hold the images, else None."""
    if not image_list or result.prompt_tokens is None:
        return None
    expected = image_tokens(image_list)
    if result.prompt_tokens >= text_chars // CHARS_PER_TOKEN_MAX + expected // 2:
        return None
    n = len(image_list)
    return (f"The server dropped the image{'s' if n > 1 else ''}: it counted {result.prompt_tokens} prompt tokens, "
            f"fewer than the {n} image{'s' if n > 1 else ''} alone take (about {expected}). Serve the edit "
            "enhancer (Qwen/Qwen-Image-2.1-PE-I2I) on a server that takes images; the answer ignored them.")


def status_lines(spec: ServerSpec, result: StreamResult, *, max_length: int, ignored: list, fallback: bool,
                 dropped: str | None, how: str | None, secret: Secret | None) -> list[str]:
    """The status of one finished prompt: lines to act on, the summary, notes."""
    act = []
    if result.cut:
        act.append(f"Cut at max_length {max_length}: the server sent more, so the stream was closed there. Raise "
                   f"max_length ({OFFICIAL_LENGTHS}) for the whole answer.")
    elif result.finish_reason == "length":
        act.append(f"Stopped at max_length {max_length} (finish 'length'): raise max_length ({OFFICIAL_LENGTHS}) "
                   "for the whole answer.")
    if dropped:
        act.append(dropped)
    if fallback and not act:
        act.append("The server's answer had no rewritten prompt: your own prompt was used (parse_ok False).")
    elif fallback:
        act[0] += " Your own prompt was used (parse_ok False)."
    first = "" if result.first_token_s is None else f", first token after {result.first_token_s:.2f} s"
    prompt = "" if result.prompt_tokens is None else f", prompt {result.prompt_tokens} tokens"
    summary = (f"{spec.api} server {spec.base_url}, model {redact(result.model or spec.model, secret)[:120]}: "
               f"{result.tokens} tokens in {result.seconds:.2f} s, {result.tok_per_s:.1f} tok/s{first}{prompt}, "
               f"finish {redact(str(result.finish_reason or result.cut or 'none'), secret)[:40]}")
    notes = []
    if ignored:
        notes.append(f"Not honoured by {spec.api}: {', '.join(ignored)} (the server's own values apply).")
    if how:
        notes.append(f"api auto: {spec.api} ({how}).")
    return [*act, summary, *notes]


def failed_lines(index: int, count: int, error: BaseException) -> list[str]:
    """The status of a prompt of a list that failed (its outputs: the user's prompt, parse_ok False)."""
    return [f"Prompt {index + 1} of {count} failed, nothing generated for it: {error}",
            "Its outputs: your own prompt, no thinking, width/height for 1:1, parse_ok False."]
