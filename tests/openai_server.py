"""A loopback OpenAI-compatible chat-completions server for the server enhancer's adversarial tests: a real
HTTP server (``http.server``, one thread per connection) whose replies a test scripts, and which records
what reached it (every connection, request path, headers and JSON body) and when a client closed a stream.

``reply(request) -> Reply`` decides each ``POST /v1/chat/completions``; ``GET /v1/models`` answers a list
whose ``owned_by`` is ``owner``; other paths 404. A :class:`Reply` streams ``events`` (SSE data payloads,
dicts sent as JSON) with the chosen framing (``"chunked"``, ``"length"`` (one Content-Length), ``"close"``
(``Connection: close``, the body ends when the server closes)), or ``raw`` bytes as the body, or an error
``status``; ``rate`` > 0 streams ``endless_event`` forever at that many events a second until the client
goes away (``closed`` is set then, with the time).

:class:`Blackhole`: a listening socket whose queue is full, so a connect to it hangs (no SYN answered).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def chunk(content: str | None = None, *, reasoning: str | None = None, finish: str | None = None,
          model: str = "test-model", usage: dict | None = None) -> dict:
    """One chat-completions stream chunk."""
    delta = {}
    if content is not None:
        delta["content"] = content
    if reasoning is not None:
        delta["reasoning_content"] = reasoning
    out = {"object": "chat.completion.chunk", "model": model,
           "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage is not None:
        out["usage"] = usage
    return out


def answer_events(content: str, *, reasoning: str = "", model: str = "test-model", prompt_tokens: int = 12) -> list:
    """A complete stream: reasoning, content one character group a chunk, finish "stop", usage, [DONE]."""
    events = [chunk(reasoning=reasoning[i:i + 8], model=model) for i in range(0, len(reasoning), 8)]
    events += [chunk(content[i:i + 8], model=model) for i in range(0, len(content), 8)]
    n = len(events)
    events.append(chunk(finish="stop", model=model))
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": n + prompt_tokens}
    events.append({"object": "chat.completion.chunk", "model": model, "choices": [], "usage": usage})
    events.append("[DONE]")
    return events


@dataclass
class Reply:
    events: list = field(default_factory=list)
    framing: str = "chunked"
    raw: bytes | None = None
    status: int = 200
    error_body: bytes = b""
    rate: float = 0.0
    endless_event: object = None
    delay_s: float = 0.0


def sse_bytes(events: list) -> bytes:
    out = b""
    for e in events:
        out += b"data: " + (e if isinstance(e, str) else json.dumps(e)).encode() + b"\n\n"
    return out


class OpenAIServer:
    """The server on ``127.0.0.1:<port>``; ``base_url`` is its ``/v1`` address."""

    def __init__(self, reply: Callable[[dict], Reply] | None = None, owner: str = "vllm"):
        self.reply = reply or (lambda req: Reply(answer_events('{"rewritten_prompt": "ok", "wh_ratio": "1:1"}')))
        self.owner = owner
        self.requests: list[dict] = []
        self.connections = 0
        self.closed = threading.Event()
        self.closed_at: float | None = None
        self.sent_events = 0
        owner_self = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def setup(self):
                owner_self.connections += 1
                super().setup()

            def do_GET(self):
                owner_self.requests.append({"method": "GET", "path": self.path, "headers": dict(self.headers)})
                if self.path == "/v1/models":
                    body = json.dumps({"object": "list", "data": [
                        {"id": "test-model", "object": "model", "owned_by": owner_self.owner}]}).encode()
                    self._send(200, body)
                else:
                    self._send(404, b'{"detail": "Not Found"}')

            def _send(self, status, body, ctype="application/json"):
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                req = {"method": "POST", "path": self.path, "headers": dict(self.headers), "body": json.loads(raw)}
                owner_self.requests.append(req)
                r = owner_self.reply(req)
                if r.delay_s:
                    time.sleep(r.delay_s)
                if r.status != 200:
                    self._send(r.status, r.error_body)
                    return
                body = r.raw if r.raw is not None else sse_bytes(r.events)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                if r.framing == "chunked":
                    self.send_header("Transfer-Encoding", "chunked")
                elif r.framing == "length":
                    self.send_header("Content-Length", str(10**12 if r.rate else len(body)))
                else:
                    self.send_header("Connection", "close")
                    self.close_connection = True
                self.end_headers()
                try:
                    self._write(r, body)
                    if r.rate:
                        self._endless(r)
                    if r.framing == "chunked":
                        self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                except OSError:
                    owner_self.closed_at = time.perf_counter()
                    owner_self.closed.set()
                    self.close_connection = True

            def _write(self, r, data):
                if not data:
                    return
                if r.framing == "chunked":
                    self.wfile.write(b"%x\r\n" % len(data) + data + b"\r\n")
                else:
                    self.wfile.write(data)
                self.wfile.flush()

            def _endless(self, r):
                one = sse_bytes([r.endless_event or chunk("x")])
                start, sent = time.perf_counter(), 0
                while True:
                    due = int((time.perf_counter() - start) * r.rate) + 1
                    if due > sent:
                        self._write(r, one * (due - sent))
                        owner_self.sent_events += due - sent
                        sent = due
                    time.sleep(0.001)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def chat_requests(self) -> list[dict]:
        return [r for r in self.requests if r["method"] == "POST"]

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class Blackhole:
    """A port where connect() hangs: a listener with a full accept queue (its SYNs go unanswered)."""

    def __init__(self):
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(0)
        self.port = self.listener.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.fillers = []
        for _ in range(2):  # fill the queue (its length is the backlog + 1)
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", self.port))
            self.fillers.append(s)
        time.sleep(0.1)

    def queued(self) -> int:
        """Connections that completed into the queue (accepts them, non-blocking)."""
        self.listener.setblocking(False)
        n = 0
        while True:
            try:
                conn, _ = self.listener.accept()
            except BlockingIOError:
                return n
            conn.close()
            n += 1

    def stop(self) -> None:
        for s in self.fillers:
            s.close()
        self.listener.close()
