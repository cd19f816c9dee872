"""The files a download or a conversion writes before the result is renamed into place, never
through a symbolic link (``O_NOFOLLOW``, ``O_EXCL``):

* ``open_part``: a download's ``.part`` file, kept after an interruption so that the next call
  resumes it;
* ``Ledger``: the sha256 of each run of data bytes written to such a part, in ``<part>.sums``
  (one line ``<end> <sha256 of data bytes [previous end, end)>`` per run, appended once the run's
  bytes are written), so that a resumed part's bytes are re-read and checked against what was
  received before any is trusted; ``Ledger.sha256`` is the digest of all data bytes, the resumed
  ones as re-read and checked, the new ones as received;
* ``create_unique``: a part file of a name no other writer uses (``<dest>.<pid>.<n>.part``, created
  exclusively), for writes that are never resumed (a conversion, a system prompt).
"""

from __future__ import annotations

import hashlib
import logging
import os

from .hub_client import MIB, PART, FetchError

log = logging.getLogger(__name__)

SUMS = ".sums"  # suffix of a part file's ledger
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)


def part_exists(part: str) -> bool:
    """True when a part file is there; FetchError when a symlink or anything but a regular file is."""
    if os.path.islink(part) or (os.path.lexists(part) and not os.path.isfile(part)):
        raise FetchError(f"{part} is a symbolic link or not a regular file; downloads never write through one. "
                         "Delete it and run again.")
    return os.path.isfile(part)


def _open(path: str, flags: int):
    part_exists(path)
    try:
        return os.open(path, flags | _NOFOLLOW, 0o644)
    except OSError as exc:
        if os.path.islink(path):
            raise FetchError(f"{path} is a symbolic link; downloads never write through one. Delete it and run "
                             "again.") from exc
        raise FetchError(f"Cannot write {path} ({exc.strerror or exc}); check the folder's permissions and free "
                         "space.") from exc


def open_part(part: str, append: bool):
    """``part`` opened for writing (appending or truncated); FetchError when it is a symlink or not a
    plain file (a download never writes through a link)."""
    fd = _open(part, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC))
    return os.fdopen(fd, "ab" if append else "wb")


def create_unique(dest: str, tries: int = 64) -> tuple[str, int]:
    """``(path, fd)`` of a new, empty part file for ``dest`` that no other writer uses, open for
    writing: ``<dest>.<pid>.<n>.part`` for the first ``n`` whose name is free (created with
    ``O_EXCL``, so an existing file or a planted symlink is skipped, never followed or reused).
    FetchError when the folder cannot be written."""
    for n in range(tries):
        path = f"{dest}.{os.getpid()}.{n}{PART}"
        try:
            return path, os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
        except FileExistsError:
            continue
        except OSError as exc:
            raise FetchError(f"Cannot create {path} ({exc.strerror or exc}); check that the folder exists, is "
                             "writable and has free space.") from exc
    raise FetchError(f"{tries} part-file names for {os.path.basename(dest)} in {os.path.dirname(dest) or '.'} are "
                     "taken by other files; remove the stale '.part' files there and run again.")


def remove(path: str) -> None:
    """Remove ``path`` (a part or a ledger; a symbolic link itself, never its target) if it is there."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


class Ledger:
    """The checked data of one resumable part file ``part`` whose first ``base`` bytes are a header."""

    def __init__(self, part: str, base: int = 0):
        self.part, self.base = part, base
        self.sums = part + SUMS
        self._total = hashlib.sha256()  # every data byte, in order
        self._run = hashlib.sha256()    # the data bytes since the last sealed line
        self._end = 0                   # data bytes covered by sealed lines
        self._pending = 0               # data bytes added since then

    def start(self, header: bytes = b"") -> None:
        """A fresh part: ``header`` written, no data, an empty ledger."""
        with open_part(self.part, append=False) as f:
            f.write(header)
        os.close(_open(self.sums, os.O_WRONLY | os.O_CREAT | os.O_TRUNC))
        self.__init__(self.part, self.base)

    def discard(self) -> None:
        remove(self.part)
        remove(self.sums)

    def add(self, block: bytes) -> None:
        """``block`` was written to the part after the bytes before it."""
        self._total.update(block)
        self._run.update(block)
        self._pending += len(block)

    def seal(self) -> None:
        """Record the sha256 of the data added since the last line (a no-op when there is none)."""
        if not self._pending:
            return
        end = self._end + self._pending
        fd = _open(self.sums, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd, f"{end} {self._run.hexdigest()}\n".encode("ascii"))
        finally:
            os.close(fd)
        self._end, self._pending, self._run = end, 0, hashlib.sha256()

    def sha256(self) -> str:
        """Hex sha256 of all data bytes: resumed ones as re-read and checked, new ones as received."""
        return self._total.hexdigest()

    def resume(self, check=None) -> int:
        """Data bytes of an existing part that match the ledger, re-read and checked run by run; the
        part is cut back to them (a run that differs from what was received, and everything after
        it, is dropped and fetched again). A part without a ledger is removed: its bytes cannot be
        checked. 0 when there is no part."""
        if not part_exists(self.part):
            part_exists(self.sums)  # a symbolic link there is refused, as at the part's path
            remove(self.sums)
            return 0
        if not part_exists(self.sums):
            log.info("Discarding %s: it has no record of the bytes received (%s), so they cannot be checked",
                     self.part, os.path.basename(self.sums))
            remove(self.part)
            return 0
        with open(self.sums, "rb") as f:
            lines = f.read().split(b"\n")[:-1]  # a line cut short by a crash has no newline: ignored
        size = os.path.getsize(self.part) - self.base
        kept_bytes = 0
        with open(self.part, "rb") as f:
            f.seek(self.base)
            for line in lines:
                run = _parse(line, self._end)
                if run is None or run[0] > size:
                    break
                digest, total = hashlib.sha256(), self._total.copy()
                left = run[0] - self._end
                while left > 0 and (block := f.read(min(left, 16 * MIB))):
                    digest.update(block)
                    total.update(block)
                    left -= len(block)
                    if check is not None:
                        check()
                if left or digest.hexdigest() != run[1]:
                    log.warning("%s: data bytes %d-%d differ from what was received; they are fetched again",
                                self.part, self._end, run[0] - 1)
                    break
                self._total, self._end = total, run[0]
                kept_bytes += len(line) + 1
        with open(self.part, "r+b") as f:
            f.truncate(self.base + self._end)
        with open(self.sums, "r+b") as f:
            f.truncate(kept_bytes)
        return self._end


def _parse(line: bytes, after: int) -> tuple[int, str] | None:
    """``(end, hex sha256)`` of a ledger line whose run ends after ``after``; None when malformed."""
    fields = line.split(b" ")
    if len(fields) != 2 or not fields[0].isdigit() or len(fields[1]) != 64:
        return None
    end, digest = int(fields[0]), fields[1].decode("ascii", "replace")
    return (end, digest) if end > after else None
