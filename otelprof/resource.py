"""Resource detection: who is emitting (service, host, process, rank, Determined trial).

Set once per process so every metric point and span carries the same identity, which is
what lets the collector, Prometheus and the Determined bridge group data by host, rank and
trial without otelprof coordinating ranks itself.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

from opentelemetry.sdk.resources import Resource

from otelprof._schema import (
    ATTR_ATTEMPT,
    ATTR_DETERMINED_AGENT_ID,
    ATTR_DETERMINED_DIRECT,
    ATTR_DETERMINED_EXPERIMENT_ID,
    ATTR_DETERMINED_STEPS_COMPLETED,
    ATTR_DETERMINED_TRIAL_ID,
    ATTR_DETERMINED_TRIAL_RUN_ID,
    ATTR_LOCAL_RANK,
    ATTR_RANK,
    ATTR_RUN_ID,
    ATTR_STEPS_PER_BATCH,
    ATTR_WORLD_SIZE,
)
from otelprof.config import Settings

# environment variable -> resource attribute (an integer when the value is one)
_RANK_ENV = {
    "RANK": ATTR_RANK,
    "LOCAL_RANK": ATTR_LOCAL_RANK,
    "WORLD_SIZE": ATTR_WORLD_SIZE,
    # which restart of an elastic job (torchrun --max-restarts): attempts are kept apart
    "TORCHELASTIC_RESTART_COUNT": ATTR_ATTEMPT,
}
# Settings field (checked with the options: config.py) -> resource attribute
_DETERMINED_IDS = {
    "determined_experiment_id": ATTR_DETERMINED_EXPERIMENT_ID,
    "determined_trial_id": ATTR_DETERMINED_TRIAL_ID,
    "determined_trial_run_id": ATTR_DETERMINED_TRIAL_RUN_ID,
    # A resumed trial's batch count: otelprof's Determined timings count on from it.
    "determined_steps_completed": ATTR_DETERMINED_STEPS_COMPLETED,
    "determined_steps_per_batch": ATTR_STEPS_PER_BATCH,
}


def build_resource(settings: Settings, env: Mapping[str, str] | None = None) -> Resource:
    """The process's resource: ranks and the Determined agent from `env`, Determined's other
    ids from the settings; explicit settings win. A single process is rank 0 of world size 1,
    so queries can always group by rank.
    """
    env = os.environ if env is None else env
    host = socket.gethostname()
    pid = os.getpid()
    attributes: dict[str, str | int] = {
        "host.name": host,
        "process.pid": pid,
        "service.instance.id": f"{host}:{pid}",
        ATTR_RUN_ID: settings.run_id,
        ATTR_RANK: 0,
        ATTR_LOCAL_RANK: 0,
        ATTR_WORLD_SIZE: 1,
    }
    for variable, key in _RANK_ENV.items():
        if value := env.get(variable):
            try:
                attributes[key] = int(value)
            except ValueError:
                attributes[key] = value
    if agent := env.get("DET_AGENT_ID"):
        attributes[ATTR_DETERMINED_AGENT_ID] = agent
    for name, key in _DETERMINED_IDS.items():
        if (value := getattr(settings, name)) is not None:
            attributes[key] = value
    attributes.update(settings.resource_attributes)
    attributes["service.name"] = settings.service_name
    if settings.determined:
        # This process posts to Determined itself: a bridge must not post its data again.
        attributes[ATTR_DETERMINED_DIRECT] = "true"
    # Resource.create also adds telemetry.sdk.* and reads OTEL_RESOURCE_ATTRIBUTES; the
    # attributes passed here take precedence over what it detects.
    return Resource.create(attributes)
