"""The Determined timings without hand-written annotations: data loader, device copies,
optimizer and LR-scheduler steps."""

from __future__ import annotations

import collections
import dataclasses
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import otelprof
from otelprof._timings._api import instrument_optimizer, timed_dataloader
from otelprof._timings._recorder import timing
from otelprof.determined_timings import from_device, instrument_lr_scheduler, to_device
from tests.timings_harness import by_name, start_run

Pair = namedtuple("Pair", "x y")


@dataclasses.dataclass
class Batch:
    images: torch.Tensor
    labels: list[torch.Tensor]
    note: str = "keep"


def test_timed_dataloader_spans_each_batch_and_keeps_len(tmp_path: Path) -> None:
    loader = DataLoader(TensorDataset(torch.arange(10.0)), batch_size=3)
    run = start_run(tmp_path)
    wrapped = timed_dataloader(loader)
    assert len(wrapped) == 4
    for epoch in range(2):  # iterable again, like the DataLoader
        for _batch in wrapped:
            otelprof.step()
        otelprof.set_epoch(epoch + 1)
    spans = run.finish()
    loads = by_name(spans, "dataloader_next")
    assert len(loads) == 8, "the final exhausted next() is not a span"
    steps = {s.span_id: s for s in by_name(spans, "step")}
    assert all(s.parent_span_id in steps for s in loads)


def test_timed_dataloader_error_is_an_error_span_and_propagates(tmp_path: Path) -> None:
    def broken():
        yield 1
        raise OSError("disk gone")

    run = start_run(tmp_path)
    with pytest.raises(OSError, match="disk gone"):
        list(timed_dataloader(broken()))
    loads = by_name(run.finish(), "dataloader_next")
    assert sorted(s.status_code for s in loads) == [0, 2]


def test_to_device_moves_nested_structures_and_keeps_their_types(tmp_path: Path) -> None:
    data = {
        "pair": Pair(torch.ones(2), [torch.zeros(1), (torch.ones(3),)]),
        "batch": Batch(torch.ones(2, 2), [torch.ones(1)]),
        "count": 3,
    }
    run = start_run(tmp_path)
    moved = to_device(data, "meta")
    assert isinstance(moved["pair"], Pair) and isinstance(moved["pair"].y[1], tuple)
    assert moved["pair"].x.device.type == "meta"
    assert moved["pair"].y[1][0].device.type == "meta"
    assert isinstance(moved["batch"], Batch) and moved["batch"].note == "keep"
    assert moved["batch"].labels[0].device.type == "meta"
    assert moved["count"] == 3
    assert data["pair"].x.device.type == "cpu", "the input is not modified"
    assert len(by_name(run.finish(), "to_device")) == 1


def test_to_device_keeps_container_subclasses_and_honours_non_blocking(tmp_path: Path) -> None:
    class Tagged(list):  # type: ignore[type-arg]
        pass

    data = collections.OrderedDict(a=Tagged([torch.ones(1), "label"]), b=(torch.ones(2), 7))
    run = start_run(tmp_path)
    moved = to_device(data, "meta", non_blocking=True)
    assert type(moved) is collections.OrderedDict and list(moved) == ["a", "b"]
    assert type(moved["a"]) is Tagged and moved["a"][1] == "label"
    assert moved["a"][0].device.type == "meta" and moved["b"][0].device.type == "meta"
    assert type(moved["b"]) is tuple and moved["b"][1] == 7
    assert len(by_name(run.finish(), "to_device")) == 1


def test_to_device_and_from_device_on_flat_batches_and_single_tensors(tmp_path: Path) -> None:
    x, y = torch.ones(2, 3), torch.arange(2)
    run = start_run(tmp_path)
    pair = to_device((x, y), "meta")
    assert type(pair) is tuple and [t.device.type for t in pair] == ["meta", "meta"]
    mixed = to_device([x, "ids", (y,)], "meta", non_blocking=True)
    assert type(mixed) is list and mixed[1] == "ids" and type(mixed[2]) is tuple
    assert mixed[0].device.type == "meta" and mixed[2][0].device.type == "meta"
    assert to_device(x, "meta").device.type == "meta"
    assert to_device(x, "meta", non_blocking=True).device.type == "meta"
    assert to_device((), "meta") == () and to_device("text", "meta") == "text"
    loss = (torch.ones(3, requires_grad=True) * 2).sum()
    host = from_device(loss)
    assert not host.requires_grad and host.device.type == "cpu" and float(host) == 6.0
    assert from_device(7) == 7
    spans = run.finish()
    assert len(by_name(spans, "to_device")) == 6
    assert len(by_name(spans, "from_device")) == 2


def test_from_device_detaches_and_copies_to_host(tmp_path: Path) -> None:
    weight = torch.ones(3, requires_grad=True)
    run = start_run(tmp_path)
    out = from_device({"loss": (weight * 2).sum(), "parts": [weight * 3]})
    assert not out["loss"].requires_grad and out["loss"].device.type == "cpu"
    assert float(out["loss"]) == 6.0
    assert not out["parts"][0].requires_grad
    assert len(by_name(run.finish(), "from_device")) == 1


def test_optimizer_hooks_time_each_step_under_the_enclosing_range(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = start_run(tmp_path)
    handle = instrument_optimizer(optimizer)
    for _ in range(2):
        with timing("train_batch"):
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()
        otelprof.step()
    handle.remove()
    optimizer.step()  # no longer timed
    spans = run.finish()
    steps = by_name(spans, "optimizer_step")
    batches = {s.span_id for s in by_name(spans, "train_batch")}
    assert len(steps) == 2
    ids = {s.span_id: s for s in spans}
    for span in steps:
        # torch's own range (bridged) encloses the hooks, inside our train_batch
        torch_range = ids[span.parent_span_id]
        assert torch_range.name.startswith("Optimizer.step#SGD.step")
        assert torch_range.parent_span_id in batches


def test_optimizer_step_that_raises_leaves_no_open_span_behind(tmp_path: Path) -> None:
    param = torch.nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([param], lr=0.1)
    run = start_run(tmp_path)
    with instrument_optimizer(optimizer):
        with pytest.raises(RuntimeError, match="closure failed"):

            def closure() -> torch.Tensor:
                raise RuntimeError("closure failed")

            optimizer.step(closure)
        with timing("after"):
            pass
    spans = run.finish()
    assert by_name(spans, "optimizer_step") == []
    step = by_name(spans, "step")[0]
    assert by_name(spans, "after")[0].parent_span_id == step.span_id


def test_lr_scheduler_step_is_timed_and_restored(tmp_path: Path) -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    run = start_run(tmp_path)
    handle = instrument_lr_scheduler(scheduler)
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == 0.5
    handle.remove()
    assert "step" not in vars(scheduler)
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == 0.25
    assert len(by_name(run.finish(), "step_lr_schedulers")) == 1


def test_helpers_reject_objects_without_the_needed_api() -> None:
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"):
        instrument_optimizer(object())
    with pytest.raises(TypeError, match="step\\(\\) method"):
        instrument_lr_scheduler(object())


def test_timing_decorator_makes_one_span_per_call(tmp_path: Path) -> None:
    run = start_run(tmp_path)

    @timing("reduce_metrics")
    def reduce(values: list[float]) -> float:
        return sum(values) / len(values)

    assert reduce([1.0, 3.0]) == 2.0
    assert reduce([2.0]) == 2.0
    assert len(by_name(run.finish(), "reduce_metrics")) == 2
