"""The enhancer's OpenAI-compatible server backend: one streamed ``/v1/chat/completions`` request per prompt
over ``http.client`` (standard library only), its SSE deltas, and errors that name the fix. ComfyUI-free.

The API key is read from the environment variable the user names, at request time, and only ever put
in the ``Authorization`` header: never stored on a spec, logged, or shown (server messages that echo it
are redacted). One attempt per request: nothing here retries.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import re
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field

from . import sse

log = logging.getLogger(__name__)

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
API_NAMES = tuple(APIS)
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class ServerError(RuntimeError):
    """A request the server refused or could not complete; the message names the fix."""


class StreamCancelled(RuntimeError):
    """The stream was closed by :meth:`ChatStream.abort` (the user pressed Cancel)."""


@dataclass(frozen=True)
class ServerSpec:
    """Where the enhancer runs: ``base_url`` (``http://host:port/v1``), the served ``model`` name, the
    name of the environment variable holding the API key (empty: no key), the ``api`` the request is
    shaped for (a key of :data:`APIS`), at most ``max_concurrent`` requests at once and ``timeout_s``
    seconds for the connection and for each chunk. Holds no secret."""

    base_url: str
    model: str
    api_key_env: str = ""
    api: str = "vllm"
    max_concurrent: int = 4
    timeout_s: float = 300.0

    def check(self) -> None:
        """ValueError naming the fix for a spec no request could use (checked before any request)."""
        url = urllib.parse.urlsplit(self.base_url or "")
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"base_url {self.base_url!r} is not an http(s) URL: write the server's OpenAI-"
                             "compatible address, e.g. http://127.0.0.1:8000/v1 (vLLM), :30000/v1 (SGLang), "
                             ":8080/v1 (llama-server), :11434/v1 (Ollama).")
        if not (self.model or "").strip():
            raise ValueError("model is empty: write the name the server serves (its GET /v1/models lists them).")
        if self.api not in APIS:
            raise ValueError(f"unknown api {self.api!r}; choose one of {', '.join(API_NAMES)}.")
        if not isinstance(self.max_concurrent, int) or not 1 <= self.max_concurrent <= 64:
            raise ValueError(f"max_concurrent must be 1..64, got {self.max_concurrent!r}.")
        if not self.timeout_s or self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be above 0, got {self.timeout_s!r}.")
        self.api_key()

    def api_key(self) -> str | None:
        """The key from the environment variable ``api_key_env`` (None when no variable is named)."""
        name = (self.api_key_env or "").strip()
        if not name:
            return None
        if not _ENV_NAME.match(name):
            raise ValueError(f"api_key_env must be the NAME of an environment variable (letters, digits, _), "
                             f"not the key itself; got a value of {len(name)} characters.")
        value = os.environ.get(name, "")
        if not value:
            raise ValueError(f"The environment variable {name} (api_key_env) is not set in ComfyUI's environment: "
                             f"set {name} to the server's API key before starting ComfyUI, or clear api_key_env "
                             "for a server without a key.")
        return value

    @property
    def endpoint(self) -> str:
        """``base_url`` with ``/v1`` (added when the URL has no path)."""
        base = self.base_url.rstrip("/")
        return base if urllib.parse.urlsplit(base).path else base + "/v1"


def request_body(spec: ServerSpec, messages: list, sampling: dict, max_tokens: int, seed: int,
                 thinking: bool) -> tuple[dict, list[str]]:
    """(the chat-completions JSON body for ``spec.api``, the sampling fields that API does not honour).

    ``sampling``: the enhancer's settings (:data:`SAMPLING_FIELDS`). ValueError where thinking cannot be
    switched off on that API.
    """
    api = APIS[spec.api]
    body: dict = {"model": spec.model, "messages": messages, "stream": True, "max_tokens": int(max_tokens),
                  "seed": int(seed) % (2 ** 31)}
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
        raise ValueError(f"api '{spec.api}' has no standard field to turn thinking off: choose the server's own "
                         f"api ({', '.join(a for a in API_NAMES if APIS[a]['thinking'])}) or keep thinking on.")
    ignored = [k for k in SAMPLING_FIELDS if k not in sent and _matters(k, sampling[k])]
    return body, ignored


def _matters(name: str, value) -> bool:
    neutral = {"top_k": 0, "min_p": 0.0, "presence_penalty": 0.0, "top_p": 1.0}
    return name not in neutral or float(value) != float(neutral[name])


@dataclass
class StreamResult:
    """What one streamed completion delivered (``tokens``: the server's usage count, else the chunks)."""

    content: str = ""
    reasoning: str = ""
    model: str = ""
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    tokens: int = 0
    seconds: float = 0.0
    first_token_s: float | None = None
    chunks: int = field(default=0, repr=False)

    @property
    def tok_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class ChatStream:
    """One streamed chat completion. :meth:`run` blocks until the answer is complete; :meth:`abort`, from
    any thread, closes the connection so that :meth:`run` raises :class:`StreamCancelled` at once."""

    def __init__(self, spec: ServerSpec, body: dict):
        self.spec, self.body = spec, body
        self._conn: http.client.HTTPConnection | None = None
        self._aborted = threading.Event()
        self._lock = threading.Lock()
        self._started = False  # the server accepted the request and its stream began

    def abort(self) -> None:
        self._aborted.set()
        with self._lock:
            sock = getattr(self._conn, "sock", None)
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def run(self, on_delta: Callable[[str, str], None] | None = None) -> StreamResult:
        """Send the request and read the stream; ``on_delta(kind, text)`` per delta (``"content"`` or
        ``"reasoning"``). Raises :class:`ServerError` naming the fix, or :class:`StreamCancelled`."""
        key = self.spec.api_key()
        try:
            return self._run(key, on_delta)
        except StreamCancelled:
            raise
        except ServerError as exc:
            raise ServerError(_redact(str(exc), key)) from None
        except (TimeoutError, socket.timeout):
            if self._aborted.is_set():
                raise StreamCancelled("cancelled") from None
            raise ServerError(f"The enhancer server at {self.spec.base_url} sent nothing for {self.spec.timeout_s:g} s"
                              " (timeout_s): it may be busy or still loading the model. Check the server's log, "
                              "then raise timeout_s or run again.") from None
        except (OSError, http.client.HTTPException) as exc:
            if self._aborted.is_set():
                raise StreamCancelled("cancelled") from None
            raise ServerError(_redact(self._connection_message(exc), key)) from None
        finally:
            with self._lock:
                if self._conn is not None:
                    self._conn.close()

    def _connection_message(self, exc: BaseException) -> str:
        if self._started:
            return (f"The connection to the enhancer server at {self.spec.base_url} broke mid-answer ({exc}): "
                    "the server stopped or dropped it. Check the server's log and run again.")
        return (f"Cannot reach the enhancer server at {self.spec.base_url} ({type(exc).__name__}: {exc}): start "
                "the server, or fix base_url (host, port and the /v1 path).")

    def _run(self, key: str | None, on_delta) -> StreamResult:
        url = urllib.parse.urlsplit(self.spec.endpoint)
        cls = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        with self._lock:
            if self._aborted.is_set():
                raise StreamCancelled("cancelled")
            self._conn = cls(url.hostname, url.port, timeout=self.spec.timeout_s)
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        start = time.perf_counter()
        self._conn.request("POST", url.path.rstrip("/") + "/chat/completions", body=json.dumps(self.body).encode(),
                           headers=headers)
        resp = self._conn.getresponse()
        if resp.status != 200:
            raise ServerError(http_error(self.spec, resp.status, resp.read()))
        self._started = True
        result = StreamResult()
        done = False
        for event in sse.events(resp):
            if event is sse.DONE:
                done = True
                break
            self._take(event, result, on_delta, start)
        if self._aborted.is_set():
            raise StreamCancelled("cancelled")
        if not done and result.finish_reason is None:
            raise ServerError(f"The stream from the enhancer server at {self.spec.base_url} ended before the answer "
                              f"was complete ({result.chunks} chunks received): the server stopped or dropped the "
                              "connection. Check the server's log and run again.")
        result.seconds = time.perf_counter() - start
        result.tokens = result.tokens or result.chunks
        return result

    def _take(self, event: str, result: StreamResult, on_delta, start: float) -> None:
        try:
            chunk = json.loads(event)
        except ValueError:
            raise ServerError(f"The enhancer server at {self.spec.base_url} sent a chunk that is not JSON "
                              f"({event[:120]!r}): is base_url an OpenAI-compatible /v1 endpoint?") from None
        if not isinstance(chunk, dict):
            raise ServerError(f"The enhancer server at {self.spec.base_url} sent an unexpected chunk {event[:120]!r}.")
        if "error" in chunk:
            raise ServerError(f"The enhancer server at {self.spec.base_url} stopped with an error: "
                              f"{_message(chunk)}. Check the server's log.")
        result.model = chunk.get("model") or result.model
        usage = chunk.get("usage") or {}
        if usage.get("completion_tokens") is not None:
            result.tokens = int(usage["completion_tokens"])
            result.prompt_tokens = usage.get("prompt_tokens")
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            for kind, keys in (("reasoning", ("reasoning_content", "reasoning")), ("content", ("content",))):
                text = next((delta[k] for k in keys if isinstance(delta.get(k), str) and delta[k]), "")
                if text:
                    result.chunks += 1
                    if result.first_token_s is None:
                        result.first_token_s = time.perf_counter() - start
                    if kind == "content":
                        result.content += text
                    else:
                        result.reasoning += text
                    if on_delta is not None:
                        on_delta(kind, text)
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]


def _message(body) -> str:
    """The human part of an error body (OpenAI ``{"error": {"message"}}``, FastAPI ``{"detail"}``, ...)."""
    if isinstance(body, dict):
        for key in ("error", "detail", "message"):
            if key in body:
                return _message(body[key])
        return json.dumps(body)[:400]
    if isinstance(body, list):
        return "; ".join(_message(b) for b in body)[:400]
    return str(body)[:400]


def http_error(spec: ServerSpec, status: int, raw: bytes) -> str:
    """The message for a refused request (HTTP ``status``, body ``raw``), naming the fix."""
    try:
        text = _message(json.loads(raw))
    except ValueError:
        text = raw.decode("utf-8", errors="replace").strip()[:400] or "(no body)"
    text = text.rstrip(". ")
    where = f"The enhancer server at {spec.base_url}"
    low = text.lower()
    if status in (401, 403):
        fix = (f"set the environment variable {spec.api_key_env} to a key this server accepts" if spec.api_key_env
               else "this server needs an API key: put it in an environment variable and name it in api_key_env")
        return f"{where} refused the request (HTTP {status}: {text}): {fix}, then restart ComfyUI."
    if status == 404 or (status in (400, 422) and spec.model.lower() in low):  # a message naming the model
        return f"{where} does not serve model {spec.model!r} (HTTP {status}: {text}). {_served_hint(spec)}"
    if status in (400, 413, 422) and any(w in low for w in ("context", "too long", "maximum", "max_model_len")):
        return (f"{where} refused the prompt as too long (HTTP {status}: {text}): lower max_length, or start the "
                "server with a longer context (vLLM --max-model-len, SGLang --context-length, llama-server -c, "
                "Ollama num_ctx).")
    if status in (400, 422) and any(w in low for w in ("image", "multimodal", "vision")):
        return (f"{where} cannot take images with model {spec.model!r} (HTTP {status}: {text}): serve the edit "
                "enhancer (Qwen/Qwen-Image-2.1-PE-I2I, the _i2i file) for edit mode, or disconnect the images.")
    return f"{where} answered HTTP {status}: {text}. Check base_url, model and the server's log."


def served_models(spec: ServerSpec) -> list[str]:
    """The model names the server lists at ``GET /v1/models`` (raises OSError / ValueError when it cannot)."""
    url = urllib.parse.urlsplit(spec.endpoint)
    cls = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
    conn = cls(url.hostname, url.port, timeout=min(spec.timeout_s, 30.0))
    key = spec.api_key()
    try:
        conn.request("GET", url.path.rstrip("/") + "/models", headers={"Authorization": f"Bearer {key}"} if key else {})
        resp = conn.getresponse()
        body = json.loads(resp.read())
    finally:
        conn.close()
    return [str(m.get("id")) for m in body.get("data", []) if isinstance(m, dict) and m.get("id")]


def _served_hint(spec: ServerSpec) -> str:
    try:
        names = served_models(spec)
    except (OSError, ValueError, http.client.HTTPException) as exc:
        return f"Its model list (GET /v1/models) could not be read ({exc}); set model to a name it serves."
    if not names:
        return "Its model list (GET /v1/models) is empty; load a model on the server."
    return f"It serves: {', '.join(names)}. Set model to one of them."


def _redact(text: str, key: str | None) -> str:
    return text.replace(key, "***") if key else text
