"""Accelerate: `instrument_accelerator(accelerator)` gives per-batch breakdowns, real optimizer
steps only under gradient accumulation, validation apart, throughput and MFU; and
`instrument_optimizer` works on Accelerate's wrapped optimizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import accelerate.data_loader
import pytest
import torch
from accelerate import Accelerator
from accelerate.data_loader import DataLoaderShard
from torch.utils.data import DataLoader, TensorDataset

import otelprof
from otelprof import _profiler
from otelprof.integrations.accelerate import instrument_accelerator
from tests.framework_runs import (
    INSTRUMENT,
    children,
    expected_train_rate,
    in_order,
    report_json,
    roots,
    spans_of,
)
from tests.timings_harness import start_run

BATCH = 16
STEP_FLOPS = 2 * BATCH * (32 * 64 + 64 * 4) + 2 * 2 * BATCH * 64 * 4 + 2 * BATCH * 32 * 64
PEAK = 1e12


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def _train(tmp_path: Path, run_id: str) -> Path:
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    handle = instrument_accelerator(
        accelerator, peak_flops=PEAK, output_dir=str(tmp_path), run_id=run_id, **INSTRUMENT
    )
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    data = TensorDataset(torch.randn(6 * BATCH, 32), torch.randint(0, 4, (6 * BATCH,)))
    train = DataLoader(data, batch_size=BATCH)
    val = DataLoader(data, batch_size=2 * BATCH)
    model, optimizer, train, val, scheduler = accelerator.prepare(
        model, optimizer, train, val, scheduler
    )
    for epoch in range(2):
        otelprof.set_epoch(epoch)
        model.train()
        for x, y in train:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        model.eval()
        with torch.no_grad():
            for x, _y in val:
                model(x)
    handle.remove()
    assert _profiler.active_profiler() is None
    return tmp_path / run_id


def test_accelerate_loop_gives_breakdowns_validation_throughput_and_mfu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _train(tmp_path, "accelerate")
    spans = spans_of(run)
    steps = roots(spans, "step")
    assert [s.attributes["otelprof.step"] for s in steps] == list(range(12))
    synced = 0
    for step in steps:
        kids = children(spans, step)
        for name in ("dataloader_next", "forward", "backward"):
            assert len(kids[name]) == 1, (name, step.attributes, sorted(kids))
        (loader,) = kids["dataloader_next"]
        assert [c.name for c in children(spans, loader)["to_device"]] == ["to_device"]
        assert step.attributes["otelprof.samples"] == BATCH
        assert step.attributes["otelprof.flops"] == STEP_FLOPS
        # gradient accumulation over 2 batches: the update happens every other batch
        if kids.get("optimizer_step"):
            synced += 1
            assert step.attributes["otelprof.step"] % 2 == 1
            assert in_order(kids["forward"][0], kids["backward"][0], kids["optimizer_step"][0])
            assert len(kids["step_lr_schedulers"]) == 1
    assert synced == 6
    assert not [s for s in spans if s.name.startswith("Optimizer.step#")]
    validation = roots(spans, "validation")
    assert len(validation) == 6  # 3 eval batches per epoch, each its own trace
    for v in validation:
        assert set(children(spans, v)) == {"dataloader_next", "forward"}
        assert v.attributes["otelprof.samples"] == 2 * BATCH
    doc = report_json(run, capsys)
    assert doc["steps"]["count"] == 12
    rows = {r["phase"]: r for r in doc["sections"]["throughput"]["rows"]}
    rate = expected_train_rate(steps, BATCH)
    assert rows["train"]["samples/s"] == pytest.approx(rate, rel=1e-3)
    assert rows["train"]["MFU %"] == pytest.approx(100 * rate / BATCH * STEP_FLOPS / PEAK, rel=1e-2)


def test_instrument_accelerator_restores_everything_it_patched(tmp_path: Path) -> None:
    iter_before = DataLoaderShard.__iter__
    send_before = accelerate.data_loader.send_to_device
    accelerator = Accelerator(cpu=True)
    handle = instrument_accelerator(accelerator, output_dir=str(tmp_path), **INSTRUMENT)
    assert "prepare" in vars(accelerator)
    model, loader = accelerator.prepare(_model(), DataLoader(torch.randn(4, 32), batch_size=2))
    assert DataLoaderShard.__iter__ is not iter_before
    handle.remove()
    assert DataLoaderShard.__iter__ is iter_before
    assert accelerate.data_loader.send_to_device is send_before
    assert "prepare" not in vars(accelerator) and "backward" not in vars(accelerator)
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert _profiler.active_profiler() is None
    assert len(list(loader)) == 2  # still iterates, untimed


def test_instrument_optimizer_accepts_accelerates_wrapped_optimizer(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = _model()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    run = start_run(tmp_path)
    handle = otelprof.instrument_optimizer(optimizer)  # used to raise AttributeError
    for _ in range(4):
        with accelerator.accumulate(model):
            accelerator.backward(model(torch.randn(2, 32)).sum())
            optimizer.step()
            optimizer.zero_grad()
        otelprof.step()
    handle.remove()
    spans = run.finish()
    assert len([s for s in spans if s.name == "optimizer_step"]) == 2  # real steps only


def test_instrument_accelerator_refuses_what_is_no_accelerator() -> None:
    with pytest.raises(TypeError, match=r"needs an accelerate\.Accelerator"):
        instrument_accelerator(object())
    bad: Any = "lots"
    with pytest.raises(ValueError, match="flops must be a number"):
        instrument_accelerator(Accelerator(cpu=True), flops=bad)
