"""What the server enhancer sends and how it words a refusal: the server kinds (``api``) and the fields each
honours, the node's server settings (:class:`ServerSpec`, checked before any request), the chat-completions
request body, and the message for an HTTP error, which names the fix. ComfyUI-free, holds no secret.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from .server_keys import PAIRING_FILE, Secret, parse_url, redact

#: Which servers the request is shaped for -> the sampling fields it honours (every API also takes
#: ``max_tokens``, ``seed`` and streaming). ``thinking``: how thinking is switched (None: it cannot be).
APIS: dict[str, dict] = {
    "vllm": {"fields": ("temperature", "top_p", "top_k", "min_p", "presence_penalty"), "thinking": "template"},
    "sglang": {"fields": ("temperature", "top_p", "top_k", "min_p", "presence_penalty"), "thinking": "template"},
    "llama.cpp": {"fields": ("temperature", "top_p", "top_k", "min_p", "presence_penalty"), "thinking": "template"},
    "ollama": {"fields": ("temperature", "top_p", "presence_penalty"), "thinking": "reasoning_effort"},
    "transformers": {"fields": ("temperature", "top_p", "top_k", "min_p"), "thinking": "template"},
    "openai": {"fields": ("temperature", "top_p", "presence_penalty"), "thinking": None},
}
#: ``api`` "auto": ask the server what it is (``server_probe.detect``), once per address.
AUTO = "auto"
API_NAMES = (AUTO, *APIS)
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty")
#: Seeds sent as they are: 0 .. 2**31 - 1, the range every supported server takes (llama.cpp's seed is
#: 32-bit with 0xFFFFFFFF meaning "random"; others take 64-bit or Python ints).
SEED_MAX = 2**31 - 1
_TEXT_CUT = 400
_UNKNOWN_FIELDS = re.compile(r"unexpected field|unknown field|extra field|extra_forbidden|not permitted|"
                             r"unrecognized|unrecognised|unsupported (?:field|param)|additional properties",
                             re.IGNORECASE)


class ServerError(RuntimeError):
    """A request the server refused or could not complete; the message names the fix."""


class StreamCancelled(RuntimeError):
    """The stream was closed because the user pressed Cancel."""


@dataclass(frozen=True)
class ServerSpec:
    """Where the enhancer runs: ``base_url`` (``http://host:port/v1``), the served ``model`` name, the NAME of
    the environment variable holding the API key (empty: no key), the ``api`` the request is shaped for
    (:data:`API_NAMES`), at most ``max_concurrent`` requests at once, ``timeout_s`` seconds for the connection
    and for each read, ``deadline_s`` seconds for a whole request. Holds no secret."""

    base_url: str
    model: str
    api_key_env: str = ""
    api: str = AUTO
    max_concurrent: int = 4
    timeout_s: float = 300.0
    deadline_s: float = 3600.0

    def check(self) -> None:
        """ValueError naming the fix for settings no request could use (checked before any request)."""
        parse_url(self.base_url)
        if not isinstance(self.model, str) or not self.model.strip():
            raise ValueError("model is empty: write the name the server serves (its GET /v1/models lists them).")
        if self.api not in API_NAMES:
            raise ValueError(f"unknown api {self.api!r}; choose one of {', '.join(API_NAMES)}.")
        if isinstance(self.max_concurrent, bool) or not isinstance(self.max_concurrent, int) \
                or not 1 <= self.max_concurrent <= 64:
            raise ValueError(f"max_concurrent must be 1..64, got {self.max_concurrent!r}.")
        for name in ("timeout_s", "deadline_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name} must be a number of seconds above 0, got {v!r}.")

    @property
    def endpoint(self) -> str:
        """``base_url`` without a trailing ``/``, with ``/v1`` added when the URL has no path."""
        base = self.base_url.strip().rstrip("/")
        return base if parse_url(base).path else base + "/v1"


def request_body(spec: ServerSpec, messages: list, sampling: dict, max_tokens: int, seed: int,
                 thinking: bool) -> tuple[dict, list[str]]:
    """(the chat-completions JSON body for ``spec.api``, a resolved kind, not ``auto``; the sampling fields
    that API does not honour and whose value is not neutral). ``sampling``: :data:`SAMPLING_FIELDS`, checked
    by the caller; ``seed`` in 0..:data:`SEED_MAX`, sent as it is. ValueError where thinking cannot be
    switched off on that API."""
    api = APIS[spec.api]
    if not 0 <= int(seed) <= SEED_MAX:
        raise ValueError(f"seed must be 0..{SEED_MAX}, got {seed!r}.")
    body: dict = {"model": spec.model, "messages": messages, "stream": True, "max_tokens": int(max_tokens),
                  "seed": int(seed)}
    sent = api["fields"]
    if spec.api == "transformers":
        # transformers serve rejects unknown top-level fields and samples only with do_sample: its own
        # generation_config field carries top_k / min_p (unset values come from the model's config).
        gen = {k: sampling[k] for k in sent}
        body["generation_config"] = json.dumps({"do_sample": True, "max_new_tokens": int(max_tokens), **gen})
        body.update(temperature=sampling["temperature"], top_p=sampling["top_p"])
    else:
        body.update({k: sampling[k] for k in sent})
        body["stream_options"] = {"include_usage": True}
    if api["thinking"] == "template":
        body["chat_template_kwargs"] = {"enable_thinking": bool(thinking)}
    elif api["thinking"] == "reasoning_effort":
        if not thinking:
            body["reasoning_effort"] = "none"
    elif not thinking:
        raise ValueError(f"api '{spec.api}' has no standard field to turn thinking off: set api to the server's "
                         f"kind ({', '.join(a for a in APIS if APIS[a]['thinking'])}) or keep thinking on.")
    ignored = [k for k in SAMPLING_FIELDS if k not in sent and _matters(k, sampling[k])]
    return body, ignored


def _matters(name: str, value) -> bool:
    neutral = {"top_k": 0, "min_p": 0.0, "presence_penalty": 0.0, "top_p": 1.0}
    return name not in neutral or float(value) != float(neutral[name])


def message_of(body) -> str:
    """The human part of an error body (OpenAI ``{"error": {"message"}}``, FastAPI ``{"detail"}``, ...),
    uncut: the caller redacts, then cuts (:func:`shown`)."""
    if isinstance(body, dict):
        for key in ("error", "detail", "message", "msg"):
            if key in body:
                return message_of(body[key])
        return json.dumps(body)
    if isinstance(body, list):
        return "; ".join(message_of(b) for b in body)
    return str(body)


def shown(text: str, secret: Secret | None, limit: int = _TEXT_CUT) -> str:
    """Server text as shown to the user: redacted first, then cut to ``limit`` characters."""
    text = redact(text, secret)
    return text if len(text) <= limit else text[:limit] + "..."


def http_error(spec: ServerSpec, status: int, raw: bytes, secret: Secret | None, sent: dict) -> str:
    """The message for a refused request (HTTP ``status``, body ``raw``; ``sent``: the request body), naming
    the fix; the server's words redacted before they are cut."""
    decoded = raw.decode("utf-8", errors="replace")
    try:
        text = message_of(json.loads(decoded))
    except ValueError:
        text = decoded.strip() or "(no body)"
    text = shown(text, secret).rstrip(". ")
    where = f"The enhancer server at {spec.base_url}"
    low = text.lower()
    if status in (401, 403):
        fix = (f"set the environment variable {spec.api_key_env} to a key this server accepts, then restart "
               "ComfyUI" if spec.api_key_env else
               f"this server needs an API key: put it in an environment variable, name it in api_key_env and "
               f"pair the two in {PAIRING_FILE} in ComfyUI's user directory")
        return f"{where} refused the request (HTTP {status}: {text}): {fix}."
    if status in (400, 422) and _UNKNOWN_FIELDS.search(text):
        fields = [k for k in _field_names(sent) if re.search(rf"\b{re.escape(k)}\b", text)]
        named = ", ".join(fields) if fields else "fields of the request"
        return (f"{where} refused {named} (HTTP {status}: {text}). The api input ('{spec.api}') decides which "
                f"fields are sent: set api to auto (asks the server what it is) or to this server's kind "
                f"({', '.join(APIS)}).")
    if status == 404 or (status in (400, 422) and spec.model.lower() in low):  # a message naming the model
        return f"{where} does not serve model {spec.model!r} (HTTP {status}: {text})."
    if status in (400, 413, 422) and any(w in low for w in ("context", "too long", "maximum", "max_model_len")):
        return (f"{where} refused the prompt as too long (HTTP {status}: {text}): lower max_length, or start the "
                "server with a longer context (vLLM --max-model-len, SGLang --context-length, llama-server -c, "
                "Ollama num_ctx).")
    if status in (400, 422) and any(w in low for w in ("image", "multimodal", "vision")):
        return (f"{where} cannot take images with model {spec.model!r} (HTTP {status}: {text}): serve the edit "
                "enhancer (Qwen/Qwen-Image-2.1-PE-I2I, the _i2i file) for edit mode, or disconnect the images.")
    return f"{where} answered HTTP {status}: {text}. Check base_url, model, api and the server's log."


def _field_names(sent: dict) -> list[str]:
    names = list(sent)
    try:
        names += list(json.loads(sent.get("generation_config") or "{}"))
    except ValueError:
        pass
    return names
