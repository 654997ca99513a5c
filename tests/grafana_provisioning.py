"""Grafana's provisioning files as Grafana reads them (no Grafana server here).

Grafana expands environment variables in provisioning files before parsing the YAML:
`$NAME` and `${NAME}` become the variable's value (empty when unset) and `$$` a literal `$`
(pkg/services/provisioning/values: os.Expand with `$$` kept). The tests use this to check
what compose's and README's environments make of dashboards/provisioning/.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from tests.services import REPO

PROVISIONING = REPO / "dashboards" / "provisioning"
DATASOURCES = PROVISIONING / "datasources" / "datasources.yaml"
PROVIDERS = PROVISIONING / "dashboards" / "dashboards.yaml"
_REF = re.compile(r"\$\$|\$\{(\w+)\}|\$(\w+)")


def variables(path: Path) -> set[str]:
    """The environment variables a provisioning file refers to."""
    return {m[1] or m[2] for m in _REF.finditer(path.read_text()) if m[0] != "$$"}


def expand(text: str, env: Mapping[str, str]) -> str:
    def value(match: re.Match[str]) -> str:
        if match[0] == "$$":
            return "$"
        return env.get(match[1] or match[2], "")

    return _REF.sub(value, text)


def load(path: Path, env: Mapping[str, str]) -> dict[str, Any]:
    """The provisioning file as Grafana would parse it under `env`."""
    loaded = yaml.safe_load(expand(path.read_text(), env))
    assert isinstance(loaded, dict)
    return loaded


def datasource_urls(env: Mapping[str, str]) -> dict[str, str]:
    """{datasource type: URL} under `env`."""
    return {d["type"]: d["url"] for d in load(DATASOURCES, env)["datasources"]}


def dashboards_path(env: Mapping[str, str]) -> str:
    (provider,) = load(PROVIDERS, env)["providers"]
    return str(provider["options"]["path"])
