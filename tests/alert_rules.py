"""otelprof's alerting rules as tests load them: prometheus/alerts.py (the renderer, for
thresholds other than the shipped ones) and the rules of a rendered file."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.services import REPO

ALERTS_SCRIPT = REPO / "prometheus" / "alerts.py"
RULES_FILE = REPO / "prometheus" / "otelprof-alerts.yml"


def alerts_module() -> Any:
    """prometheus/alerts.py, imported from its path (prometheus/ is no package)."""
    spec = importlib.util.spec_from_file_location("otelprof_alerts", ALERTS_SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def rules(text: str) -> dict[str, dict[str, Any]]:
    """{alert name: rule} of a rendered rule file's one group."""
    (group,) = yaml.safe_load(text)["groups"]
    return {rule["alert"]: rule for rule in group["rules"]}


def shipped_rules(path: Path = RULES_FILE) -> dict[str, dict[str, Any]]:
    return rules(path.read_text())
