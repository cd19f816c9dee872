"""The MTP head of a Qwen3.5 base model, fetched by HTTP range reads: only the ``mtp.*`` tensors
of the shards that hold them (about 0.5 GB for 9B instead of its 19 GB), written as one
safetensors file through a ``.part`` file that a later call resumes (``transfer``; what is already
there re-read and checked against the part's ledger first), one fetch at a time per file, and
checked completely (``head_check``: names, shapes, float dtypes, finite values, safetensors' own
parser) before it is moved into place.

What range reads cannot give: the Hub publishes the sha256 of each whole shard only, so bytes read
by ranges are checked for everything but their values (each reply's ``Content-Range``, sizes,
the shard's header against the index, shapes, finite values). The sha256 recorded in the head
(``data_sha256``) is the one of the bytes as received, and the file is refused unless its data is
exactly those bytes; ``data_checked`` in its metadata says what was and was not checked, so that
the recorded checksum never vouches for more (``head_check.source_unchecked``). A head found in
place is re-checked by that sha256 before it is used.
"""

from __future__ import annotations

import json
import logging
import os
import struct

from . import transfer
from .head_check import (
    CHECKED_KEY,
    FLOAT_DTYPES,
    MTP_PREFIXES,
    RANGES_CHECKED,
    SHA_KEY,
    SHA_PLACEHOLDER,
    check_head,
    record_sha256,
)
from .hub_client import (
    MIB,
    PART,
    FetchError,
    Interrupted,
    Progress,
    endpoint,
    is_network_error,
    read_bytes,
    resolve,
    unreachable,
)
from .safetensors_header import remote_header, tensor_shapes

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


def mtp_head_name(size: str) -> str:
    """File name of the extracted MTP head of a Qwen3.5 size, e.g. ``qwen3.5_9b_mtp_head.safetensors``."""
    return f"qwen3.5_{size.lower()}_mtp_head.safetensors"


def base_repo(size: str) -> str:
    if size not in MTP_BASE_REPOS:
        raise FetchError(f"No known base repository for a Qwen3.5 of size {size!r} (known: "
                         f"{', '.join(MTP_BASE_REPOS)}); pick an MTP head file by hand.")
    return MTP_BASE_REPOS[size]


def _shard(name, repo: str) -> str:
    """A shard file name from the index: a plain relative ``.safetensors`` path of the repository."""
    parts = name.split("/") if isinstance(name, str) else [""]
    if "\\" in name or any(p in ("", ".", "..") for p in parts) or not name.endswith(".safetensors"):
        raise FetchError(f"{repo}/{INDEX_FILE} on {endpoint()} names the shard {name!r}, which is not a "
                         ".safetensors file of the repository: the index is corrupt.")
    return name


