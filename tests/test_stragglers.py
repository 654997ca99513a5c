"""The straggler rule on exact numbers: who waits least in collectives is the straggler,
but only when the others clearly wait longer; where its extra time goes is its own work."""

from __future__ import annotations

from otelprof.analysis.reader import Resource
from otelprof.analysis.stragglers import UNTIMED, RankWork, _judge
from tests.docs_pages import page


def _rank(
    rank: int, wait_ms: float, own: dict[str, float], steps: int = 100, host: str = "n"
) -> RankWork:
    """A rank with `steps` equal steps: own work per part + waiting in train_batch (ms)."""
    step_ms = sum(own.values()) + wait_ms
    return RankWork(
        Resource((("host.name", host), ("otelprof.rank", rank), ("process.pid", 10 + rank))),
        steps=steps,
        step_s=steps * step_ms / 1e3,
        wait_s=steps * wait_ms / 1e3,
        own={k: steps * v / 1e3 for k, v in own.items()},
        wait_in={"train_batch": steps * wait_ms / 1e3},
        wait_op={"ddp_allreduce": steps * wait_ms / 1e3},
    )


def test_balanced_ranks_have_no_straggler() -> None:
    work = {"train_batch": 10.0, UNTIMED: 1.0}
    ranks = [_rank(0, 2.0, work), _rank(1, 2.3, work), _rank(2, 2.1, work)]
    report = _judge(ranks)
    assert report.straggler is None and report.headline is None


def test_the_rank_that_waits_least_is_named_with_where_its_time_goes() -> None:
    fast = {"train_batch": 10.0, UNTIMED: 1.0}
    slow = {"train_batch": 10.0, UNTIMED: 21.0}  # +20 ms outside any timing
    ranks = [_rank(0, 22.0, fast), _rank(1, 2.0, slow), _rank(2, 22.5, fast)]
    report = _judge(ranks)
    assert report.straggler is ranks[1]
    assert report.extra_in == UNTIMED and abs(report.extra_in_s - 0.020) < 1e-9
    assert report.others_wait_in == "train_batch" and report.others_wait_op == "ddp_allreduce"
    assert report.headline is not None
    assert report.headline.startswith(
        "rank 1 is the straggler: it arrives late, with +20.0 ms per step of own work outside"
    )
    # each figure says what it measures: lateness is own work, the others' figure is waiting
    # (where: the part of the step, and the collective by its span name, as in the timings)
    assert report.headline.endswith(
        "the other ranks wait for it: they spend 20.2 ms per step longer in collectives "
        "than rank 1 (median), in train_batch, in ddp.allreduce"
    )
    # the distributed guide's example is this very sentence
    guide = page("docs/guide/distributed.md")
    example = next(b for b in guide.split("```") if b.startswith("\nverdict: straggler"))
    assert " ".join(example.split()) == f"verdict: straggler {report.headline}", example


def test_on_several_nodes_the_straggler_is_named_by_rank_and_node() -> None:
    fast = {"train_batch": 10.0, UNTIMED: 1.0}
    slow = {"train_batch": 10.0, UNTIMED: 21.0}
    ranks = [
        _rank(0, 22.0, fast, host="node0"),
        _rank(1, 22.5, fast, host="node0"),
        _rank(2, 22.0, fast, host="node1"),
        _rank(3, 2.0, slow, host="node1"),
    ]
    report = _judge(ranks)
    assert report.headline is not None
    assert report.headline.startswith("rank 3 on node1 is the straggler: it arrives late")
    assert "longer in collectives than rank 3 on node1" in report.headline
    assert all("rank 3 on node1" in line for line in report.evidence())
    summary = report.to_dict()
    assert summary["straggler"]["host"] == "node1"
    assert [r["host"] for r in summary["ranks"]] == ["node0", "node0", "node1", "node1"]


