"""A run's life on disk and its end, in one place (private).

- `layout`: where one process's run lives (`RunLayout`: directory, every file name,
  run.json), computed from its identity; it makes the directory, claims the names for this
  process (`claim`: one live writer per name) and moves what a provisional identity wrote
  into them when a process group appears later (`relocate`).
- `end`: how a process ends (exit, exception, SIGTERM), recorded whatever happens;
  `shutdown`: the bounded end of a run (`bounded`: how long each part may take).
- `closing_record`: the reader of the metrics file's last line (the run's end and counts),
  standard library only, so the offline readers import it without the runtime.
- `private_files`: run files are the user's alone (owner-only modes); `appendfile`: a run
  file is appended whole records at a time, or nothing (the writers' and `relocate`'s).

Importing this package imports nothing else: `analysis/` reads `closing_record` alone.
"""
