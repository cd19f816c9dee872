"""Writing a download into place, never half-written: one fetch per destination at a time
(``file_lock.locked``: threads and processes wait for each other, no lock file is left behind), a
``.part`` file (never a symlink) appended by range reads whose every run of bytes is recorded in
its ledger (``part_file.Ledger``), so that the next call re-reads and checks what is there before
it resumes, and a rename only after the caller's verification passed (a part that fails it is
removed, with its ledger).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from .file_lock import LOCK, Check, locked
from .hub_client import MIB, TICK, Expired, FetchError, Interrupted, Progress, Remote, read_range, resolve
from .part_file import Ledger, open_part, part_exists

__all__ = ["CHUNK", "LOCK", "Check", "Ledger", "Piece", "copy_pieces", "finish", "locked", "open_part",
           "part_exists"]

log = logging.getLogger(__name__)

CHUNK = 16 * MIB           # bytes per range request (and per ledger line)


@dataclass
class Piece:
    """Bytes ``[start, end)`` of ``remote``, written at data offset ``out`` of the part file."""

    remote: Remote
    start: int
    end: int
    out: int


def copy_pieces(ledger: Ledger, pieces: list[Piece], done: int, total: int, *, what: str,
                progress: Progress | None = None, check: Check | None = None, retries: int = 3) -> None:
    """Append the data of ``pieces`` from data offset ``done`` to ``total`` to ``ledger``'s part file
    (whose first ``ledger.base`` bytes are not data), every byte added to the ledger and each range
    request's bytes sealed in it once written. A broken or mislabelled transfer is retried from the
    last byte written, up to ``retries`` times in a row without progress; an expired signed address
    is resolved again once per position (refused again before a byte arrives: FetchError naming
    the expired address). Whatever stops the copy leaves the part cut back to the bytes the ledger
    holds, so the next call resumes there."""
    part, base = ledger.part, ledger.base
    failures = 0
    renewed: dict[str, int] = {}  # file -> data offset at its last renewal
    cursor = [done]               # data bytes written and accounted for
    while cursor[0] < total:
        before = cursor[0]
        try:
            _copy_once(ledger, pieces, cursor, total, progress, check)
        except Interrupted as exc:
            if cursor[0] > before:
                failures = 0
            name = getattr(exc, "filename", None)
            if isinstance(exc, Expired):
                if renewed.get(name, -1) >= cursor[0]:
                    raise _still_expired(exc, what, part) from exc
                renewed[name] = cursor[0]
                _renew(pieces, exc)
                continue
            failures += 1
            if failures > retries:
                raise FetchError(f"The download of {what} broke off at {cursor[0] / MIB:.0f} of {total / MIB:.0f} "
                                 f"MiB ({exc}). Run again to resume from there ({os.path.basename(part)} is kept)."
                                 ) from exc
            log.warning("Download of %s interrupted (%s); resuming at %.0f MiB", what, exc, cursor[0] / MIB)
            _pause(min(2.0 ** failures, 8.0) * 0.25, check)
        finally:
            _truncate(part, base + cursor[0])
            ledger.seal()


def _copy_once(ledger: Ledger, pieces, cursor, total, progress, check) -> None:
    try:
        with open_part(ledger.part, append=True) as f:
            if f.tell() != ledger.base + cursor[0]:
                raise FetchError(f"{ledger.part} changed while it was being written; delete it and run again.")
            for piece in pieces:
                length = piece.end - piece.start
                if piece.out + length <= cursor[0]:
                    continue
                offset = cursor[0] - piece.out  # > 0 only for the piece an interruption cut
                while offset < length:
                    stop = min(length, offset + CHUNK)
                    for block in read_range(piece.remote, piece.start + offset, piece.start + stop, check):
                        f.write(block)
                        ledger.add(block)
                        before = cursor[0]
                        cursor[0] += len(block)
                        offset += len(block)
                        if progress and (cursor[0] // MIB != before // MIB or cursor[0] == total):
                            progress(cursor[0], total)
                    f.flush()
                    ledger.seal()
    except OSError as exc:  # the disk (read_range turns network errors into Interrupted)
        raise FetchError(f"Cannot write {ledger.part} ({exc.strerror or exc}); free some space on its disk and "
                         "run again to resume.") from exc


def _truncate(part: str, size: int) -> None:
    """Cut ``part`` back to the bytes accounted for (a block written only in part is dropped)."""
    if os.path.isfile(part) and not os.path.islink(part) and os.path.getsize(part) > size:
        with open(part, "r+b") as f:
            f.truncate(size)


def _renew(pieces: list[Piece], exc: Expired) -> None:
    """Resolve the files of ``pieces`` again (a fresh signed address); FetchError if one changed."""
    fresh: dict[str, Remote] = {}
    for piece in pieces:
        old = piece.remote
        if old.filename not in fresh:
            new = resolve(old.repo, old.filename, old.commit)
            if (new.etag, new.size) != (old.etag, old.size):
                raise FetchError(f"{old.repo}/{old.filename} changed on the Hub during the download; run again.")
            fresh[old.filename] = new
        piece.remote = fresh[old.filename]
    log.info("Download address expired (%s); resolved it again", exc)


def _still_expired(exc: Expired, what: str, part: str) -> FetchError:
    """The error for a signed address refused again right after it was resolved afresh."""
    return FetchError(f"The download of {what} was refused by the signed download address the Hub redirected to "
                      f"({exc}), again right after it was resolved afresh: the address expires before it can be "
                      "used. Check this machine's clock and any proxy between it and the Hub, then run again "
                      f"(what was downloaded is kept in {os.path.basename(part)}).")


def _pause(seconds: float, check: Check | None) -> None:
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        time.sleep(min(left, TICK))
        if check is not None:
            check()


def finish(ledger: Ledger, dest: str, verify: Callable[[str], None]) -> None:
    """``verify(part)`` (raising FetchError when wrong), then move the part to ``dest`` and drop its
    ledger; a part that fails is removed with its ledger, so the next run starts clean."""
    try:
        verify(ledger.part)
    except FetchError:
        ledger.discard()
        raise
    os.replace(ledger.part, dest)
    ledger.discard()
