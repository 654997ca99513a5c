"""What the specification (the original design brief, not in this repository) names, written
down once for the tests.

Tests compare otelprof's output with these names rather than with otelprof's own constants,
so a renamed constant in the product cannot silently change what the tests expect.
"""

DETERMINED_TIMINGS = (
    "dataloader_next",
    "to_device",
    "train_batch",
    "step_lr_schedulers",
    "from_device",
    "reduce_metrics",
)
"""Determined's PyTorchTrial timing names, as the design brief lists them."""
