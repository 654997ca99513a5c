"""The README's picture of a report: what `otelprof report` prints for a fixed run, today.

The run is written by the test suite's generator through the real detached writer
(`tests/run_generators.write_sdk_run`: the OpenTelemetry SDK's exporters, fixed timestamps,
seeded durations), a data loader slow enough to be the verdict, and a clean end in run.json.
The report is the real CLI's text at a fixed width. `tests/test_readme_report.py` checks
that the README holds exactly this text, so the picture cannot drift from the report.

    python3 scripts/readme_report.py            # print the README's block
    python3 scripts/readme_report.py --write    # put it into README.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.run_generators import T0_NS, RunSpec, write_sdk_run  # noqa: E402

README = ROOT / "README.md"
START, END = "<!-- --8<-- [start:report] -->\n", "<!-- --8<-- [end:report] -->"
WIDTH = 126
RUN = RunSpec(steps=40, slow_dataloader_s=0.08, service="resnet")


def report_text() -> str:
    """`otelprof report RUN --width 126` of the fixed run, trailing spaces removed."""
    with tempfile.TemporaryDirectory() as tmp:
        run = write_sdk_run(Path(tmp) / "resnet-20270101-000000-4f2a9c", RUN)
        info = json.loads((run / "run.json").read_text())
        info["finished_unix_nano"] = T0_NS + 10 * 10**9
        info["end"] = {"status": "clean", "exit_code": None, "signal": None,
                       "exception": None, "recorded_by": "shutdown"}  # fmt: skip
        (run / "run.json").write_text(json.dumps(info))
        done = subprocess.run(
            [sys.executable, "-m", "otelprof", "report", str(run), "--width", str(WIDTH)],
            capture_output=True, text=True, timeout=300, check=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
    return "\n".join(line.rstrip() for line in done.stdout.strip("\n").splitlines())


def block() -> str:
    """The README's block between its report markers."""
    return (
        f"```text\n$ otelprof report\n{report_text()}\n```\n\n"
        "The report of a run written by `tests/run_generators.py` through the real detached "
        "writer\n(a data loader slow on purpose); `scripts/readme_report.py` makes this "
        "text and a test\nchecks it is what `otelprof report` prints today.\n"
    )


def readme_block(text: str) -> str:
    """What the README holds between the markers."""
    return text[text.index(START) + len(START) : text.index(END)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="update README.md in place")
    args = parser.parse_args()
    made = block()
    if not args.write:
        print(made, end="")
        return 0
    text = README.read_text()
    README.write_text(text.replace(readme_block(text), made))
    return 0


if __name__ == "__main__":
    sys.exit(main())
