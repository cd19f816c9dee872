"""The enhancer's OpenAI-compatible server backend: one streamed ``/v1/chat/completions`` request per prompt
(``http_stream.Exchange``: abandoned at once on Cancel, bounded in time and size), its server-sent events
read as the standard defines them (``sse``), the deltas checked for shape, and errors that name the fix.
ComfyUI-free. One attempt per request: nothing here retries.

The API key (a ``server_keys.Secret``, paired by the user) is only ever put in the ``Authorization`` header
of requests under its paired address; every text that came from the server is redacted before it is cut,
shown or logged.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field

from . import sse
from .http_stream import Aborted, ChunkTimeout, ConnectTimeout, DeadlineReached, Exchange, LineTooLong
from .server_api import (  # noqa: F401 - the backend's public names
    API_NAMES,
    APIS,
    AUTO,
    SAMPLING_FIELDS,
    SEED_MAX,
    ServerError,
    ServerSpec,
    StreamCancelled,
    http_error,
    message_of,
    request_body,
    shown,
)
from .server_keys import Secret, redact

MAX_LINE = 1 << 20        # bytes in one line of the event stream
MAX_EVENT = 1 << 20       # characters of data in one event
MAX_ERROR_BODY = 1 << 16  # bytes of an error reply read
TEXT_PER_TOKEN = 1024     # characters the answer may hold per token of max_length
#: Text deltas past max_length held until the server finishes (a server may flush one token's text in
#: several deltas); one more closes the stream and the held ones are dropped.
HELD_MAX = 16


@dataclass
class StreamResult:
    """What one streamed completion delivered. ``tokens``: the server's usage count, else the text deltas;
    ``cut``: "max_length" when the client stopped reading at max_length (the server sent more)."""

    content: str = ""
    reasoning: str = ""
    model: str = ""
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    tokens: int = 0
    seconds: float = 0.0
    first_token_s: float | None = None
    cut: str | None = None
    chunks: int = field(default=0, repr=False)

    @property
    def tok_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def open_exchange(spec: ServerSpec, url: str, *, timeout_s: float, deadline_s: float,
                  stop: Callable[[], bool]) -> tuple[Exchange, str]:
    """An :class:`Exchange` to ``url``'s host and the path to request."""
    parts = urllib.parse.urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    ex = Exchange(parts.scheme, parts.hostname, port, timeout_s=timeout_s, deadline=time.monotonic() + deadline_s,
                  stop=stop)
    return ex, parts.path or "/"


def get_json(spec: ServerSpec, url: str, secret: Secret | None, stop: Callable[[], bool],
             limit: int = 4 << 20) -> tuple[int, object]:
    """(status, the JSON body or None) of ``GET url`` (at most ``limit`` bytes; ``secret`` sent when given).
    Raises OSError / ``http.client.HTTPException`` when the server cannot be reached, :class:`StreamCancelled`."""
    timeout = min(spec.timeout_s, 10.0)
    ex, path = open_exchange(spec, url, timeout_s=timeout, deadline_s=min(spec.deadline_s, 30.0), stop=stop)
    try:
        resp = ex.send("GET", path, {"Authorization": secret.header()} if secret else {})
        raw = ex.read_body(limit)
    except Aborted:
        raise StreamCancelled("cancelled") from None
    finally:
        ex.close()
    try:
        return resp.status, json.loads(raw)
    except ValueError:
        return resp.status, None


def model_ids(body) -> list[str]:
    """The model names of a ``GET /v1/models`` body (none for another shape)."""
    data = body.get("data") if isinstance(body, dict) else None
    return [str(m["id"]) for m in data or [] if isinstance(m, dict) and isinstance(m.get("id"), (str, int))] \
        if isinstance(data, list) else []


