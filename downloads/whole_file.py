"""One whole file of a Hub repository (the ~10 GB prompt-enhancer checkpoints) into a folder of
the user's: by range reads into ``<dest>.<etag>.part``, resumed from where an interruption or a
Cancel left it (the same on every ``huggingface_hub`` version, since only its metadata call,
headers and session are used) after the bytes already there were re-read and checked against
the part's ledger (``part_file.Ledger``), one fetch per file at a time, and renamed into place only
when its size and, for LFS files (the Hub's ETag is then their sha256), the sha256 of its bytes
match the Hub's: both of the bytes as received (the resumed ones as re-read) and of the file as
written.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import re

from . import part_file, transfer
from .hub_client import MIB, PART, FetchError, Interrupted, Progress, is_network_error, resolve, unreachable

log = logging.getLogger(__name__)

_SHA256 = re.compile(r"[0-9a-f]{64}")


def fetch_whole(repo: str, filename: str, dest: str, *, what: str, by_hand: str, progress: Progress | None = None,
                check: transfer.Check | None = None, revision: str = "main", retries: int = 3) -> str:
    """``dest``, downloaded first (from ``repo``'s ``filename``) if absent.

    ``progress(done, total)`` is called at every MiB and ``check()`` at least every
    ``hub_client.TICK`` seconds; what either raises stops the download with its ``.part`` kept, and
    the next call resumes it. A finished download whose size or sha256 differs from the Hub's is
    removed (FetchError saying to run again).
    """
    if os.path.isfile(dest):
        return dest
    os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
    with transfer.locked(dest, check):
        if os.path.isfile(dest):
            log.info("%s was fetched by another download meanwhile; using it", dest)
            return dest
        try:
            remote = resolve(repo, filename, revision)
        except (FetchError, Interrupted) as exc:
            if isinstance(exc, FetchError):
                raise
            raise unreachable(what, exc, by_hand) from exc
        except Exception as exc:
            if not is_network_error(exc):
                raise
            raise unreachable(what, exc, by_hand) from exc
        sha256 = remote.etag if _SHA256.fullmatch(remote.etag) else None
        part = f"{dest}.{re.sub(r'[^0-9A-Za-z]', '', remote.etag)[:16]}{PART}"
        for stale in glob.glob(glob.escape(dest) + ".*" + PART) + glob.glob(glob.escape(dest) + ".*" + PART +
                                                                           part_file.SUMS):
            if not stale.startswith(part) and not os.path.islink(stale):
                log.info("Removing %s: it belongs to another version of %s", stale, filename)
                part_file.remove(stale)
        ledger = part_file.Ledger(part)
        done = _resume(ledger, remote.size, check)
        if done:
            log.info("Resuming the download of %s at %.0f of %.0f MiB", what, done / MIB, remote.size / MIB)
        else:
            log.info("Downloading %s (%.0f MiB) into %s", what, remote.size / MIB, dest)
            ledger.start()
        if progress:
            progress(done, remote.size)
        transfer.copy_pieces(ledger, [transfer.Piece(remote, 0, remote.size, 0)], done, remote.size, what=what,
                             progress=progress, check=check, retries=retries)

        def verify(path: str) -> None:
            if os.path.getsize(path) != remote.size:
                raise FetchError(f"The download of {what} has {os.path.getsize(path)} bytes, the Hub says "
                                 f"{remote.size}; it was removed, run again.")
            if sha256 is None:
                return
            if ledger.sha256() != sha256:
                raise FetchError(f"The download of {what} does not match the Hub's sha256 (the bytes were damaged "
                                 f"on the way); it was removed, run again. If it repeats, fetch it by hand: {by_hand}")
            if _file_sha256(path, check) != sha256:  # the bytes on disk, not only those received
                raise FetchError(f"The file written for {what} differs from the bytes received, which matched the "
                                 "Hub's sha256 (written over while it was downloaded, or a failing disk); it was "
                                 "removed, run again.")

        transfer.finish(ledger, dest, verify)
    log.info("%s is ready in %s (%s)", filename, dest, "sha256 verified" if sha256 else "size verified")
    return dest


def _file_sha256(path: str, check: transfer.Check | None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(16 * MIB):
            digest.update(block)
            if check is not None:
                check()
    return digest.hexdigest()


def _resume(ledger: part_file.Ledger, size: int, check: transfer.Check | None) -> int:
    """Data bytes already in the part, re-read and checked against its ledger (0 after removing a
    part longer than the file)."""
    if part_file.part_exists(ledger.part) and os.path.getsize(ledger.part) > size:
        log.info("Discarding %s: longer than the file on the Hub", ledger.part)
        ledger.discard()
        return 0
    if part_file.part_exists(ledger.part):
        log.info("Checking the %.0f MiB already downloaded in %s", os.path.getsize(ledger.part) / MIB, ledger.part)
    return ledger.resume(check)
