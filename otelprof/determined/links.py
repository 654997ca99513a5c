"""A Determined trial's link to its Grafana view, written into its experiment's notes.

The Web UI has no Grafana link of its own (reference §6); an experiment's notes are the one
thing of the master's it renders as Markdown (reference §0.1). Notes are replaced whole by
every write and the master has no compare-and-swap, so the link is one marked list item per
trial merged into the notes as they are: read, merge, write, read back, look again.

Written only by the process of global rank 0 (it knows the job's service, run id and start,
and holds `grafana_url`; one writer per trial), never by the bridge; on a thread of its
own, never raising into training; failures are retried or given up, logged once and
counted (`determined.grafana_link_errors`).
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass, field
from typing import Any
from urllib.parse import quote, urlencode

from otelprof._schema import ATTR_DETERMINED_EXPERIMENT_ID, ATTR_DETERMINED_TRIAL_ID, ATTR_RUN_ID
from otelprof.determined.classify import Outcome, PostResult
from otelprof.determined.client import ConfigError, Credentials, DeterminedClient

log = logging.getLogger("otelprof.determined")

TRAINING_DASHBOARD_UID = "otelprof-training"
"""dashboards/otelprof-training.json's uid (tests/test_determined_grafana_link.py checks)."""


def dashboard_url(
    grafana_url: str,
    *,
    service: str,
    run_id: str,
    trial_id: int,
    determined_url: str,
    since_ms: int,
) -> str:
    """The training dashboard with this job's variables set (service, job, trial, and the
    Determined URL its link back to the trial uses), from the job's start until now."""
    query = urlencode(
        [
            ("var-service", service),
            ("var-run", run_id),
            ("var-trial", str(trial_id)),
            ("var-determined", determined_url),
            ("from", str(since_ms)),
            ("to", "now"),
        ],
        quote_via=quote,
    )
    return f"{grafana_url}/d/{TRAINING_DASHBOARD_UID}?{query}"


def _prefix(trial_id: int) -> str:
    return f"- [otelprof: trial {trial_id} in Grafana]("


def has_link(notes: str, trial_id: int, run_id: str) -> bool:
    """Whether `notes` link this trial to this job's view (any rank of the job, or an earlier
    process of it, may have written it: the job's run id, not the exact URL, says so)."""
    prefix, run = _prefix(trial_id), f"var-run={quote(run_id, safe='')}&"
    return any(line.startswith(prefix) and run in line for line in notes.splitlines())


def notes_with_link(notes: str, trial_id: int, url: str) -> str:
    """`notes` with this trial's link line: replaced where it is (a restarted trial's new
    run), appended as a list item otherwise; every other line kept as it was."""
    prefix = _prefix(trial_id)
    line = f"{prefix}{url})"
    out: list[str] = []
    placed = False
    for existing in notes.splitlines():
        if existing.startswith(prefix):
            if not placed:
                out.append(line)
                placed = True
            continue  # a duplicate of this trial's line
        out.append(existing)
    if not placed:
        if out and out[-1].strip() and not out[-1].startswith("- [otelprof: trial "):
            out.append("")  # a paragraph of its own below the user's text
        out.append(line)
    return "\n".join(out) + "\n"


