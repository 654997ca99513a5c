"""Files holding a user's data are the user's alone: owner-only directories and files.

Run data, reports, refused bodies and journaled samples carry a job's measurements, which
other users of a shared node could read under the usual umask. Run directories and
everything the Determined bridge and exporter write go through here: 0700/0600, or
0750/0640 when the operator asks for a shared directory (`shared_run_dir=True`, the
bridge's `--shared-spool`).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import IO

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600
SHARED_DIR = 0o750
SHARED_FILE = 0o640


def make_dir(path: str | os.PathLike[str], shared: bool = False) -> Path:
    """Create `path` (and missing parents) owner-only; tighten an existing one we own."""
    directory = Path(path)
    mode = SHARED_DIR if shared else PRIVATE_DIR
    directory.mkdir(mode=mode, parents=True, exist_ok=True)
    with contextlib.suppress(OSError):  # not ours (a shared parent): leave it be
        if directory.stat().st_uid == os.getuid():
            os.chmod(directory, mode)
    return directory


def file_mode(shared: bool = False) -> int:
    return SHARED_FILE if shared else PRIVATE_FILE


def file_mode_in(directory: str | os.PathLike[str]) -> int:
    """The mode for a new file in `directory`: as private as the directory (group-readable
    only in a directory `make_dir(shared=True)` made so), for writers that are handed a path,
    not the run's settings."""
    try:
        shared = bool(os.stat(directory).st_mode & 0o040)
    except OSError:
        shared = False
    return file_mode(shared)


def open_append(path: str | os.PathLike[str], shared: bool = False) -> IO[bytes]:
    """Open for appending, creating the file with an owner-only mode whatever the umask."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, file_mode(shared))
    return os.fdopen(fd, "ab")


def open_new(path: str | os.PathLike[str], shared: bool = False) -> IO[bytes]:
    """Open for writing from scratch (a temporary file about to be renamed into place)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, file_mode(shared))
    os.fchmod(fd, file_mode(shared))  # an older file of that name may have kept its mode
    return os.fdopen(fd, "wb")
