"""Framework integrations: one line in the user's code marks steps, epochs, phases and
Determined's timings, and records throughput and MFU (docs/guide/frameworks.md).

Each module imports its framework; importing this package imports none of them.
"""
