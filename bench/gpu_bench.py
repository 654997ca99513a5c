"""The GPU sampler's cost (CUDA-event accuracy and the rest: `scripts/gpu-check`).

    .venv/bin/python bench/gpu_bench.py [--samples 50]

on a machine with an NVIDIA GPU: wall time of one `GpuSampler.sample()` over the real NVML on
every visible GPU (classic calls, process lists, GPM when supported), i.e. what one
collection costs the background thread.

Without a GPU it says so and exits 2 (a benchmark that measured nothing must not pass).

    .venv/bin/python bench/gpu_bench.py --fake-driver [--gpus 8]

measures, on any machine, otelprof's own CPU per GPU sample (thread CPU time of
`GpuSampler.sample()` with GPM, process lists and counters) over the fake NVML driver of
the tests: the Python side of a collection, without the driver's own time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from _machine import cpu_model


def _sampler_cost(samples: int) -> None:
    from otelprof.system.gpu import GpuSampler

    sampler = GpuSampler("all")
    if not sampler.start():
        print("2. GPU sampler: NVML found no GPU: FAILED")
        raise SystemExit(1)
    try:
        sampler.sample()
        costs = []
        readings = 0
        for _ in range(samples):
            time.sleep(0.1)  # GPM needs a window between samples
            t0 = time.perf_counter()
            readings = len(sampler.sample())
            costs.append(time.perf_counter() - t0)
        gpm = [d.uuid for d in sampler.devices if d.perf.gpm]
        print(f"2. GPU sampler over {len(sampler.devices)} GPU(s), GPM on {len(gpm)}")
        print(f"   one sample(): median {statistics.median(costs) * 1000:.3f} ms, ", end="")
        print(f"max {max(costs) * 1000:.3f} ms, {readings} readings")
    finally:
        sampler.close()


def _fake_driver_cost(gpus: int, samples: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' fake driver
    from otelprof.system._gpu_steps import GpuStepMetrics
    from otelprof.system.gpu import GpuSampler
    from tests.fake_nvml import GPM_SM, FakeGpu, FakeNvml

    fakes = [
        FakeGpu(uuid=f"GPU-{i:04d}", gpm_supported=True, processes=[(os.getpid(), 2**30)])
        for i in range(gpus)
    ]
    sampler = GpuSampler("all", nvml=FakeNvml(fakes))
    assert sampler.start()
    derived = GpuStepMetrics(sampler.sample, lambda: (0, "train"))
    costs = []
    readings = 0
    try:
        for _ in range(samples):
            for gpu in fakes:
                gpu.run(0.1, **{f"m{GPM_SM}": 50.0})
            time.sleep(0.06)  # GPM samples at least MIN_WINDOW_S apart
            t0 = time.thread_time()
            readings = len(derived.sample())
            costs.append(time.thread_time() - t0)
    finally:
        sampler.close()
    med = statistics.median(costs)
    print(f"fake NVML driver, {gpus} GPU(s) with GPM, {samples} samples: {readings} readings")
    print(
        f"   thread CPU per sample: median {med * 1e6:.0f} µs ({med / gpus * 1e6:.0f} µs per GPU)"
    )
    print(f"   at a 1 s interval: {med * 100:.3f} % of one core")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=50)
    parser.add_argument("--fake-driver", action="store_true", help="own CPU cost, no GPU")
    parser.add_argument("--gpus", type=int, default=8, help="fake GPUs (--fake-driver)")
    args = parser.parse_args()
    if args.fake_driver:
        print(f"machine: {cpu_model()}")
        _fake_driver_cost(args.gpus, args.samples)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("gpu_bench: no CUDA GPU here (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    print(
        f"machine: {cpu_model()}; GPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__}"
    )
    _sampler_cost(args.samples)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
