"""One attached-mode training job that runs until told to stop (tests/test_dashboards.py).

    python -m tests.live_job ENDPOINT SERVICE_NAME STOP_FILE

Trains tests.pipeline_run.training_loop under `otelprof.instrument(endpoint=...)` until
STOP_FILE exists, then shuts otelprof down and exits. Its job id comes from OTELPROF_RUN_ID,
as a user's would, so two of these on one host differ only by it.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    endpoint, service_name, stop_file = argv
    import otelprof
    from tests.pipeline_run import training_loop

    prof = otelprof.instrument(endpoint=endpoint, interval=0.5, service_name=service_name)
    try:
        training_loop(prof, should_stop=Path(stop_file).exists, pause_s=0.05)
    finally:
        prof.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
