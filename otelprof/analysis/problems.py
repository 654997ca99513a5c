"""What a reader must see first: crashed, killed or unfinalized processes, failed spans, drops;
then notes that change how the figures should be read (step 0 outlier, step() never called).

Both are plain data, rendered by the text and JSON reports alike. The run files' fields
are as `reader.open_run` left them: `resource`, `end` and `stats` an object or absent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from otelprof._schema import ATTR_RANK, ATTR_WORLD_SIZE, is_loss
from otelprof.analysis import format as fmt
from otelprof.analysis.summary import RunSummary, unfinished_label

STEP0_OUTLIER_FACTOR = 3.0
"""Step 0 is called an outlier when it takes this many times the median of later steps..."""
STEP0_MIN_EXTRA_S = 1e-3
"""... and at least this much longer (a few µs more on µs steps moves no figure)."""
STEP0_MIN_LATER = 2
"""Later steps the median needs (a 3-step run has them: the torch.compile example of
docs/guide/timings.md)."""


@dataclass
class Finding:
    kind: str  # "crashed", "signal", "exit", "unfinalized", "failed spans", "dropped", ...
    message: str


def _process_label(info: dict[str, Any]) -> str:
    resource = info.get("resource") or {}
    parts = []
    if ATTR_RANK in resource and int(resource.get(ATTR_WORLD_SIZE, 1) or 1) > 1:
        parts.append(f"rank {resource[ATTR_RANK]}")
    if resource.get("host.name"):
        parts.append(str(resource["host.name"]))
    if resource.get("process.pid"):
        parts.append(f"pid {resource['process.pid']}")
    label = " ".join(parts) or str(info.get("run_id", "process"))
    attempt = info.get("attempt")
    return f"{label} (attempt {attempt})" if attempt is not None else label


def _in_step(info: dict[str, Any], summary: RunSummary | None) -> str:
    """' in step 4 (its ranges: the "crashed step" rows)' for a process that ended in a step."""
    resource = info.get("resource")
    if resource is None or summary is None:
        return ""
    key = (str(resource.get("host.name", "unknown-host")), resource.get("process.pid"))
    number = summary.unfinished_steps.get(key)
    label = unfinished_label(info.get("end"))
    if number is None or label is None:
        return ""
    return f' in step {number} (its ranges: the "{label}" rows)'


def _end_finding(info: dict[str, Any], summary: RunSummary | None = None) -> Finding | None:
    """How one process's run ended, as a problem (None for a clean end); with the run's
    summary, the step a crash or a stop came in."""
    who = _process_label(info)
    end = info.get("end")
    if "finished_unix_nano" not in info:
        if end and end.get("signal"):
            return Finding(
                "unfinalized",
                f"{who}: received {end['signal']} and was killed before its telemetry was "
                "flushed; the end of the run is missing",
            )
        if end:  # written as shutdown began; nothing after it was
            return Finding(
                "unfinalized",
                f"{who}: run not finalized: its shutdown began ({end.get('recorded_by')}) but "
                "its end and final counts were never recorded (the process was killed during "
                "the flush, or its file system refused the last writes)",
            )
        return Finding(
            "unfinalized",
            f"{who}: run not finalized: no end was recorded (the process was killed, by "
            "SIGKILL or out of memory, is still running, or its file system refused the last "
            "writes); the end of the run may be missing",
        )
    if end is None:
        return None
    if end.get("flush_timed_out"):
        return Finding(
            "flush timed out",
            f"{who}: shutdown's flush did not finish within its bound (a hung file system or "
            "collector); what it still held was given up and counted as dropped",
        )
    status = end.get("status")
    exception = end.get("exception") if isinstance(end.get("exception"), dict) else None
    where = _in_step(info, summary)
    if status == "exception" and exception and exception.get("type") == "KeyboardInterrupt":
        return Finding("interrupted", f"{who}: interrupted (KeyboardInterrupt, e.g. Ctrl-C){where}")
    if status == "exception" and exception:
        return Finding(
            "crashed",
            f"{who}: training died of {exception.get('type')}: {exception.get('message')}{where}",
        )
    if status == "signal":
        code = end.get("exit_code")
        tail = f" (exit code {code})" if code is not None else ""
        return Finding("signal", f"{who}: stopped by {end.get('signal')}{tail}{where}")
    if status == "exit":
        return Finding("exit", f"{who}: exited with code {end.get('exit_code')}{where}")
    return None


def problems(summary: RunSummary) -> list[Finding]:
    """Crashes, signals, unfinalized processes, failed spans and dropped telemetry."""
    from otelprof.analysis.rank_problems import claimed_twice, lost_hosts, missing_ranks

    found = [Finding("lost node", message) for message in lost_hosts(summary.files.run_info)]
    found.extend(
        Finding("rank claimed twice", message)
        for message in claimed_twice(
            summary.files.run_info, [dict(resource.attrs) for resource in summary.ranks]
        )
    )
    found.extend(
        f for info in summary.files.run_info if (f := _end_finding(info, summary)) is not None
    )
    found.extend(
        Finding("missing rank", message) for message in missing_ranks(summary.files.run_info)
    )
    if summary.failed_spans:
        total = sum(summary.failed_spans.values())
        names = ", ".join(
            f"{name} ({count:,})"
            for name, count in sorted(summary.failed_spans.items(), key=lambda kv: -kv[1])[:8]
        )
        found.append(Finding("failed spans", f"{total:,} span(s) ended with an error: {names}"))
    for info in summary.files.run_info:
        stats = info.get("stats") or {}
        if "finished_unix_nano" not in info:  # no final counts: what its exports counted
            found.extend(_counted_by_exports(info, summary))
            continue
        dropped = stats.get("dropped_total")
        if isinstance(dropped, int) and dropped > 0:
            lost = ", ".join(
                f"{k} {v:,}"
                for k, v in sorted(stats.items())
                if isinstance(v, int) and v and is_loss(k)
            )
            found.append(
                Finding(
                    "dropped",
                    f"{_process_label(info)}: {dropped:,} telemetry item(s) dropped ({lost})",
                )
            )
    found.extend(_determined_refusals(summary))
    return found


def _counted_by_exports(info: dict[str, Any], summary: RunSummary) -> list[Finding]:
    """The drops a process without a recorded end had counted by its last export."""
    resource = info.get("resource") or {}
    pid = resource.get("process.pid")
    if not isinstance(pid, int):
        return []
    counts = summary.dropped_counted.get((str(resource.get("host.name", "unknown-host")), pid))
    if not counts:
        return []
    lost = ", ".join(f"{k} {v:,}" for k, v in sorted(counts.items()))
    return [
        Finding(
            "dropped",
            f"{_process_label(info)}: {sum(counts.values()):,} telemetry item(s) counted as "
            f"dropped by its last export ({lost}); its final counts were never recorded",
        )
    ]


DETERMINED_REFUSED = "determined-refused.jsonl"  # otelprof.export.determined.REFUSED_FILE


def _determined_refusals(summary: RunSummary) -> list[Finding]:
    """Reports the Determined master refused for good (kept by the in-process exporter)."""
    found = []
    for directory in summary.files.dirs:
        path = directory / DETERMINED_REFUSED
        try:
            lines = path.read_bytes().splitlines()
        except OSError:
            continue
        entries = []
        for line in lines:
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict):
                entries.append(entry)
        if not entries:
            continue
        first = entries[0]
        found.append(
            Finding(
                "determined refused",
                f"{len(entries):,} report(s) refused by the Determined master, not in its Web "
                f"UI (first: HTTP {first.get('status')}: {str(first.get('message'))[:200]}); "
                f"the bodies are in {path}",
            )
        )
    return found


def notes(summary: RunSummary) -> list[str]:
    """Hints on reading the figures: the step range, a slow step 0, step() never called."""
    out: list[str] = []
    if summary.steps_range is not None:
        low, high = summary.steps_range
        out.append(
            f"only steps {'' if low is None else low}:{'' if high is None else high} "
            "(from --steps; A:B keeps A <= step < B)"
        )
    if (
        summary.timings_from_histograms
        and summary.read.spans
        < sum(a.stats.count for a in summary.timings.values()) + summary.step.count
    ):
        out.append(
            "timings cover every step (otelprof.timing.duration histograms); traces were "
            f"sampled ({summary.read.spans:,} spans kept), so percentiles are approximate (~)"
        )
    if summary.plan.partial:
        read = summary.read
        out.append(
            f"the run ({fmt.size(read.total_bytes)}) is over the report's read budget: "
            f"{fmt.size(read.bytes)} read, in evenly spaced parts of {read.partial_files} "
            "file(s) (each file's end included); timing counts, totals and means stay exact "
            "(otelprof.timing.duration histograms), traces, hardware gauges and stragglers "
            "come from the parts read; `--read-all` reads everything"
        )
    step = summary.step
    ranks = [r for r in summary.ranks.values() if r.steps.count]
    if summary.step0_s and step.count - len(summary.step0_s) >= STEP0_MIN_LATER:
        later = step.median_without(summary.step0_s)
        first = max(summary.step0_s)
        if (
            later > 0
            and first > STEP0_OUTLIER_FACTOR * later
            and first - later >= STEP0_MIN_EXTRA_S
        ):
            out.append(
                f"step 0 took {fmt.ms_text(first)}, {first / later:.0f}x the median of the "
                f"later steps ({fmt.ms_text(later)}): compilation or warm-up; exclude it with "
                "`otelprof report --steps 1:`"
            )
    for info in summary.files.run_info:
        stats = info.get("stats") or {}
        folded = stats.get("timings.span_names_folded")
        if isinstance(folded, int) and folded > 0:
            out.append(
                f"{_process_label(info)}: {folded:,} span(s) exported as otelprof.other: more "
                "distinct span names than the limit (a name per item or per step?)"
            )
        skipped = stats.get("timings.kineto_steps_skipped")
        if isinstance(skipped, int) and skipped > 0:
            out.append(
                f"{_process_label(info)}: kineto skipped {skipped:,} step(s) because another "
                "torch profiler was active"
            )
    spans = sum(a.stats.count for a in summary.timings.values())
    if step.count == 0 and spans:
        out.append(
            f"no step spans in this run ({spans:,} timing spans): is the schedule recording?"
        )
    elif ranks and all(r.steps.count == 1 for r in ranks) and spans >= 3 * len(ranks):
        repeated = max(summary.timings.values(), key=lambda a: a.stats.count)
        if repeated.stats.count > len(ranks):
            out.append(
                f"the whole run is one step ({repeated.name} ran {repeated.stats.count:,} "
                "times in it): call `otelprof.step()` once per training "
                "step to get per-step timings"
            )
    return out
