"""The HTML report's charts: every step drawn, an outlier marked above an axis chosen for
the bulk, one set of phase bands coloured by name with a legend, labels that fit."""

from __future__ import annotations

import itertools
import re
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

from otelprof.analysis.svg import CHAR_EM, bar_chart
from otelprof.cli import main as cli_main
from tests.otlp_files import read_spans
from tests.run_generators import RunSpec, write_sdk_run

SVG = "{http://www.w3.org/2000/svg}"
SLOW_STEP = 51


def _charts(run: Path, out: Path) -> dict[str, ET.Element]:
    assert cli_main(["report", str(run), "--html", str(out)]) == 0
    return {
        (root := ET.fromstring(svg)).get("aria-label", ""): root
        for svg in re.findall(r"<svg.*?</svg>", out.read_text(), re.S)
    }


def _title(element: ET.Element) -> str:
    found = element.find(f"{SVG}title")
    return "" if found is None else found.text or ""


def _ddp_like_run(out: Path) -> Path:
    """Two ranks of ~100 ms steps; step 51 takes ~10.4 s on both (rank 0 waiting for a
    slow rank 1)."""
    spec = RunSpec(
        ranks=2, steps=100, epochs=2, train_batch_s=0.08, dataloader_s=0.01,
        shared_trace_ids=True, slow_steps={SLOW_STEP: 10.3},
    )  # fmt: skip
    return write_sdk_run(out, spec)


def test_every_step_is_drawn_and_an_outlier_marked_above_an_axis_for_the_bulk(
    tmp_path: Path,
) -> None:
    run = _ddp_like_run(tmp_path / "run")
    steps = defaultdict(dict)  # the test's own figures: step durations from the files
    for rank in (0, 1):
        for span in read_spans(run / f"traces.rank{rank}.jsonl"):
            if span.name == "step":
                steps[rank][span.attributes["otelprof.step"]] = span.duration_s * 1e3
    chart = _charts(run, tmp_path / "r.html")["step duration (ms)"]
    for rank in (0, 1):
        label = f"rank {rank} @ node0"
        drawn = sum(
            len(e.get("points", "").split())
            for e in chart.iter(f"{SVG}polyline")
            if _title(e) == label
        ) + sum(1 for e in chart.iter(f"{SVG}circle") if _title(e).startswith(f"{label}:"))
        assert drawn == len(steps[rank]) == 100  # every step, the slow one included
        slow = f"{steps[rank][SLOW_STEP]:,.0f} ms"
        marks = [_title(g) for g in chart.iter(f"{SVG}g") if g.get("class") == "outlier"]
        assert [m for m in marks if m.startswith(f"{label}: {slow} at ")], (marks, slow)
    # the axis is for the ~100 ms steps: they fill most of it, the 10.4 s step is marked
    ticks = [
        float(t.text.replace(",", "").removesuffix(" ms"))
        for t in chart.iter(f"{SVG}text")
        if t.get("text-anchor") == "end" and (t.text or "").endswith(" ms")
    ]
    bulk = max(d for rank in steps.values() for n, d in rank.items() if n != SLOW_STEP)
    assert bulk <= max(ticks) <= 2.5 * bulk, (ticks, bulk)
    legend = [t.text for t in chart.iter(f"{SVG}text") if (t.text or "").startswith("▲")]
    assert legend == ["▲ beyond the axis"]


def _fills(chart: ET.Element) -> dict[str, set[str]]:
    """Band label -> the fills its bands and its legend swatch have."""
    fills: dict[str, set[str]] = defaultdict(set)
    for rect in chart.iter(f"{SVG}rect"):
        if _title(rect):
            fills[_title(rect)].add(rect.get("fill", ""))
    texts = list(chart.iter(f"{SVG}text"))
    swatches = [r for r in chart.iter(f"{SVG}rect") if r.get("width") == "14"]
    for swatch in swatches:  # the legend line beside each swatch names its phase
        y = float(swatch.get("y", "0")) + 9
        (name,) = [_title(t) for t in texts if _title(t) and float(t.get("y", "0")) == y]
        fills[name].add(swatch.get("fill", ""))
    return fills


def test_phases_have_the_same_colours_in_every_report_and_one_band_set(tmp_path: Path) -> None:
    plain = write_sdk_run(tmp_path / "a", RunSpec(steps=40, epochs=2))
    # a checkpoint first: the phases come in another order, and more of them
    more = write_sdk_run(
        tmp_path / "b", RunSpec(steps=40, epochs=2, extra_roots=(("checkpoint", 3),))
    )
    a = _fills(_charts(plain, tmp_path / "a.html")["step duration (ms)"])
    b = _fills(_charts(more, tmp_path / "b.html")["step duration (ms)"])
    for phase in ("epoch 0", "epoch 1", "validation"):
        assert len(a[phase]) == 1 and a[phase] == b[phase], (phase, a, b)
    assert a["epoch 0"] != a["epoch 1"] and b["checkpoint"] != b["validation"]
    # bands never overlap: one set for the job
    chart = _charts(more, tmp_path / "b.html")["step duration (ms)"]
    bands = sorted(
        (float(r.get("x", "0")), float(r.get("x", "0")) + float(r.get("width", "0")))
        for r in chart.iter(f"{SVG}rect")
        if _title(r)
    )
    assert all(end <= nxt + 0.11 for (_, end), (nxt, _) in itertools.pairwise(bands))


def _width(text: str, font_px: float) -> float:
    return CHAR_EM * font_px * len(text)


def test_labels_fit_inside_the_chart_and_never_cover_the_legend(tmp_path: Path) -> None:
    long = "[pl][module]torch.nn.modules.linear.Linear: encoder.layers.11.mlp.fc2"
    svg = ET.fromstring(bar_chart("share", [(long, 0.6, "60.0%"), ("dataloader_next", 0.3, "30%")]))
    labels = [t for t in svg.iter(f"{SVG}text") if t.get("text-anchor") == "end"]
    assert [_title(t) for t in labels] == [long, "dataloader_next"]  # the whole name on hover
    for t in labels:
        assert float(t.get("x", "0")) - _width(t.text or "", 12) >= 0, t.text  # not cut at x=0
    assert labels[1].text == "dataloader_next"

    run = _ddp_like_run(tmp_path / "run")
    charts = _charts(run, tmp_path / "r.html")
    for title, chart in charts.items():
        width = float(chart.get("width", "0"))
        plot_right = width - 190  # line charts: the legend lies right of the plot
        for t in chart.iter(f"{SVG}text"):
            text = t.text or ""
            x = float(t.get("x", "0"))
            if t.get("fill") == "#555":  # a phase band's label: inside the plot
                assert x + _width(text, 11) <= plot_right, (title, text)
            elif t.get("text-anchor") == "end":
                size = 12 if title.startswith("share") else 11
                assert x - _width(text, size) >= 0, (title, text)
            elif t.get("text-anchor") != "middle":
                assert x + _width(text, 11) <= width + 1, (title, text)
