"""The MTP head of a Qwen3.5 base model, fetched by HTTP range reads: only the ``mtp.*`` tensors
of the shards that hold them (about 0.5 GB for 9B instead of its 19 GB), written as one
safetensors file through a ``.part`` file that a later call resumes, verified (size, header,
shapes) before it is moved into place.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import time
from dataclasses import dataclass

from .hub_client import (
    MIB,
    PART,
    FetchError,
    Interrupted,
    Progress,
    Remote,
    endpoint,
    is_network_error,
    read_bytes,
    read_range,
    resolve,
    unreachable,
)
from .safetensors_header import local_header, remote_header, tensor_shapes

log = logging.getLogger(__name__)

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
CHUNK = 16 * MIB           # bytes per range request


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

    remote: Remote
    start: int
    end: int
    out: int


def _plan(repo: str, revision: str) -> tuple[bytes, list[_Piece], int, str]:
    """(output header bytes, pieces to copy, data size, commit) for the ``mtp.*`` tensors of ``repo``."""
    index_remote = resolve(repo, INDEX_FILE, revision)
    commit = index_remote.commit
    try:
        index = json.loads(read_bytes(index_remote, 0, index_remote.size).decode("utf-8"))
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
        remote = resolve(repo, shard, commit)
        sources[shard] = remote.etag
        header, data_start = remote_header(remote)
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
    except Interrupted as exc:
        raise unreachable(f"the MTP head index of {repo}", exc, by_hand) from exc
    except Exception as exc:
        if not is_network_error(exc):
            raise
        raise unreachable(f"the MTP head of {repo}", exc, by_hand) from exc
    planned = {k: tuple(v["shape"]) for k, v in json.loads(header_bytes[8:]).items() if k != "__metadata__"}
    _check_shapes(planned, expected_shapes, f"{repo}@{commit[:12]}", "Pick the base repository of this model's size.")

    os.makedirs(dest_dir, exist_ok=True)
    part = dest + PART
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
        except Interrupted as exc:
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
                for block in read_range(piece.remote, piece.start + offset, piece.start + stop):
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
