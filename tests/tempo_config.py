"""tempo/tempo.yaml as Tempo reads it with -config.expand-env=true (no Tempo binary here).

Tempo expands `${VAR}` and `${VAR:-default}` (drone/envsubst) before parsing the YAML; this
does the same for the forms the config uses, so tests check the values Tempo would get.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from tests.services import REPO

TEMPO_CONFIG = REPO / "tempo" / "tempo.yaml"
_REF = re.compile(r"\$\{(?P<name>[A-Z0-9_]+)(?::-(?P<default>[^}]*))?\}")


def variables(path: Path = TEMPO_CONFIG) -> dict[str, str | None]:
    """{variable: default (None when it has none)} of every reference in the config."""
    return {m["name"]: m["default"] for m in _REF.finditer(path.read_text())}


def expand(text: str, env: Mapping[str, str]) -> str:
    def value(match: re.Match[str]) -> str:
        name, default = match["name"], match["default"]
        if env.get(name):
            return env[name]
        if default is None:
            raise KeyError(f"tempo.yaml: ${{{name}}} has no default and is not set")
        return default

    return _REF.sub(value, text)


def load(env: Mapping[str, str] | None = None, path: Path = TEMPO_CONFIG) -> dict[str, Any]:
    """The config Tempo would run with under `env` (compose's defaults when empty)."""
    config = yaml.safe_load(expand(path.read_text(), env or {}))
    assert isinstance(config, dict)
    return config