def test_verdict_evidence_comes_from_the_same_analysis_as_its_headline() -> None:
    from types import SimpleNamespace

    from otelprof.analysis.verdict import _stragglers

    fast = {"train_batch": 10.0, UNTIMED: 1.0}
    slow = {"train_batch": 10.0, "dataloader_next": 110.0, UNTIMED: 1.0}
    ranks = [_rank(0, 200.0, fast), _rank(1, 2.0, slow)]
    report = _judge(ranks)
    assert report.straggler is ranks[1]
    # rank 0's mean step is 1.3x rank 1's (a long last step, say): not a second straggler
    by_rank = {
        r.resource: SimpleNamespace(resource=r.resource, steps=SimpleNamespace(count=100, mean=m))
        for r, m in zip(ranks, (0.29, 0.22), strict=True)
    }
    evidence = _stragglers(SimpleNamespace(stragglers=report, ranks=by_rank))  # type: ignore[arg-type]
    assert evidence == report.evidence()
    assert all("rank 0" not in e for e in evidence), evidence
    assert evidence[0].startswith(
        "rank 1 arrives late: its own work (step time outside "
        "collectives) exceeds the other ranks' median by 110.0 ms"
    )
    assert "dataloader_next +110.0" in evidence[0]
    assert report.headline is not None and evidence[1] in report.headline
    doc = report.to_dict()["straggler"]
    assert doc["evidence"] == evidence and set(doc["measures"]) >= {
        "extra_ms_per_step",
        "others_wait_ms_per_step",
    }


def test_a_small_wait_gap_is_not_a_straggler() -> None:
    work = {"train_batch": 100.0}
    # 2 ms less waiting on a 100 ms step: under 5 % of the step, noise rather than a straggler
    report = _judge([_rank(0, 4.0, work), _rank(1, 2.0, work)])
    assert report.straggler is None


def _evidence_parts(line: str) -> dict[str, float]:
    """'... by 291.4 ms per step (untimed +322.4, train_batch -31.0 ms)' -> the parts."""
    inside = line.rsplit("(", 1)[1].removesuffix(" ms)")
    return {n: float(v) for n, v in (p.rsplit(" ", 1) for p in inside.split(", "))}


def test_the_evidence_adds_up_to_the_tables_own_work_with_the_parts_that_are_lower() -> None:
    from otelprof.analysis.stragglers import split_rows

    fast = {"train_batch": 100.0, "dataloader_next": 20.0, UNTIMED: 5.0}
    # slower outside any timing, but faster in train_batch (a smaller last batch, say)
    slow = {"train_batch": 69.0, "dataloader_next": 20.0, UNTIMED: 327.4}
    ranks = [_rank(0, 330.0, fast), _rank(1, 8.0, slow)]
    report = _judge(ranks)
    assert report.straggler is ranks[1]
    rows = {row["process"]: row for row in split_rows(report)}
    table = rows[ranks[1].label]["own work ms"] - rows[ranks[0].label]["own work ms"]
    assert round(table, 1) == 291.4
    first = report.evidence()[0]
    assert "median by 291.4 ms per step (untimed +322.4, train_batch -31.0 ms)" in first, first
    assert round(sum(_evidence_parts(first).values()), 1) == 291.4


def test_with_more_ranks_the_parts_still_add_up_to_the_figure_they_explain() -> None:
    ranks = [
        _rank(0, 60.0, {"train_batch": 100.0, "dataloader_next": 10.0, UNTIMED: 1.0}),
        _rank(1, 55.0, {"train_batch": 90.0, "dataloader_next": 30.0, UNTIMED: 2.0}),
        _rank(2, 58.0, {"train_batch": 110.0, "dataloader_next": 20.0, UNTIMED: 3.0}),
        _rank(3, 2.0, {"train_batch": 95.0, "dataloader_next": 70.0, UNTIMED: 1.0}),
    ]
    report = _judge(ranks)
    assert report.straggler is ranks[3]
    own = sorted(r.per_step(r.step_s - r.wait_s) for r in ranks[:3])[1]  # the others' median
    assert round(1e3 * report.extra_s, 1) == round(
        1e3 * (ranks[3].per_step(ranks[3].step_s - ranks[3].wait_s) - own), 1
    )
    parts = _evidence_parts(report.evidence()[0])
    assert abs(sum(parts.values()) - 1e3 * report.extra_s) < 0.15, parts
