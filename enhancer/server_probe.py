"""``api`` "auto": ask the server once per address what it is, so that only the fields it honours are sent.

The questions, in order, each a bounded GET that Cancel ends:
1. ``GET <endpoint>/models`` (with the paired key): ``owned_by`` "vllm", "sglang" or "llamacpp" names the
   server (vLLM, SGLang and llama-server set it so).
2. ``GET <root>/api/version`` (no key) answering ``{"version": ...}``: Ollama.
3. ``GET <root>/openapi.json`` (no key): the routes of a FastAPI server: ``/load_model`` with
   ``/v1/responses`` is ``transformers serve``; ``/get_server_info`` or ``/get_model_info`` SGLang;
   ``/version`` with ``/tokenize`` vLLM.
Anything else is sent the OpenAI standard fields only (``openai``). ``<root>`` is the endpoint without
its ``/v1``. The answer is kept per endpoint for the life of the process (:func:`forget` drops it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from .server_api import APIS, ServerError, ServerSpec, http_error
from .server_backend import get_json
from .server_keys import Secret

_OWNERS = {"vllm": "vllm", "sglang": "sglang", "llamacpp": "llama.cpp"}
_known: dict[str, Detected] = {}
_lock = threading.Lock()


@dataclass(frozen=True)
class Detected:
    """The server kind (a key of ``APIS``) and how it was told."""

    api: str
    how: str


def forget(endpoint: str | None = None) -> None:
    """Drop the kept answer for ``endpoint`` (every one when None)."""
    with _lock:
        if endpoint is None:
            _known.clear()
        else:
            _known.pop(endpoint, None)


def detect(spec: ServerSpec, secret: Secret | None, stop: Callable[[], bool]) -> Detected:
    """What the server at ``spec.endpoint`` is (asked once per endpoint). Raises OSError /
    ``http.client.HTTPException`` when it cannot be reached, :class:`ServerError` when it refuses the key,
    ``StreamCancelled`` on Cancel."""
    endpoint = spec.endpoint
    with _lock:
        if endpoint in _known:
            return _known[endpoint]
    found = _ask(spec, secret, stop)
    assert found.api in APIS
    with _lock:
        _known[endpoint] = found
    return found


def _ask(spec: ServerSpec, secret: Secret | None, stop: Callable[[], bool]) -> Detected:
    endpoint = spec.endpoint
    status, body = get_json(spec, endpoint + "/models", secret, stop, limit=1 << 20)
    if status in (401, 403):
        raise ServerError(http_error(spec, status, b"", secret, {}))
    data = body.get("data") if isinstance(body, dict) else None
    owners = {str(m.get("owned_by", "")).lower() for m in data or [] if isinstance(m, dict)} \
        if isinstance(data, list) else set()
    for owner, api in _OWNERS.items():
        if owner in owners:
            return Detected(api, f"GET /v1/models: owned_by {owner}")
    root = endpoint[:-3] if endpoint.endswith("/v1") else endpoint
    status, body = get_json(spec, root + "/api/version", None, stop, limit=1 << 12)
    if status == 200 and isinstance(body, dict) and isinstance(body.get("version"), str) and len(body) == 1:
        return Detected("ollama", "GET /api/version")
    status, body = get_json(spec, root + "/openapi.json", None, stop)
    paths = body.get("paths") if status == 200 and isinstance(body, dict) else None
    if isinstance(paths, dict):
        if "/load_model" in paths and "/v1/responses" in paths:
            return Detected("transformers", "OpenAPI routes: /load_model")
        if "/get_server_info" in paths or "/get_model_info" in paths:
            return Detected("sglang", "OpenAPI routes: /get_server_info")
        if "/version" in paths and "/tokenize" in paths:
            return Detected("vllm", "OpenAPI routes: /version, /tokenize")
    return Detected("openai", "not recognised, so the OpenAI standard fields only")
