"""One HTTP/1.1 exchange that any thread can abandon: a socket this module opens (connect polled, so Cancel
and the deadline are seen while connecting), ``http.client`` for the request and its response framing
(chunked, Content-Length, or read to the close), bounded reads, and body lines split at CR LF, LF or a bare
CR as server-sent events define them. ComfyUI-free, standard library only.

``abort()`` sets a flag and shuts the socket down in both directions, so the server sees the connection
closed whatever the framing and a read blocked in another thread returns at once; the thread that owns the
exchange then raises :class:`Aborted` and closes it.
"""

from __future__ import annotations

import errno
import http.client
import re
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator

_POLL_S = 0.05  # how often a connect in progress looks at the stop flag
_READ = 65536
_EOL = re.compile(rb"\r\n|\r|\n")
_IN_PROGRESS = {errno.EINPROGRESS, errno.EALREADY, errno.EWOULDBLOCK, errno.EAGAIN, 10035, 10036}  # + Windows'


class Aborted(Exception):
    """The exchange was abandoned: ``abort()`` or the caller's stop check."""


class ChunkTimeout(TimeoutError):
    """Nothing arrived for the per-read timeout."""


class DeadlineReached(TimeoutError):
    """The exchange's total deadline passed."""


class ConnectTimeout(TimeoutError):
    """The connection was not established within the per-read timeout."""


class LineTooLong(ValueError):
    """A body line longer than the caller's bound."""


class Stopper:
    """A stop flag for exchanges on several threads: callable (True once stopped or ``also()`` is True);
    :meth:`stop` aborts every exchange registered with it, and one registered later at once."""

    def __init__(self, also: Callable[[], bool] = lambda: False):
        self._event, self._also = threading.Event(), also
        self._lock = threading.Lock()
        self._live: set[Exchange] = set()

    def __call__(self) -> bool:
        return self._event.is_set() or bool(self._also())

    def register(self, ex: Exchange) -> None:
        with self._lock:
            self._live.add(ex)
        if self._event.is_set():
            ex.abort()

    def unregister(self, ex: Exchange) -> None:
        with self._lock:
            self._live.discard(ex)

    def stop(self) -> None:
        self._event.set()
        with self._lock:
            live = list(self._live)
        for ex in live:
            ex.abort()


class _Connection(http.client.HTTPConnection):
    """``http.client`` over the socket ``opener`` returns."""

    def __init__(self, host: str, port: int, timeout: float, opener: Callable[[], socket.socket]):
        super().__init__(host, port, timeout=timeout)
        self._opener = opener

    def connect(self) -> None:
        self.sock = self._opener()


