"""Determined bridge: OTLP metrics and timing spans → Determined's generic-metrics API.

`mapping` turns OTLP into samples, `aggregate` windows them into reports, `spool` keeps
reports safe until `delivery` has them accepted by the master through `client`;
`pipeline` wires those for both the bridge service (`server`, `cli`) and the in-process
exporter (`otelprof.export.determined`).
"""
