"""One live writer per run file name: a claim file, locked for as long as its run is written.

Why: two processes started with one run id (a resubmitted job, a copied launch script)
would write into the same files and the report would add the runs up. A process takes an
exclusive `flock` on the claim file beside the run's files (`RunLayout.claim_file`) before
writing them; the kernel decides at once, on every host that shares the file system and
forwards locks (NFS does), and a killed process's lock is free again at once (the layout's
reuse check then decides about its files). The claim file holds the owner (pid, host,
start) so that a refused process can say who has the run.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from otelprof._run import private_files

_log = logging.getLogger("otelprof")

OWNER_WAIT_S = 1.0
"""How long a refused process waits to read who holds the claim (for its error message)."""
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
"""flock errors of file systems that keep no locks (some FUSE and old NFS mounts)."""


class Taken(Exception):
    """Another live process holds the claim; `owner` is what its claim file says."""

    def __init__(self, owner: dict[str, Any]) -> None:
        super().__init__(owner)
        self.owner = owner


class RunClaim:
    """A held claim: the locked claim file's descriptor. `release()` removes the file and
    lets the lock go (idempotent); a process that dies lets it go too."""

    def __init__(self, path: Path, fd: int | None, created: bool) -> None:
        self.path = path
        self._fd = fd
        self.created = created
        """This claim made the file (a refused start removes it again)."""

    @property
    def locked(self) -> bool:
        return self._fd is not None

    def write_owner(self, owner: dict[str, Any]) -> None:
        """Say who holds the claim (read by a process that is refused)."""
        if self._fd is None:
            return
        data = json.dumps(owner).encode()
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, data, 0)

    def release(self, remove: bool = True) -> None:
        """Let the claim go; `remove`: delete the claim file first (while still locked, so
        nobody locks a file that is about to vanish: `lock` checks the path after locking)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        if remove:
            with contextlib.suppress(OSError):
                self.path.unlink()
        os.close(fd)


def lock(path: Path, shared: bool = False) -> RunClaim:
    """Claim `path` for this process: a RunClaim, or `Taken` if a live process holds it. On a
    file system without locks the claim is unlocked (logged once): one writer per name is then
    not enforced, and the report flags two processes that claim one rank."""
    for _ in range(16):  # another process may remove the file between our open and our lock
        created = True
        try:
            fd = os.open(path, _FLAGS | os.O_CREAT | os.O_EXCL, private_files.file_mode(shared))
        except FileExistsError:
            created = False
            try:
                fd = os.open(path, _FLAGS)
            except FileNotFoundError:
                continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _read_owner(fd)
            os.close(fd)
            raise Taken(owner) from None
        except OSError as error:
            if error.errno not in _NO_LOCKS:
                os.close(fd)
                raise
            _log.warning(
                "otelprof: %s keeps no file locks (%s); two processes started with one run id "
                "would not be stopped from writing the same files here",
                path.parent,
                error.strerror,
            )
            os.close(fd)
            return RunClaim(path, None, created)
        if _names(path, fd):
            return RunClaim(path, fd, created)
        os.close(fd)  # locked a file its holder removed on release: take the new one
    raise OSError(errno.EAGAIN, "the claim file keeps changing", str(path))


_FLAGS = os.O_RDWR | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)


def _names(path: Path, fd: int) -> bool:
    """Whether `path` still names the file `fd` has open."""
    try:
        now, held = os.stat(path, follow_symlinks=False), os.fstat(fd)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


def _read_owner(fd: int) -> dict[str, Any]:
    """What the claim's holder wrote in it; a holder that has just locked it writes it a
    moment later (after its reuse check), so an empty file is read again for a while."""
    deadline = time.monotonic() + OWNER_WAIT_S
    while True:
        try:
            data = os.pread(fd, 4096, 0)
        except OSError:
            return {}
        if data or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    try:
        owner = json.loads(data or b"{}")
    except ValueError:
        return {}
    return owner if isinstance(owner, dict) else {}
