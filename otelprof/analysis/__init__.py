"""Analysis of detached runs: read OTLP JSON Lines run directories, report, trace, replay.

Everything here streams the run's files line by line, so a run directory of any size is
handled in bounded memory; bad lines are skipped with a warning naming file and line.
"""

from otelprof.analysis.reader import RunDirError, RunFiles, open_run

__all__ = ["RunDirError", "RunFiles", "open_run"]
