"""Framework integrations: one line in the user's code marks steps, epochs, phases and
Determined's timings, and records throughput and MFU.

- `otelprof.integrations.lightning.OtelprofCallback`: a Lightning callback;
- `otelprof.integrations.transformers.OtelprofTrainerCallback`: a transformers TrainerCallback;
- `otelprof.integrations.accelerate.instrument_accelerator`: an Accelerate training loop.

Each module imports its framework; importing this package imports none of them.
"""
