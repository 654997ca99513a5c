"""A run's life on disk and its end, in one place (private).

- `end`: how a process ends (exit, exception, SIGTERM), recorded whatever happens;
  `shutdown`: the bounded end of a run (`bounded`: how long each part may take).
- `closing_record`: the reader of the metrics file's last line (the run's end and counts),
  standard library only, so the offline readers import it without the runtime.
- `private_files`: run files are the user's alone (owner-only modes).

Importing this package imports nothing else: `analysis/` reads `closing_record` alone.
"""
