"""One attached-mode training job that runs until told to stop (tests/test_dashboards.py,
tests/test_alerts.py).

    python -m tests.live_job ENDPOINT SERVICE_NAME STOP_FILE [STALL_FILE]

Trains tests.pipeline_run.training_loop under `otelprof.instrument(endpoint=...)` until
STOP_FILE exists, then shuts otelprof down and exits. While STALL_FILE exists it completes
no step but stays alive, its metrics still exported (a hung job). Its job id comes from
OTELPROF_RUN_ID, as a user's would, so two of these on one host differ only by it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    endpoint, service_name, stop_file, *stall = argv
    import otelprof
    from tests.pipeline_run import training_loop

    stop = Path(stop_file)
    stall_file = Path(stall[0]) if stall else None

    def stalled() -> bool:
        return stall_file is not None and stall_file.exists()

    prof = otelprof.instrument(endpoint=endpoint, interval=0.5, service_name=service_name)
    try:
        while not stop.exists():
            training_loop(prof, should_stop=lambda: stop.exists() or stalled(), pause_s=0.05)
            while stalled() and not stop.exists():
                time.sleep(0.1)
    finally:
        prof.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
