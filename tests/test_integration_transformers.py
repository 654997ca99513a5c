"""transformers: `Trainer(callbacks=[OtelprofTrainerCallback()])` on a tiny GPT-2 built from a
config (nothing downloaded) gives per-step breakdowns, evaluation and checkpoints apart,
throughput, tokens and MFU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import accelerate
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from otelprof import _profiler
from otelprof.integrations.transformers import OtelprofTrainerCallback
from tests.framework_runs import (
    INSTRUMENT,
    children,
    expected_train_rate,
    in_order,
    report_json,
    roots,
    spans_of,
)

SEQ, REAL_TOKENS, BATCH, ACCUMULATE = 16, 12, 4, 2
PEAK = 1e12


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Token ids with 4 padding positions per row."""

    def __init__(self, rows: int) -> None:
        self.ids = torch.randint(0, 100, (rows, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        mask = torch.ones(SEQ, dtype=torch.long)
        mask[REAL_TOKENS:] = 0
        return {"input_ids": self.ids[i], "attention_mask": mask, "labels": self.ids[i]}


def _model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    return GPT2LMHeadModel(config)


def _step_flops() -> float:
    """FLOPs of one Trainer step (2 micro-batches, forward + backward), counted apart."""
    model = _model()
    rows = [Tokens(BATCH)[i] for i in range(BATCH)]
    batch = {k: torch.stack([row[k] for row in rows]) for k in rows[0]}
    with FlopCounterMode(display=False) as counter:
        for _ in range(ACCUMULATE):
            model(**batch).loss.backward()
    return float(counter.get_total_flops())


def _train(tmp_path: Path, run_id: str) -> Path:
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATE,
        num_train_epochs=2,
        eval_strategy="epoch",
        save_strategy="epoch",
        save_only_model=True,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    callback = OtelprofTrainerCallback(
        peak_flops=PEAK, output_dir=str(tmp_path), run_id=run_id, **INSTRUMENT
    )
    trainer = Trainer(
        model=_model(),
        args=args,
        train_dataset=Tokens(6 * BATCH),
        eval_dataset=Tokens(2 * BATCH),
        callbacks=[callback],
    )
    trainer.train()
    assert _profiler.active_profiler() is None
    return tmp_path / run_id


def test_trainer_gives_breakdowns_evaluation_apart_tokens_and_mfu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    backward_before = accelerate.Accelerator.backward
    loss_before = Trainer.compute_loss
    run = _train(tmp_path, "trainer")
    spans = spans_of(run)
    steps = roots(spans, "step")
    # 6 batches of 4 per epoch, 2 per optimizer step: 3 Trainer steps per epoch
    assert [s.attributes["otelprof.step"] for s in steps] == list(range(6))
    assert [s.attributes["otelprof.epoch"] for s in steps] == [0, 0, 0, 1, 1, 1]
    flops = _step_flops()
    for step in steps:
        kids = children(spans, step)
        for name, count in (("dataloader_next", 2), ("forward", 2), ("backward", 2),
                            ("optimizer_step", 1), ("step_lr_schedulers", 1)):  # fmt: skip
            assert len(kids[name]) == count, (name, step.attributes, sorted(kids))
        forwards = sorted(kids["forward"], key=lambda s: s.start_ns)
        backwards = sorted(kids["backward"], key=lambda s: s.start_ns)
        assert in_order(
            forwards[0], backwards[0], forwards[1], backwards[1], kids["optimizer_step"][0]
        )
        assert step.attributes["otelprof.samples"] == ACCUMULATE * BATCH
        assert step.attributes["otelprof.tokens"] == ACCUMULATE * BATCH * REAL_TOKENS
        assert step.attributes["otelprof.flops"] == pytest.approx(flops, rel=1e-6)
    validation = roots(spans, "validation")
    assert len(validation) == 4  # 2 evaluation batches per epoch, each its own trace
    for v in validation:
        assert set(children(spans, v)) == {"dataloader_next", "forward"}
        assert v.attributes["otelprof.tokens"] == BATCH * REAL_TOKENS
    assert len(roots(spans, "checkpoint")) == 2
    doc = report_json(run, capsys)
    assert doc["steps"]["count"] == 6
    rows = {r["phase"]: r for r in doc["sections"]["throughput"]["rows"]}
    rate = expected_train_rate(steps, ACCUMULATE * BATCH)
    assert rows["train"]["samples/s"] == pytest.approx(rate, rel=1e-3)
    assert rows["train"]["tokens/s"] == pytest.approx(rate * REAL_TOKENS, rel=1e-3)
    per_step_s = ACCUMULATE * BATCH / rate
    assert rows["train"]["MFU %"] == pytest.approx(100 * flops / per_step_s / PEAK, rel=1e-2)
    # every class-level wrapper is gone after training
    assert accelerate.Accelerator.backward is backward_before
    assert Trainer.compute_loss is loss_before


def test_a_bad_flops_option_is_refused() -> None:
    bad: Any = "many"
    with pytest.raises(ValueError, match="flops must be a number"):
        OtelprofTrainerCallback(flops=bad)


def test_a_trainer_version_lacking_a_method_degrades_with_one_log_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from otelprof.integrations import _common
    from otelprof.integrations import transformers as integration

    class OldTrainer:  # no _save_checkpoint, as an older or newer Trainer might lack it
        def compute_loss(self) -> None: ...

    monkeypatch.setattr(
        integration,
        "_patches",
        lambda: [
            (OldTrainer, "compute_loss", integration._wrap_compute_loss),
            (OldTrainer, "_save_checkpoint", integration._wrap_save),
        ],
    )
    monkeypatch.setattr(_common, "_warned", set())
    original = OldTrainer.compute_loss
    for _ in range(2):
        integration._install()
        assert OldTrainer.compute_loss is not original  # what exists is still timed
        integration._installed.restore()
        assert OldTrainer.compute_loss is original
    lines = [r.getMessage() for r in caplog.records if "_save_checkpoint" in r.getMessage()]
    assert lines == [
        "otelprof: this OldTrainer has no _save_checkpoint(); that part of the step is not timed"
    ]
