"""A run's life on disk and its end, in one place (private).

`layout` names every run file and claims them (`claim`, `relocate`); `end` records how a
process ended; `shutdown` bounds the run's end (`bounded`); `closing_record` reads the
metrics file's last line; `private_files` and `appendfile` are how run files are written.
Importing this package imports nothing else: `analysis/` reads `closing_record` alone.
"""
