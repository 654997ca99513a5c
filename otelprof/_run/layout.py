"""Where one process's run lives on disk, computed once from its identity.

Why one object: file names built in several places drift apart. `RunLayout` is the only
code that names a run file; the files and their `.rank<N>`/`.pid<PID>`/`.attempt<K>`
suffixes: DEVELOPING.md, "Run directory (detached mode)". A process group that appears
later gives the process a new layout; `relocate_from` moves what the old one holds into it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from otelprof._run import private_files
from otelprof._run.claim import RunClaim, Taken, lock
from otelprof._run.relocate import Moved, move_lines
from otelprof.config import ConfigError, Settings

_log = logging.getLogger("otelprof")


@dataclass(frozen=True)
class RunLayout:
    """One process's files in its run directory (see the module doc)."""

    run_dir: Path
    world_size: int = 1
    rank: int | None = 0
    """None while the process's rank is not known (its files are named after `pid`)."""
    attempt: int | None = None
    pid: int | None = None
    """In the names: the rank is not known yet, or another live process holds its names."""
    compress: bool = False
    shared: bool = False
    """Group-readable directory and files (`shared_run_dir`), else owner-only."""

    @classmethod
    def of(
        cls,
        settings: Settings,
        *,
        world_size: int,
        rank: int,
        attempt: int | None,
        rank_known: bool,
    ) -> RunLayout:
        """The layout of a process whose identity says `world_size`, `rank` and `attempt`;
        `rank_known`: a launcher or a process group gave the rank (else, in a job of several
        ranks, it is a guess and the files are named after this pid until it is known)."""
        provisional = world_size > 1 and not rank_known
        return cls(
            run_dir=settings.run_dir,
            world_size=world_size,
            rank=None if provisional else rank,
            attempt=attempt,
            pid=os.getpid() if provisional else None,
            compress=settings.compress,
            shared=settings.shared_run_dir,
        )

    # -- names --------------------------------------------------------------------------

    @property
    def suffix(self) -> str:
        """ "", ".rank3", ".pid42", ".rank3.pid42" or ".rank3.attempt1"."""
        suffix = f".rank{self.rank}" if self.rank is not None and self.world_size > 1 else ""
        if self.pid is not None:
            suffix += f".pid{self.pid}"
        return suffix + (f".attempt{self.attempt}" if self.attempt else "")

    @property
    def files(self) -> dict[str, Path]:
        """{"metrics": path, "traces": path}: the data files."""
        ext = ".jsonl.gz" if self.compress else ".jsonl"
        return {kind: self.run_dir / f"{kind}{self.suffix}{ext}" for kind in ("metrics", "traces")}

    @property
    def run_info(self) -> Path:
        return self.run_dir / f"run{self.suffix}.json"

    @property
    def claim_file(self) -> Path:
        return self.run_dir / f".run{self.suffix}.claim"

    def own_files(self) -> RunLayout:
        """The same files named after this pid too: another live process holds these."""
        return dataclasses.replace(self, pid=os.getpid())

    # -- on disk ------------------------------------------------------------------------

    def make_dir(self) -> None:
        """Create the run directory (owner-only unless shared); ConfigError naming the
        directory and the reason if it cannot be."""
        try:
            private_files.make_dir(self.run_dir, self.shared)
        except OSError as error:
            raise ConfigError(
                f"output directory {str(self.run_dir.parent)!r}: cannot make the run directory "
                f"{str(self.run_dir)!r} ({error.strerror or error})"
            ) from None

    def claim(self, run_id: str, *, own_files_if_taken: bool = False) -> tuple[RunLayout, RunClaim]:
        """Make the run directory and claim these names for this process, held until the run
        ends (otelprof/_run/claim.py): (the layout claimed, its claim). Another live process
        holding them is a ConfigError naming it, or with `own_files_if_taken` (the names were
        a guess, or the process is past the point of raising) the claim of `own_files()`. Names
        that a finished or killed run left (run.json) are a ConfigError: a new run never
        writes into another's files."""
        self.make_dir()
        try:
            held = lock(self.claim_file, self.shared)
            try:
                self._refuse_reused(run_id)
            except BaseException:
                held.release(remove=held.created)
                raise
        except Taken as taken:
            if own_files_if_taken and self.pid is None:
                _log.info(
                    "otelprof: %s is being written by another live process (%s); this one "
                    "writes its own files (%s)",
                    self.run_info,
                    _who(taken.owner),
                    self.own_files().run_info.name,
                )
                return self.own_files().claim(run_id)
            raise ConfigError(
                f"run_id {run_id!r}: {str(self.run_dir)!r} is being written by another live "
                f"process ({_who(taken.owner)}, files {self.files['metrics'].name}, "
                f"{self.files['traces'].name}); a run's files have one writer: choose another "
                "run_id (or leave it unset for a fresh one)"
            ) from None
        except OSError as error:
            raise ConfigError(
                f"output directory {str(self.run_dir.parent)!r}: cannot claim the run's files "
                f"in {str(self.run_dir)!r} ({error.strerror or error})"
            ) from None
        held.write_owner({"pid": os.getpid(), "host.name": socket.gethostname(), "run_id": run_id})
        return self, held

    def _refuse_reused(self, run_id: str) -> None:
        """A run.json of these names that another run left (it finished, or the process
        that wrote it is gone) is a ConfigError: its files are never appended to nor its
        run.json rewritten. One a live process writes on another host (whose claim this
        host cannot see) is that process's: `Taken`."""
        if self.pid is not None:
            return  # named after this pid: no other run's
        try:
            info = json.loads(self.run_info.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return
        except (OSError, ValueError):
            info = {}  # unreadable: not ours to overwrite either
        if not isinstance(info, dict):
            info = {}
        found = info.get("resource")
        resource: dict[str, Any] = found if isinstance(found, dict) else {}
        if "finished_unix_nano" not in info and resource.get("process.pid") == os.getpid():
            return  # this process's own (a session before this one)
        if "finished_unix_nano" not in info and _writer_alive(info):
            raise Taken(
                {"pid": resource.get("process.pid"), "host.name": resource.get("host.name")}
            )
        raise ConfigError(
            f"run_id {run_id!r}: {str(self.run_dir)!r} already holds a run "
            f"({self.run_info.name}); a new run never writes into another's files: choose "
            "another run_id (or leave it unset for a fresh one), or move that run away"
        )

    def write_run_info(self, info: Mapping[str, Any]) -> None:
        """run.json, replaced whole (a temporary file renamed over it), owner-only; raises
        OSError (the caller counts and logs it: the closing record then tells the end)."""
        path = self.run_info
        tmp = path.with_name(f"run.tmp{os.getpid()}")
        try:
            with private_files.open_new(tmp, self.shared) as out:
                out.write((json.dumps(dict(info), indent=2, default=str) + "\n").encode())
            tmp.replace(path)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise

    def relocate_from(self, old: RunLayout, resource: Mapping[str, Any]) -> Moved:
        """Move what this process wrote under `old` (a provisional identity) into these
        files, relabelled with `resource`'s ranks, every line of every data file (plain or
        gzip'd); its old run.json goes (the new session's replaces it, keeping its start),
        and so does an old run directory left empty. Never raises: what could not be moved
        is counted in the result (`lost`, `error`)."""
        total = Moved()
        for kind, source in old.files.items():
            target = self.files[kind]
            if source == target or not source.exists():
                continue
            moved = move_lines(source, target, resource)
            total.lines += moved.lines
            total.lost += moved.lost
            total.error = moved.error or total.error
        if old.run_info != self.run_info:
            with contextlib.suppress(OSError):
                old.run_info.unlink()
        if old.run_dir != self.run_dir:
            with contextlib.suppress(OSError):
                old.run_dir.rmdir()  # only if empty: another process's files stay
        return total


def _who(owner: Mapping[str, Any]) -> str:
    pid, host = owner.get("pid"), owner.get("host.name")
    if pid is None:
        return "its claim names no owner"
    return f"pid {pid}" + (f" on {host}" if host and host != socket.gethostname() else "")


def _writer_alive(info: dict[str, Any]) -> bool:
    """Whether the process that wrote a run.json still runs (other hosts: assume it does)."""
    import psutil

    resource = info.get("resource")
    if not isinstance(resource, dict):
        return False
    pid = resource.get("process.pid")
    if resource.get("host.name") not in (None, socket.gethostname()):
        return True
    if not isinstance(pid, int) or not psutil.pid_exists(pid):
        return False
    started = info.get("started_unix_nano")
    try:  # a recycled pid started after the run did
        created_ns = int(psutil.Process(pid).create_time() * 1e9)
    except psutil.Error:
        return False
    return not isinstance(started, int) or created_ns <= started + 1_000_000_000
