"""Fetch what the pack needs from the Hugging Face Hub on first use, through ``huggingface_hub``.

Three things, each fetched once and reused offline afterwards:

* the official Qwen-Image 2.1 enhancer system prompts (``system_prompt.txt`` of
  ``Qwen/Qwen-Image-2.1-PE-T2I`` / ``-I2I``; Qwen Research License, never bundled with the pack),
  stored under ComfyUI's models folder;
* the MTP head of a Qwen3.5 base model: only the ``mtp.*`` tensors, read by HTTP range requests
  from the shards that hold them (about 0.5 GB for 9B instead of its 19 GB), written as one
  safetensors file through a ``.part`` file that a later call resumes;
* the Comfy-Org prompt-enhancer files, downloaded whole with progress.

``huggingface_hub`` is imported lazily (ComfyUI installs it); it supplies the endpoint
(``HF_ENDPOINT``), the token (``HF_TOKEN`` or ``hf auth login``), the cache folder and the HTTP
session. Every failure raises :class:`FetchError` with a message that names the fix.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import os
import shutil
import struct
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]  # (bytes done, bytes total)

PROMPT_REPOS = {"text-to-image": "Qwen/Qwen-Image-2.1-PE-T2I", "edit": "Qwen/Qwen-Image-2.1-PE-I2I"}
PROMPT_FILE = "system_prompt.txt"
PROMPT_LICENSE = "Qwen Research License (non-commercial use)"
PROMPT_FOLDER = "qwen_image_pe"  # under ComfyUI's models folder

#: Qwen3.5 size (``Qwen35Config.size_name``) -> the base repository that holds its MTP head.
MTP_BASE_REPOS = {
    "0.8B": "Qwen/Qwen3.5-0.8B",
    "2B": "Qwen/Qwen3.5-2B",
    "4B": "Qwen/Qwen3.5-4B",
    "9B": "Qwen/Qwen3.5-9B",
    "27B": "Qwen/Qwen3.5-27B",
}
INDEX_FILE = "model.safetensors.index.json"
MTP_PREFIXES = ("mtp.", "model.mtp.")

PE_REPO = "Comfy-Org/Qwen-Image-2.1"
PE_SUBFOLDER = "text_encoders"
#: Comfy-Org prompt-enhancer file (about 10 GB each) -> the preset it serves.
PE_FILES = {
    "qwen3.5_9b_qwen_image_2.1_pe_t2i.int8_convrot.safetensors": "text-to-image",
    "qwen3.5_9b_qwen_image_2.1_pe_i2i.int8_convrot.safetensors": "edit",
}

MIB = 1 << 20
CHUNK = 16 * MIB           # bytes per range request
_BLOCK = 64 * 1024         # bytes per read: what a broken connection can lose
_MAX_HEADER = 100 * MIB    # a safetensors header larger than this is not a real one
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
                "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_PART = ".part"

_license_logged: set[str] = set()


class FetchError(RuntimeError):
    """A download or a downloaded file failed; the message says what to do."""


class _Interrupted(Exception):
    """The connection broke mid-transfer (the part already written stays valid)."""


# --------------------------------------------------------------------------------------------
# huggingface_hub access
# --------------------------------------------------------------------------------------------

def _hub():
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


def _is_network_error(exc: BaseException) -> bool:
    """Errors of the HTTP stack or the Hub client (not our own, not ComfyUI's interrupt)."""
    if isinstance(exc, (FetchError, _Interrupted)):
        return False
    root = type(exc).__module__.split(".")[0]
    return isinstance(exc, OSError) or root in ("httpx", "httpx2", "httpcore", "requests", "urllib3", "h11",
                                                "huggingface_hub", "http")


def _unreachable(what: str, exc: BaseException, by_hand: str) -> FetchError:
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return FetchError(
        f"Cannot download {what} from {endpoint()} ({type(exc).__name__}: {detail}). Check the network "
        "(HF_ENDPOINT for a mirror, HF_TOKEN or 'hf auth login' for a gated repository) and run again, "
        f"or fetch it by hand: {by_hand}")


def _hub_download(repo: str, filename: str, what: str, by_hand: str, **kwargs) -> str:
    """``hf_hub_download`` (HF cache, token, offline mode), failing fast when the Hub cannot be reached."""
    hub = _hub()
    try:
        return hub.hf_hub_download(repo, filename, endpoint=endpoint(), local_files_only=True, **kwargs)
    except Exception as exc:
        if not _is_network_error(exc):
            raise
    try:
        hub.get_hf_file_metadata(_hub_url(repo, filename, "main"))  # one try: hf_hub_download retries for ~20 s
        return hub.hf_hub_download(repo, filename, endpoint=endpoint(), **kwargs)
    except Exception as exc:
        if not _is_network_error(exc):
            raise
        raise _unreachable(what, exc, by_hand) from exc


def _hub_url(repo: str, filename: str, revision: str) -> str:
    return _hub().hf_hub_url(repo, filename, revision=revision, endpoint=endpoint())


def _origin(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    return parts.scheme, parts.netloc


@dataclass
class _Remote:
    """One file on the Hub, resolved once: where to read it, how big it is, which version."""

    repo: str
    filename: str
    url: str
    size: int
    etag: str
    commit: str
    headers: dict


def _resolve(repo: str, filename: str, revision: str) -> _Remote:
    hub = _hub()
    url = _hub_url(repo, filename, revision)
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
    return _Remote(repo, filename, location, int(meta.size), meta.etag, meta.commit_hash, headers)


@contextmanager
def _range_response(remote: _Remote, start: int, end: int, timeout: float = 60.0):
    """The open response for bytes ``[start, end)`` of ``remote`` and an iterator over its body."""
    session = _hub().utils.get_session()
    headers = dict(remote.headers, Range=f"bytes={start}-{end - 1}")
    if hasattr(session, "stream"):  # httpx / httpx2 (huggingface_hub >= 1.0)
        with session.stream("GET", remote.url, headers=headers, timeout=timeout, follow_redirects=True) as r:
            yield r, r.iter_bytes(min(MIB, _BLOCK))
    else:  # requests (huggingface_hub < 1.0)
        r = session.get(remote.url, headers=headers, timeout=timeout, stream=True, allow_redirects=True)
        try:
            yield r, r.iter_content(min(MIB, _BLOCK))
        finally:
            r.close()


def _read_range(remote: _Remote, start: int, end: int) -> Iterator[bytes]:
    """Yield the bytes ``[start, end)`` of ``remote``; _Interrupted when the transfer breaks off."""
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
                raise _Interrupted(f"HTTP {status} for a range of {remote.filename}")
            for block in body:
                if got + len(block) > end - start:
                    raise FetchError(f"{endpoint()} sent more bytes than asked for {remote.filename}.")
                got += len(block)
                yield block
    except (FetchError, _Interrupted):
        raise
    except Exception as exc:
        if not _is_network_error(exc):
            raise
        raise _Interrupted(f"{type(exc).__name__}: {exc}") from exc
    if got != end - start:
        raise _Interrupted(f"got {got} of {end - start} bytes of {remote.filename}")


def _read_bytes(remote: _Remote, start: int, end: int) -> bytes:
    return b"".join(_read_range(remote, start, end))


# --------------------------------------------------------------------------------------------
# safetensors headers
# --------------------------------------------------------------------------------------------

def _check_entries(header: dict, data_size: int | None, where: str) -> None:
    """Every tensor entry has a known dtype, a consistent byte length, and lies inside the data."""
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b, e) = entry["dtype"], [int(s) for s in entry["shape"]], entry["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise FetchError(f"{where}: header entry {name!r} is malformed; the file is corrupt.") from exc
        if dtype not in _DTYPE_BYTES:
            raise FetchError(f"{where}: tensor {name!r} has unknown dtype {dtype!r}; the file is corrupt.")
        if e - b != math.prod(shape) * _DTYPE_BYTES[dtype] or b < 0:
            raise FetchError(f"{where}: tensor {name!r} has inconsistent offsets; the file is corrupt.")
        if data_size is not None and e > data_size:
            raise FetchError(f"{where}: tensor {name!r} ends at byte {e} of a {data_size}-byte data section: "
                             "the file is truncated.")


def _parse_header(raw: bytes, where: str) -> dict:
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise FetchError(f"{where}: the safetensors header is not valid JSON; the file is corrupt.") from exc
    if not isinstance(header, dict):
        raise FetchError(f"{where}: the safetensors header is not an object; the file is corrupt.")
    return header


def local_header(path: str) -> dict:
    """The JSON header of a local safetensors file (no tensor data read); FetchError when unreadable."""
    where = os.path.basename(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise FetchError(f"{where} is empty or truncated; delete it and download it again.")
            (n,) = struct.unpack("<Q", head)
            size = os.fstat(f.fileno()).st_size
            if n > min(_MAX_HEADER, size - 8):
                raise FetchError(f"{where} has a broken safetensors header; delete it and download it again.")
            header = _parse_header(f.read(n), where)
    except OSError as exc:
        raise FetchError(f"Cannot read {path!r} ({exc}).") from exc
    _check_entries(header, size - 8 - n, where)
    return header


def tensor_shapes(header: dict) -> dict[str, tuple[int, ...]]:
    return {k: tuple(int(s) for s in v["shape"]) for k, v in header.items() if k != "__metadata__"}


def _remote_header(remote: _Remote) -> tuple[dict, int]:
    """(header, header length incl. the 8-byte prefix) of a remote safetensors file, by two range reads."""
    where = f"{remote.repo}/{remote.filename}"
    if remote.size < 8:
        raise FetchError(f"{where} on {endpoint()} is {remote.size} bytes: truncated.")
    (n,) = struct.unpack("<Q", _read_bytes(remote, 0, 8))
    if n > min(_MAX_HEADER, remote.size - 8):
        raise FetchError(f"{where} on {endpoint()} has a broken safetensors header (length {n} for a "
                         f"{remote.size}-byte file): the file is corrupt or truncated.")
    header = _parse_header(_read_bytes(remote, 8, 8 + n), where)
    _check_entries(header, remote.size - 8 - n, where)
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    if ends and 8 + n + max(ends) != remote.size:
        raise FetchError(f"{where} on {endpoint()} is {remote.size} bytes but its header describes "
                         f"{8 + n + max(ends)}: the file is truncated or corrupt.")
    return header, 8 + n


# --------------------------------------------------------------------------------------------
# Official system prompts
# --------------------------------------------------------------------------------------------

def prompt_path(preset: str, models_dir: str) -> str:
    """Where the official system prompt of ``preset`` is kept under ComfyUI's models folder."""
    if preset not in PROMPT_REPOS:
        raise ValueError(f"no official system prompt for preset {preset!r}; presets with one: "
                         f"{', '.join(PROMPT_REPOS)}")
    return os.path.join(models_dir, PROMPT_FOLDER, PROMPT_REPOS[preset].split("/")[1], PROMPT_FILE)


def official_system_prompt(preset: str, models_dir: str) -> str:
    """The official system prompt of ``preset``: read from the models folder, fetched there once if absent."""
    path = prompt_path(preset, models_dir)
    repo = PROMPT_REPOS[preset]
    if not os.path.isfile(path):
        _download_prompt(repo, path)
    with open(path, encoding="utf-8") as f:
        text = f.read().strip()
    if not text:
        raise FetchError(f"{path} is empty; delete it so it is fetched again from {repo}.")
    if repo not in _license_logged:
        _license_logged.add(repo)
        log.info("Qwen3.5 prompt enhancer: official system prompt of %s (%s), from %s", repo, PROMPT_LICENSE, path)
    return text


def _download_prompt(repo: str, path: str) -> None:
    by_hand = f"hf download {repo} {PROMPT_FILE} --local-dir {os.path.dirname(path)}"
    cached = _hub_download(repo, PROMPT_FILE, f"the official system prompt ({repo}/{PROMPT_FILE})", by_hand)
    try:
        with open(cached, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as exc:
        raise FetchError(f"{repo}/{PROMPT_FILE} is not UTF-8 text; report it, or fetch it by hand: {by_hand}") from exc
    if not text.strip():
        raise FetchError(f"{repo}/{PROMPT_FILE} from {endpoint()} is empty; fetch it by hand: {by_hand}")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + _PART
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
    log.info("Fetched the official system prompt of %s (%s; not redistributed by this pack) into %s",
             repo, PROMPT_LICENSE, path)
    _license_logged.add(repo)


# --------------------------------------------------------------------------------------------
# MTP head by range reads
# --------------------------------------------------------------------------------------------

def mtp_head_name(size: str) -> str:
    """File name of the extracted MTP head of a Qwen3.5 size, e.g. ``qwen3.5_9b_mtp_head.safetensors``."""
    return f"qwen3.5_{size.lower()}_mtp_head.safetensors"


def base_repo(size: str) -> str:
    if size not in MTP_BASE_REPOS:
        raise FetchError(f"No known base repository for a Qwen3.5 of size {size!r} (known: "
                         f"{', '.join(MTP_BASE_REPOS)}); pick an MTP head file by hand.")
    return MTP_BASE_REPOS[size]


@dataclass
class _Piece:
    """A run of bytes ``[start, end)`` of one shard, copied to the output at ``out``."""

    remote: _Remote
    start: int
    end: int
    out: int


def _plan(repo: str, revision: str) -> tuple[bytes, list[_Piece], int, str]:
    """(output header bytes, pieces to copy, data size, commit) for the ``mtp.*`` tensors of ``repo``."""
    index_remote = _resolve(repo, INDEX_FILE, revision)
    commit = index_remote.commit
    try:
        index = json.loads(_read_bytes(index_remote, 0, index_remote.size).decode("utf-8"))
        weight_map = index["weight_map"]
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise FetchError(f"{repo}/{INDEX_FILE} on {endpoint()} is not a safetensors index; the repository "
                         "is not a sharded Qwen3.5 checkpoint.") from exc
    names = sorted(k for k in weight_map if k.startswith(MTP_PREFIXES))
    if not names:
        raise FetchError(f"{repo} lists no mtp.* tensors in {INDEX_FILE}: it has no MTP head. Use the base "
                         "Qwen3.5 repository of the same size.")
    by_shard: dict[str, list[str]] = {}
    for name in names:
        by_shard.setdefault(weight_map[name], []).append(name)
    out_header: dict = {}
    pieces: list[_Piece] = []
    sources = {}
    pos = 0
    for shard in sorted(by_shard):
        remote = _resolve(repo, shard, commit)
        sources[shard] = remote.etag
        header, data_start = _remote_header(remote)
        missing = [n for n in by_shard[shard] if n not in header]
        if missing:
            raise FetchError(f"{repo}/{shard} lacks {missing[0]!r} although {INDEX_FILE} puts it there: the "
                             "repository is inconsistent or the shard is corrupt.")
        for name in sorted(by_shard[shard], key=lambda k: header[k]["data_offsets"][0]):
            entry = header[name]
            b, e = entry["data_offsets"]
            out_name = "mtp." + name.split("mtp.", 1)[1]
            out_header[out_name] = {"dtype": entry["dtype"], "shape": entry["shape"],
                                    "data_offsets": [pos, pos + e - b]}
            if pieces and pieces[-1].remote is remote and pieces[-1].end == data_start + b:
                pieces[-1].end = data_start + e  # contiguous in the shard: one run
            else:
                pieces.append(_Piece(remote, data_start + b, data_start + e, pos))
            pos += e - b
    out_header["__metadata__"] = {"format": "pt", "source": f"mtp.* tensors of {repo}@{commit}",
                                  "source_files": json.dumps(sources, sort_keys=True)}
    raw = json.dumps(out_header, sort_keys=True, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, pieces, pos, commit


def _check_shapes(shapes: dict, expected: dict | None, where: str, fix: str) -> None:
    if expected is None:
        return
    want = {k: tuple(v) for k, v in expected.items()}
    for name, shape in want.items():
        if name not in shapes:
            raise FetchError(f"{where} lacks {name!r}, which this Qwen3.5 model's MTP head needs. {fix}")
        if tuple(shapes[name]) != shape:
            raise FetchError(f"{where}: {name!r} has shape {tuple(shapes[name])}, this model needs {shape}: the head "
                             f"is for another Qwen3.5 size. {fix}")


def fetch_mtp_head(size: str, dest_dir: str, *, expected_shapes: dict | None = None,
                   progress: Progress | None = None, revision: str = "main", retries: int = 3,
                   repo: str | None = None) -> str:
    """Path of ``dest_dir/qwen3.5_<size>_mtp_head.safetensors``, downloaded first if absent.

    Only the ``mtp.*`` tensors of the base repository's shards are fetched (range reads). The file is
    written through ``<name>.part`` (kept after an interruption and resumed by the next call) and
    renamed into place once complete and verified; ``expected_shapes`` (canonical ``mtp.*`` name ->
    shape, e.g. from the main checkpoint) are checked on the new file and on an existing one.
    ``progress(done, total)`` is called at every MiB.
    """
    repo = repo or base_repo(size)
    dest = os.path.join(dest_dir, mtp_head_name(size))
    fix = f"Delete {dest} and pick 'download ({repo})' again, or choose the head of the right size."
    if os.path.isfile(dest):
        _check_shapes(tensor_shapes(local_header(dest)), expected_shapes, os.path.basename(dest), fix)
        return dest
    by_hand = (f"hf download {repo} --include 'model.safetensors*' --local-dir <folder>, then run the pack's "
               "tools/extract_mtp_head.py on that folder")
    try:
        header_bytes, pieces, total, commit = _plan(repo, revision)
    except FetchError:
        raise
    except _Interrupted as exc:
        raise _unreachable(f"the MTP head index of {repo}", exc, by_hand) from exc
    except Exception as exc:
        if not _is_network_error(exc):
            raise
        raise _unreachable(f"the MTP head of {repo}", exc, by_hand) from exc
    planned = {k: tuple(v["shape"]) for k, v in json.loads(header_bytes[8:]).items() if k != "__metadata__"}
    _check_shapes(planned, expected_shapes, f"{repo}@{commit[:12]}", "Pick the base repository of this model's size.")

    os.makedirs(dest_dir, exist_ok=True)
    part = dest + _PART
    done = _resume_point(part, header_bytes, total)
    if done:
        log.info("Resuming the MTP head download of %s at %.0f of %.0f MiB", repo, done / MIB, total / MIB)
    else:
        log.info("Downloading the MTP head of %s (%.0f MiB of mtp.* tensors, by range reads) into %s",
                 repo, total / MIB, dest)
        with open(part, "wb") as f:
            f.write(header_bytes)
    if progress:
        progress(done, total)
    attempts = 0
    while done < total:
        try:
            done = _copy_pieces(part, pieces, done, total, progress)
        except _Interrupted as exc:
            attempts += 1
            if attempts > retries:
                raise FetchError(
                    f"The MTP head download of {repo} broke off at {done / MIB:.0f} of {total / MIB:.0f} MiB "
                    f"({exc}). Run again to resume from there ({os.path.basename(part)} is kept).") from exc
            done = os.path.getsize(part) - len(header_bytes)
            log.warning("MTP head download interrupted (%s); resuming at %.0f MiB", exc, done / MIB)
            time.sleep(min(2.0 ** attempts, 8.0) * 0.25)
    _finish(part, dest, header_bytes, total, expected_shapes, fix)
    log.info("MTP head of %s written to %s", repo, dest)
    return dest


def _resume_point(part: str, header_bytes: bytes, total: int) -> int:
    """Data bytes already in ``part`` when it was started with the same header (same source files), else 0."""
    if not os.path.isfile(part):
        return 0
    with open(part, "rb") as f:
        same = f.read(len(header_bytes)) == header_bytes
    size = os.path.getsize(part) - len(header_bytes)
    if same and 0 <= size <= total:
        return size
    log.info("Discarding %s: it belongs to another version of the source files", part)
    os.remove(part)
    return 0


def _copy_pieces(part: str, pieces: list[_Piece], done: int, total: int, progress: Progress | None) -> int:
    """Append the data from output offset ``done`` on; return the new offset (``total`` when complete)."""
    with open(part, "ab") as f:
        for piece in pieces:
            length = piece.end - piece.start
            if piece.out + length <= done:
                continue
            offset = done - piece.out  # > 0 only for the piece an interruption cut
            while offset < length:
                stop = min(length, offset + CHUNK)
                for block in _read_range(piece.remote, piece.start + offset, piece.start + stop):
                    f.write(block)
                    before, done = done, done + len(block)
                    offset += len(block)
                    if progress and (done // MIB != before // MIB or done == total):
                        progress(done, total)
                f.flush()
    return done


def _finish(part: str, dest: str, header_bytes: bytes, total: int, expected: dict | None, fix: str) -> None:
    """Verify ``part`` (size, header, shapes) and move it into place; remove it when it is wrong."""
    try:
        if os.path.getsize(part) != len(header_bytes) + total:
            raise FetchError(f"{os.path.basename(part)} has {os.path.getsize(part)} bytes, expected "
                             f"{len(header_bytes) + total}; it was removed, run again.")
        _check_shapes(tensor_shapes(local_header(part)), expected, os.path.basename(dest), fix)
    except FetchError:
        os.remove(part)
        raise
    os.replace(part, dest)


# --------------------------------------------------------------------------------------------
# Whole files (the Comfy-Org prompt-enhancer checkpoints)
# --------------------------------------------------------------------------------------------

def _progress_tqdm(progress: Progress):
    """A tqdm class for huggingface_hub that reports bytes to ``progress``."""
    from tqdm.auto import tqdm

    class _Bar(tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._done = int(kwargs.get("initial", 0) or 0)

        def update(self, n=1):
            self._done += int(n or 0)
            if self.total:
                progress(min(self._done, int(self.total)), int(self.total))
            return super().update(n)

    return _Bar


def fetch_pe_file(name: str, dest_dir: str, *, progress: Progress | None = None) -> str:
    """Path of ``dest_dir/name`` (a Comfy-Org prompt-enhancer file), downloaded first if absent."""
    if name not in PE_FILES:
        raise FetchError(f"{name!r} is not a Comfy-Org prompt-enhancer file; known: {', '.join(PE_FILES)}")
    dest = os.path.join(dest_dir, name)
    if os.path.isfile(dest):
        return dest
    hub = _hub()
    filename = f"{PE_SUBFOLDER}/{name}"
    staging = os.path.join(dest_dir, ".qwen35_download", name[: -len(".safetensors")])  # hf's resumable .incomplete
    by_hand = f"hf download {PE_REPO} {filename} --local-dir <ComfyUI>/models"
    kwargs = dict(local_dir=staging)
    if progress is not None and "tqdm_class" in inspect.signature(hub.hf_hub_download).parameters:
        kwargs["tqdm_class"] = _progress_tqdm(progress)
    log.info("Downloading %s from %s (about 10 GB) into %s", filename, PE_REPO, dest_dir)
    got = _hub_download(PE_REPO, filename, f"{PE_REPO}/{filename}", by_hand, **kwargs)
    os.replace(got, dest)
    shutil.rmtree(staging, ignore_errors=True)
    try:
        os.rmdir(os.path.dirname(staging))  # only when no other download is staged there
    except OSError:
        pass
    log.info("%s is ready in %s", name, dest_dir)
    return dest


# --------------------------------------------------------------------------------------------
# What the loader node offers
# --------------------------------------------------------------------------------------------

DOWNLOAD = "download ({})"


def mtp_download_options() -> list[str]:
    """Loader ``mtp_head`` choices that fetch the head on first use; the 9B enhancer's first."""
    sizes = ["9B", *[s for s in MTP_BASE_REPOS if s != "9B"]]
    return [DOWNLOAD.format(MTP_BASE_REPOS[s]) for s in sizes]


def download_repo(option: str) -> str | None:
    """The repository of a ``download (<repo>)`` choice, else None."""
    if isinstance(option, str) and option.startswith("download (") and option.endswith(")"):
        return option[len("download ("):-1]
    return None


def mtp_head_for(option: str, clip_path: str, dest_dir: str, *, progress: Progress | None = None) -> str:
    """Path of the MTP head a ``download (<repo>)`` choice stands for, fetched on first use.

    The size comes from the main checkpoint's tensor shapes (header only), which also give the
    shapes the head must have; a repository of another size is refused, naming the right one.
    """
    from ..engine import Qwen35Config, Qwen35Error

    repo = download_repo(option)
    if repo is None:
        raise ValueError(f"{option!r} is not a download choice")
    name = os.path.basename(clip_path)
    try:
        config = Qwen35Config.from_state_dict(tensor_shapes(local_header(clip_path)))
    except Qwen35Error as exc:
        raise FetchError(f"{name}: cannot tell the Qwen3.5 size from its tensors ({exc}).") from exc
    size = config.size_name
    want = MTP_BASE_REPOS.get(size)
    if want is None:
        raise FetchError(f"{name} is not one of the released Qwen3.5 sizes ({', '.join(MTP_BASE_REPOS)}), so no "
                         "base repository holds its MTP head: pick an MTP head file, or 'none'.")
    if want != repo:
        raise FetchError(f"{name} is a Qwen3.5 {size}; its MTP head comes from {want}, not {repo}: pick "
                         f"'{DOWNLOAD.format(want)}'.")
    return fetch_mtp_head(size, dest_dir, expected_shapes=config.mtp_shapes(), progress=progress)


def comfy_progress() -> Progress:
    """A callback driving a ComfyUI progress bar in MiB; checks Cancel at every update."""
    import comfy.utils

    state = {"bar": None, "mib": -1}

    def update(done: int, total: int) -> None:
        mib_total = max(1, math.ceil(total / MIB))
        if state["bar"] is None:
            state["bar"] = comfy.utils.ProgressBar(mib_total)
        mib = mib_total if done >= total else done // MIB
        if mib != state["mib"]:
            state["mib"] = mib
            state["bar"].update_absolute(min(mib, mib_total), mib_total)
        try:
            import comfy.model_management as mm
        except ImportError:
            return
        check = getattr(mm, "throw_exception_if_processing_interrupted", None)
        if check is not None:
            check()  # Cancel: the .part file stays and the next run resumes it

    return update
