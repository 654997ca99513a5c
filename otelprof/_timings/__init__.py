"""Training timings as OTel spans: record_function bridge, step spans, schedules, CUDA events.

The training thread only records names and timestamps (`_recorder`, compiled in
`_speedups.c`); a builder thread turns them into ReadableSpans for the provider's span
processors (`_builder`). `TimingsEngine` (`_engine`) owns steps, schedules, the torch bridge
(`_bridge`), CUDA-event timing (`_cuda`) and optional Kineto windows (`_kineto`). Private:
the public names are `otelprof`'s. Importing this package never imports torch.
"""
