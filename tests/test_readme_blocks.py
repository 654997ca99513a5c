"""Every README code block runs as pasted, or says it is a fragment.

Python blocks run as scripts in an empty directory (those the other README tests already run,
`test_readme_example.py` and `test_readme_framework_examples.py`, are left to them); a block
that cannot run alone starts with a `# fragment: ...` line saying what it needs. Shell blocks
must parse (`bash -n`) and hold no `<placeholder>`, which a shell reads as a redirection.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```", re.S | re.M)
BLOCKS = [(m.group(2), textwrap.dedent(m.group(3))) for m in FENCE.finditer(README)]
# blocks run by test_readme_example.py and test_readme_framework_examples.py
RUN_ELSEWHERE = (
    "otelprof.set_epoch(epoch)",
    'otelprof.phase("validation")',
    "otelprof.step_work(samples=32",
    "OtelprofCallback(peak_flops=1e12)",
    "instrument_accelerator(accelerator, peak_flops=1e12)",
    "OtelprofTrainerCallback(peak_flops=1e12)",
)


def _ids(blocks: list[tuple[str, str]]) -> list[str]:
    return [re.sub(r"\W+", "_", code.strip().splitlines()[0])[:40] for _, code in blocks]


PYTHON = [
    b
    for b in BLOCKS
    if b[0] == "python"
    and not b[1].startswith("# fragment:")
    and not any(m in b[1] for m in RUN_ELSEWHERE)
]
SHELL = [b for b in BLOCKS if b[0] in ("sh", "bash")]


def test_the_readme_has_blocks_of_each_kind() -> None:
    assert len(PYTHON) >= 4 and len(SHELL) >= 4
    for marker in RUN_ELSEWHERE:
        assert sum(marker in code for lang, code in BLOCKS if lang == "python") == 1, marker


@pytest.mark.parametrize("code", [c for _, c in PYTHON], ids=_ids(PYTHON))
def test_readme_python_block_runs_as_pasted(code: str, tmp_path: Path) -> None:
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


@pytest.mark.parametrize("code", [c for _, c in SHELL], ids=_ids(SHELL))
def test_readme_shell_block_parses_and_has_no_placeholder_redirection(code: str) -> None:
    lines = [re.sub(r"(^|\s)#.*$", "", line) for line in code.splitlines()]
    unquoted = [re.sub(r"\"[^\"]*\"|'[^']*'", "", line) for line in lines]
    assert not [line for line in unquoted if re.search(r"<[^<>\s]*[ a-z][^<>]*>", line)], code
    done = subprocess.run(["bash", "-n"], input=code, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


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