class ChatStream:
    """One streamed chat completion. :meth:`run` blocks until the answer is complete; :meth:`abort`, from any
    thread, closes the connection so that :meth:`run` raises :class:`StreamCancelled` at once; ``stop()``
    (polled at every line and while connecting) does the same. ``max_tokens`` text deltas are kept; up to
    :data:`HELD_MAX` more are held until the server finishes, and one beyond those closes the stream, which
    then keeps exactly ``max_tokens`` (``StreamResult.cut``)."""

    def __init__(self, spec: ServerSpec, body: dict, *, secret: Secret | None = None, max_tokens: int | None = None,
                 stop: Callable[[], bool] = lambda: False):
        self.spec, self.body, self.secret = spec, body, secret
        self.max_tokens = int(max_tokens if max_tokens is not None else body.get("max_tokens", 1 << 16))
        self.ex, self.path = open_exchange(spec, spec.endpoint.rstrip("/") + "/chat/completions",
                                           timeout_s=spec.timeout_s, deadline_s=spec.deadline_s, stop=stop)
        self._started = False  # the server accepted the request and its stream began
        self._parts: dict[str, list[str]] = {"reasoning": [], "content": []}
        self._chars = 0
        self._held: list[tuple[str, str]] = []

    def abort(self) -> None:
        self.ex.abort()

    def _say(self, text: str) -> str:
        return shown(text, self.secret, 160)

    def run(self, on_delta: Callable[[str, str], None] | None = None) -> StreamResult:
        """Send the request and read the stream; ``on_delta(kind, text)`` per delta (``"content"`` or
        ``"reasoning"``, unredacted). Raises :class:`ServerError` naming the fix, or :class:`StreamCancelled`."""
        where = f"The enhancer server at {self.spec.base_url}"
        try:
            return self._run(on_delta)
        except (StreamCancelled, Aborted):
            raise StreamCancelled("cancelled") from None
        except ServerError as exc:
            raise ServerError(redact(str(exc), self.secret)) from None
        except DeadlineReached:
            raise ServerError(f"{where} did not finish within {self.spec.deadline_s:g} s (deadline_s): raise "
                              "deadline_s, or lower max_length.") from None
        except ConnectTimeout:
            raise ServerError(f"Cannot reach the enhancer server at {self.spec.base_url}: no connection within "
                              f"{self.spec.timeout_s:g} s (timeout_s). Start the server, or fix base_url.") from None
        except ChunkTimeout:
            raise ServerError(f"{where} sent nothing for {self.spec.timeout_s:g} s (timeout_s): it may be busy or "
                              "still loading the model. Check the server's log, then raise timeout_s or run "
                              "again.") from None
        except (LineTooLong, sse.SSEError) as exc:
            raise ServerError(f"{where} sent a stream line or event over {MAX_LINE >> 20} MiB ({exc}): that is not "
                              "a chat-completions stream; check base_url.") from None
        except (OSError, http.client.HTTPException) as exc:
            if self.ex.stopped():
                raise StreamCancelled("cancelled") from None
            raise ServerError(redact(self._connection_message(exc), self.secret)) from None
        finally:
            self.ex.close()

    def _connection_message(self, exc: BaseException) -> str:
        detail = self._say(f"{type(exc).__name__}: {exc}")
        if self._started:
            return (f"The connection to the enhancer server at {self.spec.base_url} broke mid-answer ({detail}): "
                    "the server stopped or dropped it. Check the server's log and run again.")
        return (f"Cannot reach the enhancer server at {self.spec.base_url} ({detail}): start the server, or fix "
                "base_url (host, port and the /v1 path).")

    def _run(self, on_delta) -> StreamResult:
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if self.secret is not None:
            headers["Authorization"] = self.secret.header()
        start = time.perf_counter()
        resp = self.ex.send("POST", self.path, headers, json.dumps(self.body).encode())
        if resp.status != 200:
            message = http_error(self.spec, resp.status, self.ex.read_body(MAX_ERROR_BODY), self.secret, self.body)
            if "does not serve model" in message:
                message += " " + served_hint(self.spec, self.secret, self.ex.stopped)
            raise ServerError(message)
        self._started = True
        result, done = StreamResult(), False
        parser = sse.EventParser(MAX_EVENT)
        for raw in self.ex.lines(MAX_LINE):
            event = parser.feed(raw.decode("utf-8", errors="replace"))
            if event is None:
                continue
            if event.data.strip() == "[DONE]":
                done = True
                break
            if not self._take(event, result, on_delta, start):
                result.cut = "max_length"
                break
        self.ex.check()
        if result.cut is None:  # the server finished: the deltas it sent past max_length are its answer too
            for kind, text in self._held:
                self._keep(kind, text, result, on_delta, start)
        result.reasoning, result.content = ("".join(self._parts[k]) for k in ("reasoning", "content"))
        if not done and result.finish_reason is None and result.cut is None:
            raise ServerError(f"The stream from the enhancer server at {self.spec.base_url} ended before the answer "
                              f"was complete ({result.chunks} chunks received): the server stopped or dropped the "
                              "connection. Check the server's log and run again.")
        result.seconds = time.perf_counter() - start
        result.tokens = result.chunks if result.cut else (result.tokens or result.chunks)
        return result

    def _bad(self, what: str, event: str) -> ServerError:
        return ServerError(f"The enhancer server at {self.spec.base_url} sent {what} ({self._say(event)!r}): it does "
                           "not follow OpenAI's chat-completions stream. Check base_url and the server's log.")

    def _take(self, event: sse.Event, result: StreamResult, on_delta, start: float) -> bool:
        """Apply one event to ``result``; False once a delta beyond ``max_tokens`` arrived (not applied)."""
        data = event.data.strip()
        if not data:
            return True  # an empty data event (a keep-alive): nothing to apply
        try:
            chunk = json.loads(data)
        except ValueError:
            raise self._bad("a chunk that is not JSON", data) from None
        if event.type == "error" or (isinstance(chunk, dict) and "error" in chunk):
            raise ServerError(f"The enhancer server at {self.spec.base_url} stopped with an error: "
                              f"{self._say(message_of(chunk))}. Check the server's log.")
        if not isinstance(chunk, dict):
            raise self._bad("a chunk that is not a JSON object", data)
        if isinstance(chunk.get("model"), str):
            result.model = chunk["model"]
        usage = chunk.get("usage")
        if usage is not None:
            if not isinstance(usage, dict) or not all(_count(usage.get(k)) for k in ("completion_tokens",
                                                                                      "prompt_tokens")):
                raise self._bad("a usage record of the wrong shape", data)
            if usage.get("completion_tokens") is not None:
                result.tokens = int(usage["completion_tokens"])
            if usage.get("prompt_tokens") is not None:
                result.prompt_tokens = int(usage["prompt_tokens"])
        choices = chunk.get("choices")
        if choices is None:
            return True
        if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
            raise self._bad("choices that are not a list of objects", data)
        for choice in choices:
            delta = choice.get("delta") or {}
            finish = choice.get("finish_reason")
            if not isinstance(delta, dict) or not (finish is None or isinstance(finish, str)):
                raise self._bad("a delta of the wrong shape", data)
            for kind, keys in (("reasoning", ("reasoning_content", "reasoning")), ("content", ("content",))):
                values = [delta.get(k) for k in keys]
                if any(v is not None and not isinstance(v, str) for v in values):
                    raise self._bad(f"{kind} text that is not a string", data)
                text = next((v for v in values if v), "")
                if not text:
                    continue
                if result.chunks >= self.max_tokens:
                    if len(self._held) >= HELD_MAX:
                        return False
                    self._held.append((kind, text))
                    continue
                self._keep(kind, text, result, on_delta, start)
            if finish:
                result.finish_reason = finish
        return True

    def _keep(self, kind: str, text: str, result: StreamResult, on_delta, start: float) -> None:
        result.chunks += 1
        if result.first_token_s is None:
            result.first_token_s = time.perf_counter() - start
        self._parts[kind].append(text)
        self._chars += len(text)
        if self._chars > TEXT_PER_TOKEN * self.max_tokens + MAX_EVENT:
            raise ServerError(f"The enhancer server at {self.spec.base_url} sent over {TEXT_PER_TOKEN} characters a "
                              f"token for max_length {self.max_tokens}: that is not an answer; check base_url and "
                              "model.")
        if on_delta is not None:
            on_delta(kind, text)


def _count(value) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)


def served_hint(spec: ServerSpec, secret: Secret | None, stop: Callable[[], bool]) -> str:
    """One sentence listing the models the server serves (``GET /v1/models``), or why it could not."""
    try:
        status, body = get_json(spec, spec.endpoint + "/models", secret, stop, limit=1 << 20)
    except (OSError, http.client.HTTPException) as exc:
        return f"Its model list (GET /v1/models) could not be read ({shown(str(exc), secret, 120)}); set model to " \
               "a name it serves."
    names = model_ids(body) if status == 200 else []
    if not names:
        return "Its model list (GET /v1/models) is empty or unreadable; load a model on the server."
    return f"It serves: {shown(', '.join(names), secret)}. Set model to one of them."
