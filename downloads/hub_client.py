"""The Hugging Face Hub as the pack reads it, through ``huggingface_hub`` (imported lazily; ComfyUI
installs it): whole files into the HF cache (``hub_download``, failing fast and naming the fix when
the Hub cannot be reached) and byte ranges of one file (``resolve`` a file once, then
``read_range`` / ``read_bytes``). ``huggingface_hub`` supplies the endpoint (``HF_ENDPOINT``), the
token (``HF_TOKEN`` or ``hf auth login``) and the HTTP session. Every failure is a
:class:`FetchError` whose message names the fix; a transfer that breaks off is ``Interrupted``
(what was written stays valid, the caller resumes).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.parse import urlsplit

Progress = Callable[[int, int], None]  # (bytes done, bytes total)

MIB = 1 << 20
_BLOCK = 64 * 1024         # bytes per read: what a broken connection can lose
PART = ".part"             # suffix of a file being written (renamed into place once complete)


class FetchError(RuntimeError):
    """A download or a downloaded file failed; the message says what to do."""


class Interrupted(Exception):
    """The connection broke mid-transfer (the part already written stays valid)."""


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


def unreachable(what: str, exc: BaseException, by_hand: str) -> FetchError:
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return FetchError(
        f"Cannot download {what} from {endpoint()} ({type(exc).__name__}: {detail}). Check the network "
        "(HF_ENDPOINT for a mirror, HF_TOKEN or 'hf auth login' for a gated repository) and run again, "
        f"or fetch it by hand: {by_hand}")


def hub_download(repo: str, filename: str, what: str, by_hand: str, **kwargs) -> str:
    """``hf_hub_download`` (HF cache, token, offline mode), failing fast when the Hub cannot be reached."""
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
        raise unreachable(what, exc, by_hand) from exc


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
    if _origin(location) != _origin(url):
        headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}  # signed CDN address
    headers["Accept-Encoding"] = "identity"
    return Remote(repo, filename, location, int(meta.size), meta.etag, meta.commit_hash, headers)


@contextmanager
def _range_response(remote: Remote, start: int, end: int, timeout: float = 60.0):
    """The open response for bytes ``[start, end)`` of ``remote`` and an iterator over its body."""
    session = hub_module().utils.get_session()
    headers = dict(remote.headers, Range=f"bytes={start}-{end - 1}")
    if hasattr(session, "stream"):  # httpx / httpx2 (huggingface_hub >= 1.0)
        with session.stream("GET", remote.url, headers=headers, timeout=timeout, follow_redirects=True) as r:
            yield r, r.iter_bytes(_BLOCK)
    else:  # requests (huggingface_hub < 1.0)
        r = session.get(remote.url, headers=headers, timeout=timeout, stream=True, allow_redirects=True)
        try:
            yield r, r.iter_content(_BLOCK)
        finally:
            r.close()


def read_range(remote: Remote, start: int, end: int) -> Iterator[bytes]:
    """Yield the bytes ``[start, end)`` of ``remote``; Interrupted when the transfer breaks off."""
    got = 0
    try:
        with _range_response(remote, start, end) as (r, body):
            status = r.status_code
            if status == 416:
                raise FetchError(f"{remote.repo}/{remote.filename} is shorter than its header says (bytes "
                                 f"{start}-{end - 1} asked, not there): the file on {endpoint()} is truncated.")
            if status in (401, 403):
                raise FetchError(f"{endpoint()} refused {remote.repo}/{remote.filename} (HTTP {status}): accept "
                                 "the repository's terms on the Hub and log in (hf auth login, or HF_TOKEN).")
            if status == 200:
                raise FetchError(f"{endpoint()} ignores HTTP Range requests, so the MTP head cannot be read on "
                                 "its own. Use a Hub endpoint that supports ranges, or download the base "
                                 "checkpoint and run the pack's extract_mtp_head tool.")
            if status != 206:
                raise Interrupted(f"HTTP {status} for a range of {remote.filename}")
            for block in body:
                if got + len(block) > end - start:
                    raise FetchError(f"{endpoint()} sent more bytes than asked for {remote.filename}.")
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
