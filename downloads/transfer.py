"""Writing a download into place, never half-written: one fetch per destination at a time (a
``filelock`` file beside it, so threads and processes wait for each other), a ``.part`` file
(never a symlink) appended by range reads and resumed by the next call, and a rename only after
the caller's verification passed (a part that fails it is removed).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from .hub_client import MIB, TICK, Expired, FetchError, Interrupted, Progress, Remote, read_range, resolve

log = logging.getLogger(__name__)

Check = Callable[[], None]  # called while waiting; raises (e.g. ComfyUI's interrupt) to cancel
LOCK = ".lock"
CHUNK = 16 * MIB           # bytes per range request


@dataclass
class Piece:
    """Bytes ``[start, end)`` of ``remote``, written at data offset ``out`` of the part file."""

    remote: Remote
    start: int
    end: int
    out: int


@contextmanager
def locked(dest: str, check: Check | None = None) -> Iterator[None]:
    """Hold the lock ``dest + '.lock'`` (waiting for another thread or process that holds it, with
    ``check`` called every ``TICK`` seconds), so that only one fetch of ``dest`` runs at a time."""
    try:
        import filelock
    except ImportError as exc:
        raise FetchError("filelock is not installed (ComfyUI installs it): run 'python -m pip install filelock'."
                         ) from exc
    lock = filelock.FileLock(dest + LOCK)
    waited = False
    while True:
        try:
            lock.acquire(timeout=TICK)
            break
        except filelock.Timeout:
            if not waited:
                log.info("Waiting for another download of %s to finish", os.path.basename(dest))
                waited = True
            if check is not None:
                check()
    try:
        yield
    finally:
        lock.release()


def part_exists(part: str) -> bool:
    """True when a part file is there; FetchError when a symlink or anything but a regular file is."""
    if os.path.islink(part) or (os.path.lexists(part) and not os.path.isfile(part)):
        raise FetchError(f"{part} is a symbolic link or not a regular file; downloads never write through one. "
                         "Delete it and run again.")
    return os.path.isfile(part)


def open_part(part: str, append: bool):
    """``part`` opened for writing (appending or truncated); FetchError when it is a symlink or not a
    plain file (a download never writes through a link)."""
    part_exists(part)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
    flags |= getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(part, flags, 0o644)
    except OSError as exc:
        raise FetchError(f"Cannot write {part} ({exc}); check the folder's permissions and free space.") from exc
    return os.fdopen(fd, "ab" if append else "wb")


def copy_pieces(part: str, base: int, pieces: list[Piece], done: int, total: int, *, what: str,
                progress: Progress | None = None, check: Check | None = None, retries: int = 3,
                on_block: Callable[[bytes], None] | None = None) -> None:
    """Append the data of ``pieces`` from data offset ``done`` to ``total`` to ``part`` (whose first
    ``base`` bytes are not data). A broken or mislabelled transfer is retried from the last byte
    written, up to ``retries`` times in a row without progress; an expired signed address is
    resolved again once per position (refused again before a byte arrives: FetchError naming the
    expired address). ``on_block`` sees every data byte written, in order."""
    failures = 0
    renewed: dict[str, int] = {}  # file -> data offset at its last renewal
    cursor = [done]               # data bytes written and accounted for
    while cursor[0] < total:
        before = cursor[0]
        try:
            _copy_once(part, base, pieces, cursor, total, progress, check, on_block)
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


def _copy_once(part, base, pieces, cursor, total, progress, check, on_block) -> None:
    with open_part(part, append=True) as f:
        if f.tell() != base + cursor[0]:
            raise FetchError(f"{part} changed while it was being written; delete it and run again.")
        for piece in pieces:
            length = piece.end - piece.start
            if piece.out + length <= cursor[0]:
                continue
            offset = cursor[0] - piece.out  # > 0 only for the piece an interruption cut
            while offset < length:
                stop = min(length, offset + CHUNK)
                for block in read_range(piece.remote, piece.start + offset, piece.start + stop, check):
                    f.write(block)
                    if on_block is not None:
                        on_block(block)
                    before = cursor[0]
                    cursor[0] += len(block)
                    offset += len(block)
                    if progress and (cursor[0] // MIB != before // MIB or cursor[0] == total):
                        progress(cursor[0], total)
                f.flush()


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


def finish(part: str, dest: str, verify: Callable[[str], None]) -> None:
    """``verify(part)`` (raising FetchError when wrong), then move ``part`` to ``dest``; a part that
    fails is removed, so the next run starts clean."""
    try:
        verify(part)
    except FetchError:
        os.remove(part)
        raise
    os.replace(part, dest)
