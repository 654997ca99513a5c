"""Append whole records to a run file, or nothing: the file never holds a partial line.

Why: a write that fails part-way (a full disk) would leave half a line or gzip member that
makes everything appended after it unreadable. `WholeRecordFile.append` writes one record
with unbuffered `os.write` calls and on failure truncates back to where it began (a failed
truncation is retried before the next append, which writes nothing until it succeeds).
Before each append the path must still name the opened file (device and inode): a run
directory deleted or replaced mid-run makes the file `GONE` once, never written again and
never recreated; the caller counts the losses (docs/guide/faults.md).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from otelprof._run import private_files

WRITTEN = "written"
WRITE_ERROR = "write_error"
GONE = "run_dir_gone"


class WholeRecordFile:
    """One append-only run file. Not thread-safe: its writer serializes appends."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._fd: int | None = None
        self._identity: tuple[int, int] | None = None
        self.size = 0
        """Bytes in the file up to its last whole record."""
        self._dirty = False
        self.gone = False
        self.last_error: OSError | None = None
        self.closed = False
        """Closed for good (`close()`); a file not opened yet is not closed."""

    def open(self) -> None:
        """Open (create) the file now; raises OSError (callers that must not fail catch it)."""
        if self._fd is not None:
            return
        if self.closed:
            raise OSError(errno.EBADF, "closed", str(self.path))
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
        fd = os.open(self.path, flags, private_files.file_mode_in(self.path.parent))
        stat = os.fstat(fd)
        self._fd = fd
        self._identity = (stat.st_dev, stat.st_ino)
        self.size = stat.st_size

    def _still_there(self) -> bool:
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            return False
        except OSError:  # cannot tell (a hung or failing file system): try the write
            return True
        return (stat.st_dev, stat.st_ino) == self._identity

    def append(self, data: bytes) -> str:
        """Write `data` whole: WRITTEN, WRITE_ERROR (nothing of it left in the file; see
        `last_error`) or GONE (the path no longer names this file: nothing written)."""
        if self.gone:
            return GONE
        try:
            self.open()
        except OSError as error:
            self.last_error = error
            if isinstance(error, FileNotFoundError):  # the run directory itself is gone
                self.gone = True
                return GONE
            return WRITE_ERROR
        assert self._fd is not None
        if not self._still_there():
            self.gone = True
            return GONE
        start = self.size
        if self._dirty and not self._truncate(start):
            return WRITE_ERROR
        view = memoryview(data)
        try:
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
        except OSError as error:
            self.last_error = error
            self._truncate(start)
            return WRITE_ERROR
        self.size = start + len(data)
        return WRITTEN

    def _truncate(self, size: int) -> bool:
        """Cut a partly written record off; remembered and retried if that fails too."""
        assert self._fd is not None
        try:
            os.ftruncate(self._fd, size)
        except OSError as error:
            self.last_error = error
            self._dirty = True
            return False
        self._dirty = False
        return True

    def loss_message(self, outcome: str, what: str) -> str:
        """The warning for `what` (spans, metric exports) lost to `outcome` (GONE, WRITE_ERROR)."""
        if outcome == GONE:
            return (
                f"otelprof: {self.path} was deleted or replaced (its run directory removed?); "
                f"later {what} are dropped and counted"
            )
        return (
            f"otelprof: writing {self.path} failed ({self.last_error}); the file is kept whole "
            f"(no partial line), lost {what} are counted, and writing resumes when it can"
        )

    def close(self) -> None:
        self.closed = True
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
