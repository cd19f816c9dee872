"""The Hugging Face Hub as the pack reads it, through ``huggingface_hub`` (imported lazily; ComfyUI
installs it): whole files into the HF cache (``hub_download``, failing fast and naming the fix when
the Hub cannot be reached) and byte ranges of one file (``resolve`` a file once, then
``read_range`` / ``read_bytes``). ``huggingface_hub`` supplies the endpoint (``HF_ENDPOINT``), the
token (``HF_TOKEN`` or ``hf auth login``) and the HTTP session. Every failure is a
:class:`FetchError` whose message names the fix; a transfer that breaks off is ``Interrupted``
(what was yielded before stays valid, the caller resumes). A range read yields only bytes the
server declared (``Content-Range``) to be exactly the ones asked for, and honours the caller's
``check`` (Cancel) within ``TICK`` seconds even while the connection is stalled.
"""

from __future__ import annotations

import os
import queue
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.parse import urlsplit

Progress = Callable[[int, int], None]  # (bytes done, bytes total)

MIB = 1 << 20
_BLOCK = 64 * 1024         # bytes per read: what a broken connection can lose
PART = ".part"             # suffix of a file being written (renamed into place once complete)
TICK = 0.25                # seconds between ``check`` calls while waiting for bytes
STALL = 60.0               # seconds without a byte before a connection counts as broken
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


class FetchError(RuntimeError):
    """A download or a downloaded file failed; the message says what to do."""


class Interrupted(Exception):
    """The connection broke mid-transfer (the part already written stays valid)."""


class Expired(Interrupted):
    """A signed download address (a CDN redirect) of ``filename`` was refused: resolve it again."""

    def __init__(self, message: str, filename: str):
        super().__init__(message)
        self.filename = filename


def hub_module():
    """The ``huggingface_hub`` package, or FetchError naming how to install it."""
    try:
        import huggingface_hub
    except ImportError as exc:
        raise FetchError("huggingface_hub is not installed (ComfyUI installs it): run "
                         "'python -m pip install huggingface_hub', or download the file by hand.") from exc
    return huggingface_hub


def endpoint() -> str:
    """The Hub address: ``HF_ENDPOINT`` (read at call time) or huggingface_hub's default."""
    env = os.environ.get("HF_ENDPOINT", "").strip().rstrip("/")
    if env:
        return env
    from huggingface_hub import constants

    return constants.ENDPOINT.rstrip("/")


def is_network_error(exc: BaseException) -> bool:
    """Errors of the HTTP stack or the Hub client (not our own, not ComfyUI's interrupt)."""
    if isinstance(exc, (FetchError, Interrupted)):
        return False
    root = type(exc).__module__.split(".")[0]
    return isinstance(exc, OSError) or root in ("httpx", "httpx2", "httpcore", "requests", "urllib3", "h11",
                                                "huggingface_hub", "http")


def unreachable(what: str, exc: BaseException, by_hand: str, offline: str | None = None) -> FetchError:
    """The error of a download that could not reach the Hub: the network fixes, the ``by_hand``
    command, and ``offline`` (how to go on without the file) when there is such a way."""
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return FetchError(
        f"Cannot download {what} from {endpoint()} ({type(exc).__name__}: {detail}). Check the network "
        "(HF_ENDPOINT for a mirror, HF_TOKEN or 'hf auth login' for a gated repository) and run again, "
        f"or fetch it by hand: {by_hand}" + (f"; or, offline, {offline}" if offline else ""))


def hub_download(repo: str, filename: str, what: str, by_hand: str, offline: str | None = None, **kwargs) -> str:
    """``hf_hub_download`` (HF cache, token, offline mode), failing fast when the Hub cannot be reached
    (``unreachable``'s error, with ``by_hand`` and ``offline``)."""
    hub = hub_module()
    try:
        return hub.hf_hub_download(repo, filename, endpoint=endpoint(), local_files_only=True, **kwargs)
    except Exception as exc:
        if not is_network_error(exc):
            raise
    try:
        hub.get_hf_file_metadata(hub_url(repo, filename, "main"))  # one try: hf_hub_download retries for ~20 s
        return hub.hf_hub_download(repo, filename, endpoint=endpoint(), **kwargs)
    except Exception as exc:
        if not is_network_error(exc):
            raise
        raise unreachable(what, exc, by_hand, offline) from exc


def hub_url(repo: str, filename: str, revision: str) -> str:
    return hub_module().hf_hub_url(repo, filename, revision=revision, endpoint=endpoint())


def _origin(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    return parts.scheme, parts.netloc


@dataclass
class Remote:
    """One file on the Hub, resolved once: where to read it, how big it is, which version."""

    repo: str
    filename: str
    url: str
    size: int
    etag: str
    commit: str
    headers: dict
    signed: bool = False  # ``url`` is a redirect to another origin (a signed CDN address that expires)


def resolve(repo: str, filename: str, revision: str) -> Remote:
    hub = hub_module()
    url = hub_url(repo, filename, revision)
    meta = hub.get_hf_file_metadata(url)
    if not meta.commit_hash or not meta.etag:
        raise FetchError(f"{endpoint()} answered for {repo}/{filename} without the Hub's version headers "
                         "(X-Repo-Commit, ETag): it is not a Hugging Face Hub endpoint. Check HF_ENDPOINT.")
    if meta.size is None:
        raise FetchError(f"{endpoint()} gave no size for {repo}/{filename}; cannot read it by ranges.")
    headers = hub.utils.build_hf_headers()
    location = meta.location or url
    signed = _origin(location) != _origin(url)
    if signed:
        headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}  # signed CDN address
    headers["Accept-Encoding"] = "identity"
    return Remote(repo, filename, location, int(meta.size), meta.etag, meta.commit_hash, headers, signed)


