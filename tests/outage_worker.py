"""Training process for the collector-outage test (run as a separate process).

    python tests/outage_worker.py ENDPOINT CONTROL_DIR

Trains (tests/pipeline_run.training_loop) under `otelprof.instrument(endpoint=ENDPOINT)`
until CONTROL_DIR/stop exists. Every 0.25 s it appends a progress line to
CONTROL_DIR/progress.jsonl ({"t", "steps", "rss"}); at the end it writes
CONTROL_DIR/result.json with every step time, the profiler's stats and how long shutdown took.
A separate process, so its memory and step times are its own.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(endpoint: str, control: Path) -> int:
    import psutil

    import otelprof
    from tests.pipeline_run import training_loop

    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    stop_file = control / "stop"
    progress = (control / "progress.jsonl").open("a", buffering=1)
    process = psutil.Process()
    steps_done = [0]
    done = threading.Event()

    def report() -> None:
        while not done.wait(0.25):
            line = {"t": time.time(), "steps": steps_done[0], "rss": process.memory_info().rss}
            progress.write(json.dumps(line) + "\n")

    prof = otelprof.instrument(endpoint=endpoint, interval=0.5, service_name="outage-test")
    reporter = threading.Thread(target=report, daemon=True)
    reporter.start()

    def should_stop() -> bool:
        steps_done[0] += 1
        return stop_file.exists()

    step_times = training_loop(prof, should_stop=should_stop, pause_s=0.005)
    stats_before = prof.stats()
    t0 = time.perf_counter()
    prof.shutdown()
    shutdown_s = time.perf_counter() - t0
    done.set()
    reporter.join()
    result = {
        "step_times": step_times,
        "stats_before_shutdown": stats_before,
        "stats": prof.stats(),
        "shutdown_s": shutdown_s,
        "rss_end": process.memory_info().rss,
    }
    (control / "result.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2])))
