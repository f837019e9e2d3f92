"""What `--hdp-offload` did, as logged per interval and in the run summary (`report.offload`)."""

import dataclasses

import pytest

from megatron_hdp.report.offload import offload_line, offload_totals
from megatron_hdp.report.summary import format_summary, run_summary
from megatron_hdp.scheduler import plan_step
from megatron_hdp.scheduler.cost import H100, CostModel, ModelShape


def _record(iteration, rings, total, predicted, reason, measured=None):
    out = {
        "iteration": iteration,
        "loss": 2.0,
        "tokens": 100,
        "seconds": 1.0,
        "offload_rings": rings,
        "offload_rings_total": total,
        "offload_bytes_predicted": predicted,
        "offload_reason": reason,
    }
    if measured is not None:
        out["offload_bytes"] = measured
    return out


def test_interval_line_counts_rings_bytes_and_the_reason():
    records = [
        _record(1, 2, 3, 2.0e9, "wider ring faster (at ceil(s / C) ranks or more)", 1_500_000),
        _record(2, 1, 1, 1.0e9, "", 500_000),
        _record(3, 0, 2, 0.0, "wider rings faster by 4.2%", 0),
    ]
    totals = offload_totals(records)
    assert totals == {
        "steps": 3,
        "rings_offloaded": 3,
        "rings": 6,
        "bytes": 2_000_000,
        "bytes_predicted": 3.0e9,
        "reason": "wider ring faster (at ceil(s / C) ranks or more)",  # ties: first seen
    }
    assert offload_line(records) == (
        "offloaded 3 of 6 rings in 3 steps, 2.0 MB measured, 3.0 GB predicted to host; "
        "3 not: wider ring faster (at ceil(s / C) ranks or more)"
    )


def test_a_run_that_never_offloaded_says_so_in_one_line():
    records = [
        _record(1, 0, 2, 0.0, "wider rings faster by 4.2%", 0),
        _record(2, 0, 1, 0.0, "wider rings faster by 4.2%", 0),
        _record(3, 0, 1, 0.0, "no ring can shrink: ...", 0),
    ]
    line = offload_line(records)
    assert line == "--hdp-offload never offloaded in 3 steps (4 rings): wider rings faster by 4.2%"
    summary = run_summary(records, pool_size=4, policy="balanced")
    assert summary["offload"]["rings_offloaded"] == 0
    assert f"  offloading   {line}" in format_summary(summary).splitlines()


def test_runs_without_offloading_have_no_offload_line():
    records = [{"iteration": 1, "loss": 2.0, "tokens": 10, "seconds": 1.0}]
    assert offload_line(records) is None and offload_totals(records) is None
    summary = run_summary(records)
    assert summary["offload"] is None
    assert "offload" not in format_summary(summary)


def test_a_plan_s_decision_fills_the_record_and_the_line():
    """From the planner to the line: a slow-network batch of scarce 2M rings offloads."""
    shape = ModelShape(
        num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
        ffn_hidden_size=11008,
    )  # fmt: skip
    model = CostModel(shape, dataclasses.replace(H100, p2p_bandwidth=12.5e9))
    plan = plan_step(
        [1 << 21] * 4, pool_size=512, capacity=8192, policy="balanced", cost_model=model,
        offload=True,
    )  # fmt: skip
    record = {"iteration": 1, "loss": 1.0, "tokens": 1, "seconds": 1.0}
    record.update(plan.offload_decision.as_record())
    assert record["offload_rings"] == 4 == record["offload_rings_total"]
    assert record["offload_reason"] == ""
    line = offload_line([record])
    assert line.startswith("offloaded 4 of 4 rings in 1 step, ")
    assert line.endswith(" predicted to host")
    assert record["offload_bytes_predicted"] == pytest.approx(plan.offload_decision.host_bytes)
