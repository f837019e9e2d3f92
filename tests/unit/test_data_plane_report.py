"""The Ray data plane in the run summary and its picture, from metrics records (pure)."""

from __future__ import annotations

import pytest

from megatron_hdp.report.data_plane import data_plane_totals
from megatron_hdp.report.summary import format_summary, run_summary


def _actor(source, slot, role, tokens, cpu_s, busy, uss):
    return {"source": source, "slot": slot, "role": role, "tokens": tokens, "cpu_s": cpu_s,
            "busy_share": busy, "uss": uss, "pss": uss // 2, "reads": 3}  # fmt: skip


SCALING = {
    "samples": [
        {"t": 0.5, "step": 2, "loaders": {"cheap": 1, "heavy": 1}, "busy": {}, "wait": {}},
        {"t": 1.0, "step": 4, "loaders": {"cheap": 1, "heavy": 2}, "busy": {}, "wait": {}},
    ],
    "decisions": [
        {"t": 1.0, "step": 4, "source": "heavy", "before": 1, "after": 2, "reason": "busy"},
        {"t": 1.0, "step": 4, "source": "cheap", "before": 1, "after": 1, "reason": "at max"},
    ],
}
RECORDS = [
    {"iteration": 1, "loss": 2.0, "tokens": 100, "seconds": 0.5, "data_wait_s": 0.2},
    {
        "iteration": 2, "loss": 1.9, "tokens": 100, "seconds": 0.5, "data_wait_s": 0.0,
        "data_service": [
            _actor("cheap", 0, "loader", 500, 0.1, 0.2, 2**20),
            _actor("heavy", 0, "loader", 300, 0.5, 0.9, 2**21),
            _actor("heavy", 1, "loader", 200, 0.3, 0.7, 2**21),
            _actor("cheap", None, "shadow", 0, 0.0, 0.0, 2**20),
            _actor("heavy", None, "shadow", 0, 0.0, 0.0, 2**21),
        ],
        "data_scaling": SCALING,
    },
]  # fmt: skip


def test_the_summary_sums_each_sources_loaders_and_lists_the_scale_events():
    totals = data_plane_totals(RECORDS)
    heavy = totals["sources"]["heavy"]
    assert heavy["loaders"] == 2 and heavy["tokens"] == 500 and heavy["cpu_s"] == 0.8
    assert heavy["busy_share"] == pytest.approx(0.8)  # the serving loaders' mean
    assert heavy["uss"] == 3 * 2**21 and heavy["pss"] == 3 * 2**20  # shadow included
    assert totals["sources"]["cheap"]["busy_share"] == 0.2
    assert [(e["source"], e["after"]) for e in totals["events"]] == [("heavy", 2)]
    assert len(totals["actors"]) == 5 and totals["actors"][1]["tokens"] == 300
    text = format_summary(run_summary(RECORDS))
    assert "data plane   cheap: 1 loaders, 500 tokens, 0.1 CPU s, busy 20%, USS 2 MiB" in text
    assert "heavy: 2 loaders, 500 tokens, 0.8 CPU s, busy 80%, USS 6 MiB, PSS 3 MiB" in text
    assert "1 scale events: heavy 1->2 (step 4)" in text
    assert run_summary(RECORDS[:1])["data_plane"] is None  # off the service: nothing


def test_the_picture_of_loaders_and_data_wait_is_drawn_from_the_metrics(tmp_path):
    pytest.importorskip("matplotlib")
    from megatron_hdp.plot import draw_data_plane
    from megatron_hdp.plot.data_plane import data_plane_from_records

    run = data_plane_from_records(RECORDS)
    assert run["log"]["samples"] == SCALING["samples"]
    # rank 0's steps: start time, step + wait seconds, wait seconds, tokens
    assert run["rows"] == [[[0.0, 0.7, 0.2, 100], [0.7, 0.5, 0.0, 100]]]
    path = draw_data_plane({"this run": run}, tmp_path / "plane.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    assert data_plane_from_records(RECORDS[:1]) is None