def _plan(repo: str, revision: str) -> tuple[bytes, list[transfer.Piece], int, str]:
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
        by_shard.setdefault(_shard(weight_map[name], repo), []).append(name)
    out_header: dict = {}
    pieces: list[transfer.Piece] = []
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
            if entry["dtype"] not in FLOAT_DTYPES:
                raise FetchError(f"{repo}/{shard} stores {name!r} as {entry['dtype']}, not a float dtype "
                                 f"({', '.join(FLOAT_DTYPES)}): use the base (unquantized) Qwen3.5 repository.")
            b, e = entry["data_offsets"]
            out_name = "mtp." + name.split("mtp.", 1)[1]
            out_header[out_name] = {"dtype": entry["dtype"], "shape": entry["shape"],
                                    "data_offsets": [pos, pos + e - b]}
            if pieces and pieces[-1].remote is remote and pieces[-1].end == data_start + b:
                pieces[-1].end = data_start + e  # contiguous in the shard: one run
            else:
                pieces.append(transfer.Piece(remote, data_start + b, data_start + e, pos))
            pos += e - b
    out_header["__metadata__"] = {"format": "pt", "source": f"mtp.* tensors of {repo}@{commit}",
                                  "source_files": json.dumps(sources, sort_keys=True), SHA_KEY: SHA_PLACEHOLDER,
                                  CHECKED_KEY: RANGES_CHECKED}
    raw = json.dumps(out_header, sort_keys=True, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, pieces, pos, commit


def _check_names(shapes: dict, expected: dict | None, where: str, fix: str) -> None:
    """The planned head has exactly the expected tensors, in the expected shapes."""
    if expected is None:
        return
    want = {k: tuple(v) for k, v in expected.items()}
    for name, shape in want.items():
        if name not in shapes:
            raise FetchError(f"{where} lacks {name!r}, which this Qwen3.5 model's MTP head needs. {fix}")
        if tuple(shapes[name]) != shape:
            raise FetchError(f"{where}: {name!r} has shape {tuple(shapes[name])}, this model needs {shape}: the head "
                             f"is for another Qwen3.5 size. {fix}")
    extra = sorted(set(shapes) - set(want))
    if extra:
        raise FetchError(f"{where} has {extra[0]!r}, which is not part of this model's MTP head. {fix}")


def fetch_mtp_head(size: str, dest_dir: str, *, expected_shapes: dict | None = None,
                   progress: Progress | None = None, check: transfer.Check | None = None, revision: str = "main",
                   retries: int = 3, repo: str | None = None) -> str:
    """Path of ``dest_dir/qwen3.5_<size>_mtp_head.safetensors``, downloaded first if absent.

    Only the ``mtp.*`` tensors of the base repository's shards are fetched (range reads). One fetch
    per file runs at a time (threads and processes); the file is written through ``<name>.part``
    (kept after an interruption or Cancel and resumed by the next call) and renamed into place once
    complete and verified. ``expected_shapes`` (canonical ``mtp.*`` name -> shape, e.g. from the
    main checkpoint) must match exactly, on the new file and on an existing one; an existing file
    that fails its checks is a FetchError saying to delete it. ``progress(done, total)`` is called at
    every MiB; ``check()`` at least every ``hub_client.TICK`` seconds, and what it raises (Cancel)
    stops the download with the ``.part`` kept.
    """
    repo = repo or base_repo(size)
    dest = os.path.join(dest_dir, mtp_head_name(size))
    fix = (f"Delete it ({dest}) and pick 'download ({repo})' again to fetch a verified copy, or choose the head of "
           "the right size.")
    if not os.path.isfile(dest):
        os.makedirs(dest_dir, exist_ok=True)
        with transfer.locked(dest, check):
            if not os.path.isfile(dest):
                _download(repo, revision, dest, expected_shapes, progress, check, retries)
                return dest
            log.info("%s was fetched by another download meanwhile; using it", dest)
    check_head(dest, shapes=expected_shapes, finite=False, fix=fix)
    return dest


#: How to go on without a downloaded MTP head.
OFFLINE_HEAD = ("set the loader's mtp_head to 'none': MTP then uses the loaded file's own mtp.* tensors if it has "
                "them, else generation runs without MTP")


def _download(repo: str, revision: str, dest: str, expected_shapes: dict | None, progress: Progress | None,
              check: transfer.Check | None, retries: int) -> None:
    by_hand = (f"hf download {repo} --include 'model.safetensors*' --local-dir <folder>, then run the pack's "
               "tools/extract_mtp_head.py on that folder")
    try:
        header_bytes, pieces, total, commit = _plan(repo, revision)
    except FetchError:
        raise
    except Interrupted as exc:
        raise unreachable(f"the MTP head index of {repo}", exc, by_hand, OFFLINE_HEAD) from exc
    except Exception as exc:
        if not is_network_error(exc):
            raise
        raise unreachable(f"the MTP head of {repo}", exc, by_hand, OFFLINE_HEAD) from exc
    planned = tensor_shapes(json.loads(header_bytes[8:]))
    _check_names(planned, expected_shapes, f"{repo}@{commit[:12]}", "Pick the base repository of this model's size.")

    ledger = transfer.Ledger(dest + PART, len(header_bytes))
    done = _resume_point(ledger, header_bytes, total, check)
    if done:
        log.info("Resuming the MTP head download of %s at %.0f of %.0f MiB", repo, done / MIB, total / MIB)
    else:
        log.info("Downloading the MTP head of %s (%.0f MiB of mtp.* tensors, by range reads) into %s",
                 repo, total / MIB, dest)
        ledger.start(header_bytes)
    if progress:
        progress(done, total)
    transfer.copy_pieces(ledger, pieces, done, total, what=f"the MTP head of {repo}", progress=progress, check=check,
                         retries=retries)

    def verify(path: str) -> None:
        if os.path.getsize(path) != len(header_bytes) + total:
            raise FetchError(f"{os.path.basename(path)} has {os.path.getsize(path)} bytes, expected "
                             f"{len(header_bytes) + total}; it was removed, run again.")
        record_sha256(path, expected=ledger.sha256())
        check_head(path, shapes=expected_shapes or planned, finite=True,
                   fix=f"The download was removed; if this repeats, the files of {repo} on {endpoint()} are broken.")

    transfer.finish(ledger, dest, verify)
    log.info("MTP head of %s written to %s (checked: %s; sha256 of the bytes received recorded)", repo, dest,
             RANGES_CHECKED)


def _resume_point(ledger: transfer.Ledger, header_bytes: bytes, total: int, check: transfer.Check | None) -> int:
    """Data bytes already in the part, re-read and checked against its ledger, when it was started with
    the same header (same source files); else 0 (the part removed)."""
    if transfer.part_exists(ledger.part):
        with open(ledger.part, "rb") as f:
            same = f.read(len(header_bytes)) == header_bytes
        if not same or os.path.getsize(ledger.part) - len(header_bytes) > total:
            log.info("Discarding %s: it belongs to another version of the source files", ledger.part)
            ledger.discard()
            return 0
    return ledger.resume(check)
