"""Who may send OTLP to the bridge, and into which trials: bearer tokens with scopes.

Tokens come from an owner-only file, one per line with its scope (`trial=ID`,
`experiment=ID`, `*`, or none for the `--allow-*` default; format and examples in
docs/operations/determined-bridge.md). Tokens are kept only as SHA-256 digests and compared
in constant time. A trial's experiment is asked of the master (`GET /api/v1/trials/{id}`,
cached), never taken from the producer's attributes, which could claim any experiment;
while the master cannot say, the request is answered UNAVAILABLE so the producer retries.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from otelprof.config import ConfigError

log = logging.getLogger("otelprof.determined")

MIN_TOKEN_CHARS = 16


@dataclass(frozen=True)
class Scope:
    """The trials a credential may write into; `everything` for the operator's collector."""

    trials: frozenset[int] = frozenset()
    experiments: frozenset[int] = frozenset()
    everything: bool = False

    def describe(self) -> str:
        if self.everything:
            return "any trial"
        parts = [f"trial={t}" for t in sorted(self.trials)]
        parts += [f"experiment={e}" for e in sorted(self.experiments)]
        return " ".join(parts) or "nothing"

    @classmethod
    def parse(cls, words: Iterable[str], where: str) -> Scope:
        trials: set[int] = set()
        experiments: set[int] = set()
        everything = False
        for word in words:
            if word == "*":
                everything = True
                continue
            kind, _, value = word.partition("=")
            if kind not in ("trial", "experiment") or not value.isdigit():
                raise ConfigError(f"{where}: scope {word!r} is not trial=ID, experiment=ID or *")
            (trials if kind == "trial" else experiments).add(int(value))
        return cls(frozenset(trials), frozenset(experiments), everything)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class IngestTokens:
    """Token → scope, looked up by digest (the tokens themselves are not kept)."""

    def __init__(self, scopes: dict[str, Scope], labels: dict[str, str] | None = None) -> None:
        """`labels`: how a log line names each token (never the token itself)."""
        if not scopes:
            raise ConfigError("no ingest token: the bridge accepts OTLP only from token holders")
        for token in scopes:
            if len(token) < MIN_TOKEN_CHARS:
                raise ConfigError(
                    f"an ingest token is {len(token)} characters; use at least "
                    f"{MIN_TOKEN_CHARS} random ones (`otelprof determined-bridge --new-token`)"
                )
        self._scopes = {_digest(t): s for t, s in scopes.items()}
        self._labels = {
            _digest(t): (labels or {}).get(t) or f"ingest token #{i}"
            for i, t in enumerate(scopes, 1)
        }

    def describe(self, credential: bytes) -> str:
        """Which token a credential is, for a log line: where it was read, not what it is."""
        return self._labels.get(credential, "an unknown token")

    @classmethod
    def from_file(cls, path: str, default: Scope | None = None) -> IngestTokens:
        """Read a token file (see the module docstring); refused, like ssh's private keys,
        if others may read or write it."""
        try:
            info = os.stat(path)
        except OSError as exc:
            raise ConfigError(f"cannot read ingest token file {path}: {exc.strerror}") from None
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"ingest token file {path} is not a regular file")
        if info.st_mode & 0o077:
            raise ConfigError(
                f"ingest token file {path} has mode {stat.S_IMODE(info.st_mode):04o}: it is open "
                f"to other users; run `chmod 600 {path}` (secrets must be readable by their owner "
                "only)"
            )
        scopes: dict[str, Scope] = {}
        labels: dict[str, str] = {}
        for number, line in enumerate(Path(path).read_text().splitlines(), 1):
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            where = f"{path} line {number}"
            scope = Scope.parse(words[1:], where)
            if len(words) == 1:
                if default is None or not (default.trials or default.experiments):
                    raise ConfigError(
                        f"{where}: the token has no scope; add trial=ID, experiment=ID or * "
                        "to the line, or pass --allow-trial/--allow-experiment"
                    )
                scope = default
            scopes[words[0]] = scope
            labels[words[0]] = f"the token on line {number} of {path}"
        return cls(scopes, labels)

    def scope_of(self, metadata: Iterable[tuple[str, str | bytes]]) -> tuple[bytes, Scope] | None:
        """(the token's digest, its scope), or None when the request has no valid token."""
        for key, value in metadata:
            if key.lower() != "authorization" or not isinstance(value, str):
                continue
            kind, _, token = value.strip().partition(" ")
            if kind.lower() != "bearer" or not token.strip():
                return None
            wanted = _digest(token.strip())
            found = None
            for digest, scope in self._scopes.items():  # compare every one, in constant time
                if hmac.compare_digest(digest, wanted):
                    found = (digest, scope)
            return found
        return None


def new_token() -> str:
    """A fresh random ingest token (256 bits, URL-safe: fits OTEL_EXPORTER_OTLP_HEADERS)."""
    return secrets.token_urlsafe(32)


class NotKnownYet(Exception):
    """The master could not say which experiment a trial belongs to (retry later)."""


class ScopeChecker:
    """Decides whether a scope may write into a trial; remembers trials' experiments."""

    def __init__(
        self, experiment_of: Callable[[int], int | None], max_cached: int = 100_000
    ) -> None:
        """`experiment_of(trial)`: the trial's experiment per the master; None: no such
        trial; raises when the master cannot be asked."""
        self._experiment_of = experiment_of
        self._cache: OrderedDict[int, int | None] = OrderedDict()
        self._lock = threading.Lock()
        self.max_cached = max_cached

    def allows(self, scope: Scope, trial: int) -> bool:
        if scope.everything or trial in scope.trials:
            return True
        if not scope.experiments:
            return False
        return self.experiment(trial) in scope.experiments

    def experiment(self, trial: int) -> int | None:
        with self._lock:
            if trial in self._cache:
                self._cache.move_to_end(trial)
                return self._cache[trial]
        try:
            experiment = self._experiment_of(trial)
        except Exception as exc:
            raise NotKnownYet(f"cannot ask the master which experiment trial {trial} is in: "
                              f"{exc}") from None  # fmt: skip
        if experiment is None:
            return None  # no such trial (yet): asked again next time, not remembered
        with self._lock:
            self._cache[trial] = experiment
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return experiment


@dataclass(frozen=True)
class IngestLimits:
    """What one request and all requests together may cost the bridge."""

    max_request_bytes: int = 4 * 1024 * 1024  # gRPC's own default; OTLP batches are smaller
    max_inflight_bytes: int = 32 * 1024 * 1024  # request bytes being parsed and mapped at once
    # Requests one credential may have in the bridge at once: with fewer than all workers,
    # one producer's flood leaves the other producers' requests a worker.
    max_per_credential: int = 2


@dataclass(frozen=True)
class TlsFiles:
    """The bridge's certificate and key (PEM), and for mutual TLS the CA of its clients."""

    cert: str
    key: str
    client_ca: str | None = None

    def credentials(self) -> Any:
        """grpc.ServerCredentials (grpc imported here: settings must not pay for it)."""
        import grpc

        try:
            cert, key = Path(self.cert).read_bytes(), Path(self.key).read_bytes()
            ca = Path(self.client_ca).read_bytes() if self.client_ca else None
        except OSError as exc:
            raise OSError(f"cannot read a TLS file: {exc}") from None
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
        )