class Exchange:
    """One request to ``scheme://host:port``: connect, send, read, bounded by ``timeout_s`` per read and
    by the monotonic ``deadline``; ``stop()`` (any callable, polled) or :meth:`abort` ends it."""

    def __init__(self, scheme: str, host: str, port: int, *, timeout_s: float, deadline: float,
                 stop: Callable[[], bool] = lambda: False):
        self.timeout_s, self.deadline, self._stop = float(timeout_s), float(deadline), stop
        self._aborted = threading.Event()
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._context = ssl.create_default_context() if scheme == "https" else None
        self._conn = _Connection(host, port, self.timeout_s, self._open)
        self._resp: http.client.HTTPResponse | None = None
        if isinstance(stop, Stopper):
            stop.register(self)

    # -- stopping

    def stopped(self) -> bool:
        return self._aborted.is_set() or bool(self._stop())

    def check(self) -> None:
        """Raise :class:`Aborted` once stopped, :class:`DeadlineReached` past the deadline."""
        if self.stopped():
            raise Aborted()
        if time.monotonic() >= self.deadline:
            raise DeadlineReached()

    def abort(self) -> None:
        """Stop from any thread: the socket is shut down both ways (the server sees it closed)."""
        self._aborted.set()
        with self._lock:
            sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        """Shut down and release the socket (idempotent; the owning thread calls it when done)."""
        if isinstance(self._stop, Stopper):
            self._stop.unregister(self)
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._resp is not None:
            self._resp.close()
        self._conn.close()
        if sock is not None:
            sock.close()

    # -- connecting

    def _wait_s(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise DeadlineReached()
        return min(self.timeout_s, left)

    def _open(self) -> socket.socket:
        host, port = self._conn.host, self._conn.port
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        last: OSError | None = None
        for family, kind, proto, _, addr in infos:
            sock = socket.socket(family, kind, proto)
            with self._lock:
                self._sock = sock
            try:
                self._connect(sock, addr)
                sock.settimeout(self._wait_s())
                if self._context is not None:  # the handshake reads the registered socket: abort() ends it
                    sock = self._context.wrap_socket(sock, server_hostname=host)
                    with self._lock:
                        self._sock = sock
                    self.check()
                return sock
            except OSError as exc:
                last = exc
                with self._lock:
                    self._sock = None
                sock.close()
                if isinstance(exc, (TimeoutError, ssl.SSLError)) or self.stopped():
                    raise
        raise last or OSError(f"no address for {host}")

    def _connect(self, sock: socket.socket, addr) -> None:
        sock.setblocking(False)
        end = time.monotonic() + self._wait_s()
        err = sock.connect_ex(addr)
        while err in _IN_PROGRESS and not self.stopped():
            left = end - time.monotonic()
            if left <= 0:
                raise DeadlineReached() if time.monotonic() >= self.deadline else ConnectTimeout()
            _, writable, failed = select.select([], [sock], [sock], min(_POLL_S, left))
            if writable or failed:
                err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                break
        self.check()
        if err:
            raise OSError(err, errno.errorcode.get(err, str(err)))

    # -- the request

    def send(self, method: str, path: str, headers: dict, body: bytes | None = None) -> http.client.HTTPResponse:
        """Connect, send the request, read the status line and headers; the response."""
        self.check()
        try:
            self._conn.request(method, path, body=body, headers=headers)
            self.check()
            self._set_timeout()
            self._resp = self._conn.getresponse()
        except (socket.timeout, TimeoutError) as exc:
            self.check()
            if isinstance(exc, (ChunkTimeout, ConnectTimeout, DeadlineReached)):
                raise
            raise ChunkTimeout() from None
        return self._resp

    def _set_timeout(self) -> None:
        with self._lock:
            sock = self._sock
        if sock is None:
            raise Aborted()
        sock.settimeout(self._wait_s())

    def read(self, n: int = _READ) -> bytes:
        """Up to ``n`` body bytes as they arrive (b"" at the end of the body)."""
        self.check()
        self._set_timeout()
        try:
            data = self._resp.read1(n)
        except (socket.timeout, TimeoutError):
            self.check()
            raise ChunkTimeout() from None
        except (OSError, http.client.HTTPException):
            self.check()
            raise
        self.check()
        return data

    def read_body(self, limit: int) -> bytes:
        """The whole body, at most ``limit`` bytes (a longer one is cut there)."""
        out = bytearray()
        while len(out) < limit:
            data = self.read(min(_READ, limit - len(out)))
            if not data:
                break
            out += data
        return bytes(out)

    def lines(self, max_line: int) -> Iterator[bytes]:
        """The body's lines without their ends (CR LF, LF or CR); an unterminated last line is dropped.
        :class:`LineTooLong` for a line over ``max_line`` bytes (read no further than that)."""
        pending, skip_lf = b"", False
        while True:
            chunk = self.read()
            if not chunk:
                return
            if skip_lf and chunk[:1] == b"\n":
                chunk = chunk[1:]
            skip_lf = False
            data, start = pending + chunk, 0
            for m in _EOL.finditer(data):
                if m.start() - start > max_line:
                    raise LineTooLong(m.start() - start)
                yield data[start:m.start()]
                self.check()
                start = m.end()
                skip_lf = m.group() == b"\r" and start == len(data)
            pending = data[start:]
            if len(pending) > max_line:
                raise LineTooLong(len(pending))
