"""One writer per file, between threads and processes, with no lock file left behind.

``locked(dest)`` holds ``dest + LOCK`` for as long as its block runs; a second caller (thread or
process) waits, calling its ``check`` every ``TICK`` seconds (ComfyUI's Cancel). The lock file is
removed when the block ends in any way (success, error, Cancel): a model folder keeps no ``.lock``
files. A process killed while holding the lock leaves its file; the next holder takes it over (the
operating system dropped the lock with the process) and removes it at the end.

POSIX (``fcntl.flock``): the holder unlinks the file *before* it lets the lock go. A waiter that
had opened the file before the unlink then holds a lock on a file no longer at the path; it sees
that (the path is gone or names another file) and starts again. So at any moment at most one
caller holds a lock on the file the path names, and removing it never lets two writers in.
Elsewhere (Windows) ``filelock.FileLock`` is used: Windows cannot delete a file that another
process holds open, and filelock removes the file on release where no other process has it open.
A symbolic link at the lock path is refused (``O_NOFOLLOW``), never followed.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from .hub_client import TICK, FetchError

log = logging.getLogger(__name__)

LOCK = ".lock"
Check = Callable[[], None]  # called while waiting; raises (e.g. ComfyUI's interrupt) to stop waiting

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None


def lock_path(dest: str) -> str:
    """The lock file of ``dest``: beside it, ``<dest>.lock`` (present only while a writer holds it)."""
    return os.fspath(dest) + LOCK


@contextmanager
def locked(dest: str, check: Check | None = None, *, what: str | None = None) -> Iterator[None]:
    """Hold the lock of ``dest`` (waiting for another holder, ``check()`` every ``TICK`` seconds, whose
    exception stops the wait); the lock file is removed when the block ends. ``what`` names the
    work in the waiting log line (default: the file name). FetchError when the lock file cannot be
    created (a symbolic link there, a read-only folder)."""
    path = lock_path(dest)
    name = what or os.path.basename(os.fspath(dest))
    if fcntl is None:
        with _filelock(path, name, check):
            yield
        return
    fd = _acquire(path, name, check)
    try:
        yield
    finally:
        _release(path, fd)


def _open(path: str) -> int:
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        return os.open(path, flags, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP or os.path.islink(path):
            raise FetchError(f"{path} is a symbolic link; a lock file is never written through one. Delete the "
                             "link and run again.") from exc
        raise FetchError(f"Cannot create the lock file {path} ({exc.strerror or exc}); check that the folder "
                         "exists and is writable.") from exc


def _acquire(path: str, name: str, check: Check | None) -> int:
    waited = False
    while True:
        fd = _open(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise FetchError(f"Cannot lock {path} ({exc.strerror or exc}); the folder's filesystem may not "
                                 "support file locks.") from exc
            if not waited:
                log.info("Waiting for another writer of %s to finish", name)
                waited = True
            if check is not None:
                check()
            time.sleep(TICK)
            continue
        if _still_named(path, fd):
            return fd
        os.close(fd)  # the holder before us removed this file: take the lock on the one at the path now


def _still_named(path: str, fd: int) -> bool:
    """True when ``path`` still names the file open at ``fd`` (not removed or replaced)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False))
    except FileNotFoundError:
        return False


def _release(path: str, fd: int) -> None:
    try:
        os.unlink(path)  # while still locked: see the module docstring
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("Could not remove the lock file %s (%s)", path, exc)
    finally:
        os.close(fd)  # closing drops the flock


@contextmanager
def _filelock(path: str, name: str, check: Check | None) -> Iterator[None]:
    try:
        import filelock
    except ImportError as exc:
        raise FetchError("filelock is not installed (ComfyUI installs it): run 'python -m pip install filelock'."
                         ) from exc
    if os.path.islink(path):
        raise FetchError(f"{path} is a symbolic link; a lock file is never written through one. Delete the link "
                         "and run again.")
    lock = filelock.FileLock(path)
    waited = False
    while True:
        try:
            lock.acquire(timeout=TICK)
            break
        except filelock.Timeout:
            if not waited:
                log.info("Waiting for another writer of %s to finish", name)
                waited = True
            if check is not None:
                check()
    try:
        yield
    finally:
        lock.release()
