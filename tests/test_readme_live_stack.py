"""The documentation's "Attached mode without Docker" (docs/operations/collector.md) runs word
for word, as far as it can here.

Its bash blocks are run, in order, in one shell, unchanged, inside a private network
namespace (`unshare -rn`: the fixed ports it names, 4317, 9091, 3200, 3000, collide with
nothing else on the machine, and everything is gone when the shell exits). `make collector`
and `make prometheus` run for real (the collector is cached, Prometheus is installed). What
cannot be had here, the two downloads (no network), is stood in for: `curl` and `tar` are
shell functions that only create the file `-o` names, and the `tempo` and `bin/grafana` they
would have unpacked are tests/readme_standins.py (a Tempo that
reads tempo/tempo.yaml as Tempo does and receives OTLP where it says; a Grafana that expands
dashboards/provisioning/ as Grafana does and asks both data sources for data). Then a small
job trains against the README's collector address, and the test checks Prometheus counted
every step, Tempo received every step span through the one collector started, and
Grafana's provisioned data sources point at live local services.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.alert_rules import shipped_rules
from tests.docs_pages import section
from tests.services import REPO

PAGE = "docs/operations/collector.md"
LINKED = ("Makefile", "scripts", "collector-config", "prometheus", "tempo", "dashboards")


def no_docker_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", section(PAGE, "Attached mode without Docker"), re.S)


def test_no_docker_path_pins_every_binary_it_asks_for() -> None:
    script = "\n".join(no_docker_blocks())
    downloads = re.findall(r"curl \S+ -o \S+ (\S+)", script)
    assert len(downloads) == 2, downloads
    tempo, grafana = downloads
    assert "/v2.10.8/tempo_2.10.8_linux_amd64.tar.gz" in tempo  # 3.x refuses tempo/tempo.yaml
    assert "grafana-13.1.3.linux-amd64.tar.gz" in grafana
    compose = (REPO / "compose.yaml").read_text()
    assert "grafana/tempo:2.10.8" in compose and "grafana/grafana:13.1.3" in compose
    assert "make collector" in script and "make prometheus" in script


def test_no_docker_path_starts_one_collector_with_the_tempo_exporter() -> None:
    script = "\n".join(no_docker_blocks())
    starts = [line for line in script.splitlines() if "--config collector-config/" in line]
    assert len(starts) == 1, starts
    before = script[: script.index(starts[0])]
    assert "OTELCOL_TRACES_EXPORTERS='[span_metrics, otlp_grpc/tempo]'" in before.splitlines()[-1]
    # Tempo is started before it, on the exporter's default address
    assert "tempo-2.10.8/tempo -config.file=tempo/tempo.yaml" in before
    assert "TEMPO_OTLP_GRPC_ENDPOINT=127.0.0.1:4417" in before


def _prepare(workdir: Path) -> None:
    for name in LINKED:
        (workdir / name).symlink_to(REPO / name)
    python = shlex.quote(sys.executable)
    for path, role in ((workdir / "tempo-bin", "tempo"), (workdir / "grafana-bin", "grafana")):
        path.write_text(f'#!/bin/sh\nexec {python} -m tests.readme_standins {role} "$@"\n')
        path.chmod(0o755)


STANDINS = r"""
set -euo pipefail
trap 'kill $(jobs -p) 2>/dev/null; wait 2>/dev/null' EXIT
# no network here: the downloads only create the files they name; unpacking puts the
# stand-ins where the archives would have put Tempo and Grafana
curl() { while [ $# -gt 0 ]; do [ "$1" = -o ] && : > "$2"; shift; done; }
tar() {
  local dir=. args="$*"
  while [ $# -gt 0 ]; do [ "$1" = -C ] && dir=$2; shift; done
  [ -d "$dir" ] || { echo "tar: $dir: no such directory" >&2; return 1; }
  case "$args" in
    *tempo.tar.gz*) [ ! -e "$dir/tempo" ] && cp tempo-bin "$dir/tempo" ;;
    *grafana.tar.gz*) mkdir -p "$dir/bin" && cp grafana-bin "$dir/bin/grafana" ;;
    *) echo "unexpected tar $args" >&2; return 1 ;;
  esac
}
"""


@pytest.mark.e2e
def test_no_docker_commands_run_as_written_and_the_stack_works(
    tmp_path: Path, collector_binary: Path, prometheus_binary: Path
) -> None:
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.fail("unshare (util-linux) is needed to run the README's fixed ports privately")
    workdir = tmp_path / "checkout"
    workdir.mkdir()
    _prepare(workdir)
    check = f"{shlex.quote(sys.executable)} -m tests.readme_standins check"
    script = STANDINS + "\n".join(no_docker_blocks()) + f"\n{check}\n"
    (workdir / "readme.sh").write_text(script)
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTELCOL_", "OTELPROF_"))}
    env.update(
        HOME=str(home),  # $HOME/.local/share/otelprof is this test's
        # the collector build cache stays where scripts/build-collector.sh put it
        OTELPROF_CACHE_DIR=str(collector_binary.parent),
        PATH=f"{prometheus_binary.parent}:{env.get('PATH', '')}",
        PYTHONPATH=str(REPO),
        CUDA_VISIBLE_DEVICES="",
    )
    result = subprocess.run(
        [unshare, "-rn", "bash", "-c", "ip link set lo up && exec bash readme.sh"],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["tempo_spans"]["step"] >= 30, report
    grafana = report["grafana"]
    assert grafana["datasources"] == {
        "prometheus": {"url": "http://127.0.0.1:9091", "status": 200},
        "tempo": {"url": "http://127.0.0.1:3200", "status": 200},
    }
    assert grafana["dashboards"] == ["otelprof-system.json", "otelprof-training.json"]
    assert report["alert_rules"] == sorted(shipped_rules()), report["alert_rules"]
    assert (home / ".local/share/otelprof/prometheus").is_dir()  # where the page said
