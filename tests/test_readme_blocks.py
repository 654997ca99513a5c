"""Every code block of the documentation (README.md and the site's pages) runs as pasted, or
says it is a fragment.

Python blocks run as scripts in an empty directory (those the other documentation tests
already run, `test_readme_example.py` and `test_readme_framework_examples.py`, are left to
them); a block that cannot run alone starts with a `# fragment: ...` line saying what it
needs. Shell blocks must parse (`bash -n`) and hold no `<placeholder>`, which a shell reads
as a redirection. YAML blocks must load.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.docs_pages import ROOT, Block, blocks

BLOCKS = blocks()
# blocks run by test_readme_example.py and test_readme_framework_examples.py
RUN_ELSEWHERE = (
    "otelprof.set_epoch(epoch)",
    'otelprof.phase("validation")',
    "otelprof.step_work(samples=32",
    "OtelprofCallback(peak_flops=1e12)",
    "instrument_accelerator(accelerator, peak_flops=1e12)",
    "OtelprofTrainerCallback(peak_flops=1e12)",
)

PYTHON = [
    b
    for b in BLOCKS
    if b.lang == "python"
    and not b.code.startswith("# fragment:")
    and not any(m in b.code for m in RUN_ELSEWHERE)
]
SHELL = [b for b in BLOCKS if b.lang in ("sh", "bash")]
YAML = [b for b in BLOCKS if b.lang == "yaml"]


def test_the_docs_have_blocks_of_each_kind() -> None:
    assert len(PYTHON) >= 4 and len(SHELL) >= 8 and len(YAML) >= 1
    for marker in RUN_ELSEWHERE:
        assert sum(marker in b.code for b in BLOCKS if b.lang == "python") == 1, marker
    pages = {b.page for b in BLOCKS}
    assert {"README.md", "docs/guide/timings.md", "docs/DEVELOPING.md"} <= pages, pages


@pytest.mark.parametrize("block", PYTHON, ids=[b.id for b in PYTHON])
def test_python_block_runs_as_pasted(block: Block, tmp_path: Path) -> None:
    code = block.code
    script = tmp_path / "block.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    for name in ("OTELPROF_OUTPUT_DIR", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTELPROF_ENDPOINT"):
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=400,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ignored" not in done.stderr, done.stderr[-3000:]  # no second instrument() ignored


@pytest.mark.parametrize("block", SHELL, ids=[b.id for b in SHELL])
def test_shell_block_parses_and_has_no_placeholder_redirection(block: Block) -> None:
    code = block.code
    lines = [re.sub(r"(^|\s)#.*$", "", line) for line in code.splitlines()]
    unquoted = [re.sub(r"\"[^\"]*\"|'[^']*'", "", line) for line in lines]
    assert not [line for line in unquoted if re.search(r"<[^<>\s]*[ a-z][^<>]*>", line)], code
    done = subprocess.run(["bash", "-n"], input=code, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("block", YAML, ids=[b.id for b in YAML])
def test_yaml_block_loads(block: Block) -> None:
    assert yaml.safe_load(block.code) is not None


def test_make_venv_says_what_it_does_and_lets_pip_show_progress(tmp_path: Path) -> None:
    # the quick start's first command: a fresh venv takes minutes, which must not be silent
    done = subprocess.run(
        ["make", "-n", "venv", f"VENV={tmp_path / 'venv'}"], cwd=ROOT, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    recipe = done.stdout
    assert "echo" in recipe and "several minutes" in recipe, recipe
    install = [line for line in recipe.splitlines() if "pip install" in line and "-e " in line]
    assert install and all(" -q" not in line for line in install), install
