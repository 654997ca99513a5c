"""The public API is small, documented and cheap to import; one public way does each thing,
and the names of earlier releases still work for one release, with a warning that names
their replacement."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import otelprof
from otelprof import determined_timings
from tests.docs_pages import all_text

DOCS = all_text()

PUBLIC = {
    "instrument",
    "uninstrument",
    "Profiler",
    "ConfigError",
    "step",
    "set_epoch",
    "phase",
    "timing",
    "timed_dataloader",
    "instrument_optimizer",
    "step_work",
    "set_peak_flops",
    "schedule",
    "cyclic_schedule",
}


def test_importing_otelprof_does_not_import_torch() -> None:
    code = "import sys, otelprof; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_the_public_api_is_these_fourteen_names_each_documented() -> None:
    assert set(otelprof.__all__) == PUBLIC and len(otelprof.__all__) <= 14
    for name in otelprof.__all__:
        assert getattr(otelprof, name) is not None
        assert f"otelprof.{name}" in DOCS, f"otelprof.{name} is not mentioned in the docs"
    public_modules = {
        name for name in vars(otelprof) if not name.startswith("_") and name not in PUBLIC
    }
    assert "timings" not in public_modules  # the timings package is private (`_timings`)


def test_determined_timing_names_live_in_their_own_module() -> None:
    assert set(determined_timings.__all__) == {
        "DETERMINED_TIMINGS",
        "train_batch",
        "reduce_metrics",
        "to_device",
        "from_device",
        "instrument_lr_scheduler",
    }
    assert "otelprof.determined_timings" in DOCS
    with otelprof.timing("x") as plain, determined_timings.train_batch() as named:
        assert type(plain) is type(named) and named.name == "train_batch"


@pytest.mark.parametrize(
    ("name", "replacement"),
    [
        ("train_batch", "otelprof.determined_timings.train_batch"),
        ("reduce_metrics", "otelprof.determined_timings.reduce_metrics"),
        ("to_device", "otelprof.determined_timings.to_device"),
        ("from_device", "otelprof.determined_timings.from_device"),
        ("instrument_lr_scheduler", "otelprof.determined_timings.instrument_lr_scheduler"),
        ("set_phase", "with otelprof.phase(name):"),
        ("current_phase", "otelprof.phase.current()"),
        ("active_profiler", "the Profiler instrument() returns"),
        ("Settings", "otelprof.config.Settings"),
    ],
)
def test_a_name_of_the_last_release_still_works_and_warns_naming_its_replacement(
    name: str, replacement: str
) -> None:
    with pytest.warns(DeprecationWarning, match=f"otelprof.{name} is deprecated; use") as seen:
        value = getattr(otelprof, name)
    assert replacement in str(seen[0].message)
    assert callable(value)
    assert name not in otelprof.__all__


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        otelprof.nope  # type: ignore[attr-defined]  # noqa: B018


def test_the_profilers_own_step_epoch_phase_and_timing_warn_and_still_work(
    tmp_path: Path,
) -> None:
    with otelprof.instrument(
        output_dir=str(tmp_path), run_id="old", host_metrics=False, process_metrics=False
    ) as prof:
        deprecated = r"Profiler.step\(\) is deprecated; use otelprof.step\(\)"
        with pytest.warns(DeprecationWarning, match=deprecated):
            prof.step()
        with pytest.warns(DeprecationWarning, match=r"use otelprof.set_epoch\(\)"):
            prof.set_epoch(3)
        with pytest.warns(DeprecationWarning, match=r"use with otelprof.phase\(name\):"):
            assert prof.set_phase("validation") == "train"
        with pytest.warns(DeprecationWarning, match=r"use otelprof.timing\(\)"):
            timing = prof.timing("old")
        assert otelprof.phase.current() == "validation"
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the one public way warns nothing
            with timing:
                pass
            otelprof.set_epoch(4)
            otelprof.step()
        assert prof.stats()["timings.steps"] == 1  # one training step, then validation's
