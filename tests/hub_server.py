"""A real HTTP server speaking the part of the Hugging Face Hub protocol that ``huggingface_hub`` uses
to download files: ``HEAD``/``GET /{repo}/resolve/{revision}/{path}`` with ``ETag``, ``X-Repo-Commit``,
``X-Linked-Etag``/``X-Linked-Size`` (large files), ``Content-Length``, ``Accept-Ranges`` and HTTP
``Range`` (206 / 416), 404 with the Hub's ``X-Error-Code``. It listens on 127.0.0.1 (an ephemeral
port) in a thread; tests point ``HF_ENDPOINT`` at it, so the real client does the talking.

It counts the body bytes served per file and misbehaves on request, per file: cut one response
short (a broken connection), serve other bytes than asked under a ``Content-Range`` that says so (a
mirror off by some bytes), serve another version's bytes under the headers and ``Content-Range``
of this one (a mirror holding a stale copy), change one byte of a body (damage in transit), stall
a body until released (a dead connection), or pause before each body (a slow link). A file can also be served
the way the Hub serves LFS files from its CDN: ``resolve`` answers 302 with a signed address on
another origin (``localhost`` instead of ``127.0.0.1``), and each signed address serves a limited
number of GETs before it answers 403 (expired); every resolve hands out a fresh one.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")
_CDN = re.compile(r"^/_cdn/(?P<token>[0-9a-f]+)/(?P<repo>[^/]+/[^/]+)/(?P<path>.+)$")
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")
LARGE = (".safetensors", ".bin")  # served as LFS files, as the Hub does


class FakeHub:
    def __init__(self):
        self.repos: dict[str, dict[str, bytes]] = {}
        self.commits: dict[str, str] = {}
        self.served: Counter = Counter()       # (repo, path) -> body bytes sent
        self.requests: list[tuple] = []        # (method, repo, path, range header, authorization)
        self.cut: dict[tuple, int] = {}        # (repo, path) -> cut the next longer GET after this many bytes
        self.shift: dict[tuple, list] = {}     # (repo, path) -> [offset, times, from]: ranges from byte `from`
        #                                        on are served this far on (`times` of them)
        self.flip: set[tuple] = set()          # (repo, path): change one byte of the next GET's body
        self.swap: dict[tuple, list] = {}      # (repo, path) -> [other bytes, times]: the next `times` GET
        #                                        bodies come from the other bytes (another version of the file,
        #                                        same size) under the headers and Content-Range of this one
        self.stall: dict[tuple, int] = {}      # (repo, path) -> the next GET stops after this many bytes...
        self.stalled = threading.Event()       # ...sets this...
        self.release = threading.Event()       # ...and sends nothing more until this is set (then closes)
        self.pause: dict[tuple, float] = {}    # (repo, path) -> seconds to wait before each GET body
        self.signed: dict[tuple, list] = {}    # (repo, path) -> GETs each signed address serves, in the
        #                                        order they are handed out (the last repeats); 0: expired
        self.tokens: dict[str, int] = {}       # signed address token -> GETs it still serves
        self.expired = 0                       # 403s answered for expired signed addresses
        self._server = None
        self._thread = None

    # ---------------------------------------------------------------- content
    def add_repo(self, repo: str, files: dict[str, bytes]) -> None:
        self.repos[repo] = dict(files)
        self.commits[repo] = hashlib.sha1(repo.encode()).hexdigest()

    def set_file(self, repo: str, path: str, data: bytes) -> None:
        self.repos[repo][path] = data
        self.commits[repo] = hashlib.sha1(self.commits[repo].encode() + data[:64]).hexdigest()

    def bytes_of(self, repo: str, path: str | None = None) -> int:
        return sum(n for (r, p), n in self.served.items() if r == repo and (path is None or p == path))

    # ---------------------------------------------------------------- life
    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeHub:
        hub = self

        class Handler(_Handler):
            fake = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(5)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    fake: FakeHub

    def log_message(self, *args):  # keep pytest output clean
        pass

    def do_HEAD(self):  # noqa: N802 - http.server's naming
        self._serve(body=False)

    def do_GET(self):  # noqa: N802
        self._serve(body=True)

    def _send(self, code: int, headers: dict, payload: bytes = b"", body: bool = True):
        self.send_response(code)
        headers = {"Connection": "close", **headers}
        headers.setdefault("Content-Length", str(len(payload)))
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        self.close_connection = True
        if body and payload:
            self.wfile.write(payload)

    def _serve(self, body: bool):
        fake = self.fake
        cdn = _CDN.match(self.path.split("?")[0])
        m = cdn or _RESOLVE.match(self.path.split("?")[0])
        if not m:
            return self._send(404, {"X-Error-Code": "RepoNotFound"}, b"not found", body)
        repo, rev, path = m["repo"], ("main" if cdn else m["rev"]), m["path"]
        if cdn:  # a signed address: valid for its number of GETs, then 403 as a CDN answers
            left = fake.tokens.get(cdn["token"], 0)
            if left <= 0:
                fake.expired += 1
                return self._send(403, {"Content-Type": "application/xml"}, b"<Error>AccessDenied: expired</Error>",
                                  body)
            fake.tokens[cdn["token"]] = left - 1 if body else left
        fake.requests.append((self.command, repo, path, self.headers.get("Range"),
                              self.headers.get("Authorization")))
        if repo not in fake.repos:
            return self._send(404, {"X-Error-Code": "RepoNotFound",
                                    "X-Error-Message": "Repository not found"}, b"", body)
        commit = fake.commits[repo]
        if rev not in ("main", commit):
            return self._send(404, {"X-Error-Code": "RevisionNotFound"}, b"", body)
        files = fake.repos[repo]
        if path not in files:
            return self._send(404, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": commit,
                                    "X-Error-Message": "Entry not found"}, b"", body)
        data = files[path]
        digest = hashlib.sha256(data).hexdigest()
        headers = {"X-Repo-Commit": commit, "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        if path.endswith(LARGE):
            headers.update({"ETag": f'"{digest}"', "X-Linked-Etag": f'"{digest}"', "X-Linked-Size": str(len(data))})
        else:
            headers["ETag"] = f'"{hashlib.sha1(data).hexdigest()}"'
        if (repo, path) in fake.signed and not cdn:  # the Hub's redirect to a fresh signed CDN address
            budgets = fake.signed[(repo, path)]
            token = secrets.token_hex(8)
            fake.tokens[token] = budgets.pop(0) if len(budgets) > 1 else budgets[0]
            port = fake._server.server_address[1]
            location = f"http://localhost:{port}/_cdn/{token}/{repo}/{path}"
            return self._send(302, {**headers, "Location": location}, b"", body)
        start, end = 0, len(data)
        code = 200
        rng = self.headers.get("Range")
        if rng:
            r = _RANGE.match(rng.strip())
            if not r or (not r[1] and not r[2]):
                return self._send(416, {**headers, "Content-Range": f"bytes */{len(data)}"}, b"", body)
            if r[1]:
                start, end = int(r[1]), (int(r[2]) + 1 if r[2] else len(data))
            else:  # suffix range
                start, end = max(0, len(data) - int(r[2])), len(data)
            if start >= len(data) or end <= start:
                return self._send(416, {**headers, "Content-Range": f"bytes */{len(data)}"}, b"", body)
            end = min(end, len(data))
            code = 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
        key = (repo, path)
        shift = fake.shift.get(key)
        if body and code == 206 and shift and shift[1] > 0 and start >= shift[2]:
            shift[1] -= 1
            start, end = min(start + shift[0], len(data) - 1), min(end + shift[0], len(data))
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
        payload = data[start:end]
        headers["Content-Length"] = str(len(payload))
        if not body:
            return self._send(code, headers, b"", body=False)
        swap = fake.swap.get(key)
        if swap and swap[1] > 0 and payload:
            swap[1] -= 1
            payload = swap[0][start:end]
        if key in fake.flip and payload:
            fake.flip.discard(key)
            payload = bytes([payload[0] ^ 0xFF]) + payload[1:]
        time.sleep(fake.pause.get(key, 0.0))
        stall = fake.stall.pop(key, None)
        if stall is not None and stall < len(payload):
            return self._stall(code, headers, payload[:stall], key)
        cut = fake.cut.get((repo, path))
        if cut is not None and cut < len(payload):
            del fake.cut[(repo, path)]
            self.send_response(code)
            for k, v in {"Connection": "close", **headers}.items():
                self.send_header(k, v)
            self.end_headers()
            fake.served[(repo, path)] += cut  # counted before sending: the client may react at once
            self.wfile.write(payload[:cut])
            self.wfile.flush()
            self.close_connection = True
            return
        fake.served[(repo, path)] += len(payload)
        self._send(code, headers, payload, body=True)

    def _stall(self, code: int, headers: dict, head: bytes, key: tuple):
        self.send_response(code)
        for k, v in {"Connection": "close", **headers}.items():
            self.send_header(k, v)
        self.end_headers()
        self.fake.served[key] += len(head)
        self.wfile.write(head)
        self.wfile.flush()
        self.fake.stalled.set()
        self.fake.release.wait(30)
        self.close_connection = True