@contextmanager
def _range_response(remote: Remote, start: int, end: int, timeout: float = STALL):
    """The open response for bytes ``[start, end)`` of ``remote``, an iterator over its body, and a
    function that closes it (safe to call from another thread)."""
    session = hub_module().utils.get_session()
    headers = dict(remote.headers, Range=f"bytes={start}-{end - 1}")
    if callable(getattr(session, "stream", None)):  # httpx / httpx2 (huggingface_hub >= 1.0)
        with session.stream("GET", remote.url, headers=headers, timeout=timeout, follow_redirects=True) as r:
            yield r, r.iter_bytes(_BLOCK), r.close
    else:  # requests (huggingface_hub < 1.0), whose Session.stream is a bool
        r = session.get(remote.url, headers=headers, timeout=timeout, stream=True, allow_redirects=True)
        try:
            yield r, r.iter_content(_BLOCK), r.close
        finally:
            r.close()


_END = object()


def _pumped(body: Iterator[bytes], close: Callable[[], None], check: Callable[[], None] | None) -> Iterator[bytes]:
    """The blocks of ``body``, read by a helper thread so that ``check`` runs every ``TICK`` seconds
    while none arrives; whatever ``check`` raises closes the response and propagates at once."""
    blocks: queue.Queue = queue.Queue(maxsize=8)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                blocks.put(item, timeout=TICK)
                return True
            except queue.Full:
                continue
        return False

    def pump():
        try:
            for block in body:
                if not put(block):
                    return
            item = _END
        except BaseException as exc:  # noqa: BLE001 - handed to the reading thread, which raises it
            item = exc
        put(item)

    worker = threading.Thread(target=pump, name="qwen35-range-read", daemon=True)
    worker.start()
    try:
        while True:
            try:
                item = blocks.get(timeout=TICK)
            except queue.Empty:
                if check is not None:
                    check()
                continue
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        if worker.is_alive():
            close()  # unblocks the helper; a stalled socket ends it within STALL seconds at the latest


def _check_reply(remote: Remote, r, start: int, end: int) -> None:
    """Raise unless ``r`` is a 206 carrying exactly bytes ``[start, end)`` of ``remote``."""
    status = r.status_code
    where = f"{remote.repo}/{remote.filename}"
    if status == 416:
        raise FetchError(f"{where} is shorter than its header says (bytes {start}-{end - 1} asked, not there): "
                         f"the file on {endpoint()} is truncated.")
    if status in (401, 403):
        if remote.signed:
            raise Expired(f"HTTP {status} from the signed download address of {remote.filename}", remote.filename)
        raise FetchError(f"{endpoint()} refused {where} (HTTP {status}): accept the repository's terms on the Hub "
                         "and log in (hf auth login, or HF_TOKEN).")
    if status == 200:
        raise FetchError(f"{endpoint()} ignores HTTP Range requests, so {where} cannot be read by ranges. Use a "
                         "Hub endpoint that supports ranges (unset HF_ENDPOINT for huggingface.co).")
    if status != 206:
        raise Interrupted(f"HTTP {status} for a range of {remote.filename}")
    declared = (r.headers.get("Content-Range") or "").strip()
    m = _CONTENT_RANGE.match(declared)
    if not m or int(m[1]) != start or int(m[2]) != end - 1 or (m[3] != "*" and int(m[3]) != remote.size):
        raise Interrupted(f"{endpoint()} answered the request for bytes {start}-{end - 1}/{remote.size} of "
                          f"{remote.filename} with Content-Range {declared or '(none)'!r}; nothing of it was kept")


def read_range(remote: Remote, start: int, end: int, check: Callable[[], None] | None = None) -> Iterator[bytes]:
    """Yield the bytes ``[start, end)`` of ``remote``; Interrupted when the transfer breaks off or the
    server declares other bytes than asked (nothing yielded then), Expired when a signed address was
    refused. ``check`` is called at least every ``TICK`` seconds while waiting; what it raises stops
    the read at once."""
    got = 0
    try:
        with _range_response(remote, start, end) as (r, body, close):
            _check_reply(remote, r, start, end)
            for block in _pumped(body, close, check):
                if got + len(block) > end - start:
                    raise Interrupted(f"{endpoint()} sent more bytes than asked for {remote.filename}")
                got += len(block)
                yield block
    except (FetchError, Interrupted):
        raise
    except Exception as exc:
        if not is_network_error(exc):
            raise
        raise Interrupted(f"{type(exc).__name__}: {exc}") from exc
    if got != end - start:
        raise Interrupted(f"got {got} of {end - start} bytes of {remote.filename}")


def read_bytes(remote: Remote, start: int, end: int) -> bytes:
    return b"".join(read_range(remote, start, end))