@dataclass(eq=False)
class TrialLink:
    """Writes one trial's link into its experiment's notes, on its own thread."""

    client: DeterminedClient
    trial_id: int
    run_id: str
    url: str
    experiment_id: int | None = None
    _: KW_ONLY
    attempts: int = 8
    retry_initial_s: float = 0.5
    retry_max_s: float = 30.0
    # After the link is in, look again after each of these delays and write it again if it
    # is gone (the master has no compare-and-swap: a writer that read the notes before our
    # PATCH, another trial's process or a user, may replace them after we read our write back).
    recheck_s: tuple[float, ...] = (2.0, 10.0, 60.0)
    done: threading.Event = field(default_factory=threading.Event, init=False)
    linked: bool = field(default=False, init=False)
    errors: int = field(default=0, init=False)
    _stop: threading.Event = field(default_factory=threading.Event, init=False)

    def start(self) -> TrialLink:
        threading.Thread(target=self._run, name="otelprof-trial-link", daemon=True).start()
        return self

    def stats(self) -> dict[str, int]:
        return {
            "determined.grafana_link_set": int(self.linked),
            "determined.grafana_link_errors": self.errors,
        }

    def close(self) -> None:
        """Stop retrying (shutdown): never waits for a request in flight, which ends on
        its own timeout on this daemon thread."""
        self._stop.set()

    def _run(self) -> None:
        try:
            if self._write():
                for delay in self.recheck_s:
                    if self._stop.wait(delay) or not self._write():
                        break
        except Exception as error:  # a bug here must not end anything but this thread
            self.errors += 1
            log.warning("Determined: linking trial %d to Grafana failed: %r", self.trial_id, error)
        finally:
            self.client.close()  # written once: the client is not needed any more
            self.done.set()

    def _write(self) -> bool:
        """Attempts until the link is in the notes (True), the master refuses, the
        attempts run out or shutdown stops it (False)."""
        delay = self.retry_initial_s
        last = ""
        for _attempt in range(self.attempts):
            if self._stop.is_set():
                return False
            result = self.write_once()
            if result is None:
                return True  # set (or found set)
            self.errors += 1
            last = f"HTTP {result.status} {result.message}" if result.status else result.message
            if result.outcome is Outcome.REJECTED:
                log.warning(
                    "Determined: not linking trial %d to Grafana: the master refused (%s)",
                    self.trial_id,
                    last,
                )
                return False
            log.debug("Determined: trial %d's Grafana link: %s; retrying", self.trial_id, last)
            if self._stop.wait(delay * random.uniform(0.5, 1.0)):
                return False
            delay = min(delay * 2, self.retry_max_s)
        log.warning(
            "Determined: gave up linking trial %d to Grafana after %d attempts (last: %s)",
            self.trial_id,
            self.attempts,
            last,
        )
        return False

    def write_once(self) -> PostResult | None:
        """One read, merge, write, read back. None when the link is in the notes; else why
        not (a concurrent writer's PATCH that overwrote ours is retried like a 503)."""
        if self.experiment_id is None:
            try:
                self.experiment_id = self.client.trial_experiment(self.trial_id)
            except Exception as error:  # the master cannot answer: try again later
                return PostResult(
                    Outcome.RETRY, None, f"asking for the trial's experiment: {error}"
                )
            if self.experiment_id is None:
                return PostResult(Outcome.REJECTED, 404, f"trial {self.trial_id} not found")
        result, notes = self.client.experiment_notes(self.experiment_id)
        if notes is None:
            return result
        if not has_link(notes, self.trial_id, self.run_id):
            wanted = notes_with_link(notes, self.trial_id, self.url)
            result = self.client.set_experiment_notes(self.experiment_id, wanted)
            if result.outcome is not Outcome.OK:
                return result
            result, notes = self.client.experiment_notes(self.experiment_id)
            if notes is None:
                return result
            if not has_link(notes, self.trial_id, self.run_id):
                return PostResult(Outcome.RETRY, None, "another writer replaced the notes")
        if not self.linked:
            log.info(
                "Determined: experiment %d's notes link trial %d to Grafana: %s",
                self.experiment_id,
                self.trial_id,
                self.url,
            )
        self.linked = True
        return None


def start_trial_link(
    grafana_url: str,
    resource: Mapping[str, Any],
    *,
    add_stats: Callable[[Callable[[], dict[str, int]]], None],
    add_closer: Callable[[Callable[[], None]], None],
    env: Mapping[str, str] | None = None,
    timeout_s: float = 10.0,
) -> TrialLink | None:
    """Start linking this process's Determined trial (resource `determined.trial.id`) to
    the training dashboard at `grafana_url`, with the master and credentials of the
    Determined task environment (DET_MASTER, DET_USER_TOKEN / DET_SESSION_TOKEN, ...).
    None outside a Determined trial; a trial without a master or credentials is logged and
    counted, never raised."""
    env = os.environ if env is None else env
    trial = _int(resource.get(ATTR_DETERMINED_TRIAL_ID))
    if trial is None:
        log.debug("otelprof: grafana_url is set but this is no Determined trial: no link")
        return None
    master, credentials = env.get("DET_MASTER"), Credentials.from_env(env)
    try:
        if not master or not credentials.has_any():
            raise ConfigError(
                "no master or credentials (DET_MASTER, DET_USER_TOKEN or DET_SESSION_TOKEN)"
            )
        client = DeterminedClient.in_task(master, credentials, env, timeout_s=timeout_s)
    except ConfigError as error:  # a missing CA bundle, a master URL of another scheme
        log.warning("Determined: not linking trial %d to Grafana: %s", trial, error)
        add_stats(lambda: {"determined.grafana_link_set": 0, "determined.grafana_link_errors": 1})
        return None
    run_id = str(resource.get(ATTR_RUN_ID, ""))
    url = dashboard_url(
        grafana_url,
        service=str(resource.get("service.name", "")),
        run_id=run_id,
        trial_id=trial,
        determined_url=client.master,
        since_ms=int((time.time() - 60) * 1000),
    )
    experiment = _int(resource.get(ATTR_DETERMINED_EXPERIMENT_ID))
    link = TrialLink(client, trial, run_id, url, experiment)
    add_stats(link.stats)
    add_closer(link.close)
    return link.start()


def _int(value: Any) -> int | None:
    try:
        return None if value is None or isinstance(value, bool) else int(value)
    except (TypeError, ValueError):
        return None
