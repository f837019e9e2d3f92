"""The end-of-run summary from metrics records, and the predictions recorded per step."""

import json
import math

import pytest

from megatron_hdp.report.prediction import (
    predicted_step_seconds,
    ring_attention_bytes,
    static_mesh_cp,
)
from megatron_hdp.report.summary import (
    format_summary,
    read_metrics,
    run_summary,
    traffic_tradeoff,
)
from megatron_hdp.report.timeline import timeline_record
from megatron_hdp.scheduler import plan_step
from megatron_hdp.scheduler.plan import MicroBatch, plan_from_rank_lists
from megatron_hdp.sharding import rank_token_counts
from tests.plan_checks import ring_waits_plan

RECORDS = [
    {
        "iteration": 11,
        "loss": 3.0,
        "tokens": 1000,
        "seconds": 0.5,
        "data_wait_s": 0.01,
        "num_sequences": 2,
        "mean_ranks_per_sequence": 3.0,
        "max_ranks_per_sequence": 4,
        "predicted_step_s": 0.2,
        "static_predicted_step_s": 0.3,
        "static_cp_size": 4,
        "attention_bytes": 100,
        "attention_bytes_predicted": 100,
        "static_attention_bytes_predicted": 400,
    },
    {
        "iteration": 12,
        "loss": 2.5,
        "tokens": 3000,
        "seconds": 1.5,
        "data_wait_s": 0.03,
        "num_sequences": 6,
        "mean_ranks_per_sequence": 1.0,
        "max_ranks_per_sequence": 2,
        "predicted_step_s": 0.6,
        "static_predicted_step_s": 1.5,
        "static_cp_size": 4,
        "attention_bytes": 300,
        "attention_bytes_predicted": 300,
        "static_attention_bytes_predicted": 600,
    },
    {  # no static plan of this batch: left out of the predicted comparisons
        "iteration": 13,
        "loss": 2.0,
        "tokens": 2000,
        "seconds": 2.0,
        "data_wait_s": 0.0,
        "num_sequences": 2,
        "mean_ranks_per_sequence": 2.0,
        "max_ranks_per_sequence": 3,
        "predicted_step_s": 0.9,
        "static_predicted_step_s": None,
        "static_cp_size": None,
        "attention_bytes": 50,
        "attention_bytes_predicted": 50,
        "static_attention_bytes_predicted": None,
    },
]


def write_metrics(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_summary_numbers_follow_from_the_metrics_file(tmp_path):
    records = read_metrics(write_metrics(tmp_path / "metrics.jsonl", RECORDS))
    s = run_summary(records, pool_size=4, policy="balanced")
    assert s["steps"] == 3 and (s["first_iteration"], s["last_iteration"]) == (11, 13)
    assert s["tokens"] == 6000 and s["seconds"] == pytest.approx(4.0)
    assert s["tokens_per_s"] == pytest.approx(6000 / 4.0)
    assert s["data_wait_s"] == pytest.approx(0.04)
    assert s["mean_step_s"] == pytest.approx(4.0 / 3)
    # per sequence: 2 x 3 + 6 x 1 + 2 x 2 = 16 ranks over 10 sequences
    assert s["mean_ranks_per_sequence"] == pytest.approx(1.6)
    assert s["max_ranks_per_sequence"] == 4
    # predicted: the two steps with both predictions only
    assert s["predicted_step_s"] == pytest.approx(0.4)
    assert s["static_predicted_step_s"] == pytest.approx(0.9)
    assert s["predicted_speedup"] == pytest.approx(1.8 / 0.8)
    # estimate: those steps' measured mean (1.0 s) times the predicted ratio
    assert s["static_step_estimate_s"] == pytest.approx(1.0 * 1.8 / 0.8)
    assert s["static_cp_size"] == 4
    assert s["attention_bytes"] == 400 and s["static_attention_bytes_predicted"] == 1000
    assert s["attention_bytes_predicted"] == 400
    assert s["attention_bytes_saved"] == 600
    assert s["attention_bytes_saved_share"] == pytest.approx(0.6)


def test_formatted_summary_shows_the_numbers_with_their_labels():
    text = format_summary(
        run_summary(
            RECORDS,
            pool_size=4,
            policy="balanced",
            locations=[("metrics", "/r/metrics.jsonl"), ("pictures", "/r/pictures")],
        )
    )
    lines = text.splitlines()
    assert lines[0] == (
        "run summary: 3 steps (iterations 11-13) on a pool of 4 ranks, balanced placement"
    )
    assert "1,500 tokens/s (6,000 tokens in 4.00 s of steps; 0.04 s more waiting" in text
    assert "ranks/seq    mean 1.60, max 4 (the static mesh: 4 for every sequence)" in text
    assert "predicted by the cost model" in text and "static mesh (DP 1 x CP 4): 2.25x" in text
    assert "(estimate: measured x predicted ratio): 2.250 s per step" in text
    assert "400 B measured (400 B predicted) vs 1.0 kB predicted for the static mesh" in text
    assert "600 B (60.0%) saved" in text
    why = lines[lines.index(next(x for x in lines if "600 B (60.0%) saved" in x)) + 1]
    assert why == (
        "               why: a sequence whole on one rank sends nothing; the static mesh "
        "shards every sequence over its CP group of 4."
    )
    assert lines[-2:] == ["  metrics      /r/metrics.jsonl", "  pictures     /r/pictures"]
    assert len(lines) <= 24  # one screen


def test_summary_of_records_without_predictions_leaves_them_out():
    bare = [{k: r[k] for k in ("iteration", "loss", "tokens", "seconds")} for r in RECORDS]
    s = run_summary(bare)
    assert s["tokens_per_s"] == pytest.approx(1500.0)
    assert s["predicted_step_s"] is None and s["attention_bytes"] is None
    assert s["mean_ranks_per_sequence"] is None
    text = format_summary(s)
    assert "predicted" not in text and "attention" not in text
    with pytest.raises(ValueError, match="no step records"):
        run_summary([])


def test_a_broken_metrics_line_is_named(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"iteration": 1}\n{"iteration": \n')
    with pytest.raises(ValueError, match="m.jsonl, line 2: not a JSON record"):
        read_metrics(path)


def reference_ring_bytes(plan, layers, kv_dim, kv_bytes, grad_bytes):
    """Replay attention.ring's messages: every member, every step, the source it sends."""
    total = 0
    for mb in plan.micro_batches:
        counts = rank_token_counts([plan.seqlens[i] for i in mb.seq_indices], mb.cp_size)
        active = [p for p, c in enumerate(counts) if c > 0]
        n = len(active)
        if n < 2:
            continue
        for me in range(n):
            for _ in ("forward K/V", "backward K/V"):
                for step in range(n - 1):
                    total += counts[active[(me - step) % n]] * 2 * kv_dim * kv_bytes
            for step in range(n):  # dK/dV accumulators: n hops home
                total += counts[active[(me - step) % n]] * 2 * kv_dim * grad_bytes
    return layers * total


def test_ring_attention_bytes_hand_example():
    # A ring of 2, one 8-token document: 4 tokens each; K/V 8 values per token.
    plan = plan_from_rank_lists(
        [8], 2, 4, "manual", [MicroBatch(order=0, ring=(0, 1), seq_indices=(0,))]
    )
    # forward 2 x 4 x 8 x 2 B, backward K/V the same, dK/dV 2 x 2 x 4 x 8 x 4 B; 3 layers
    expected = 3 * (128 + 128 + 512)
    sizes = {"num_layers": 3, "kv_dim": 4, "kv_element_bytes": 2, "grad_element_bytes": 4}
    assert ring_attention_bytes(plan, **sizes) == expected == 2304


@pytest.mark.parametrize("policy", ["balanced", "greedy", "static"])
def test_ring_attention_bytes_match_a_replay_of_the_ring_protocol(policy):
    lengths = [3, 40, 17, 5, 3, 16, 70, 9, 12, 2]  # the 3- and 2-token ones leave members idle
    plan = plan_step(lengths, pool_size=8, capacity=16, policy=policy)
    sizes = {"num_layers": 2, "kv_dim": 6, "kv_element_bytes": 4, "grad_element_bytes": 4}
    expected = reference_ring_bytes(plan, 2, 6, 4, 4)
    assert expected > 0
    assert ring_attention_bytes(plan, **sizes) == expected
    local = plan_step([3, 4, 5], pool_size=2, capacity=16, policy="greedy")
    assert ring_attention_bytes(local, **sizes) == 0


def test_a_short_pack_on_a_ring_counts_only_members_with_tokens():
    plan = plan_from_rank_lists(
        [3], 4, 1, "manual", [MicroBatch(order=0, ring=(0, 1, 2, 3), seq_indices=(0,))]
    )
    assert sum(c > 0 for c in rank_token_counts([3], 4)) == 3
    sizes = {"num_layers": 1, "kv_dim": 1, "kv_element_bytes": 1, "grad_element_bytes": 1}
    # 3 active members, 3 tokens: K/V 2 x 2 x 3 x 2 values, dK/dV 3 x 3 x 2 values
    assert ring_attention_bytes(plan, **sizes) == 2 * (2 * 2 * 3 + 3 * 3) == 42


@pytest.mark.parametrize(
    "seq_length, capacity, pool, cp_flag, expected",
    [
        (4096, 1024, 4, 1, 4),  # the demo: ceil(4096 / 1024)
        (4096, 1024, 8, 1, 4),
        (3000, 1024, 6, 1, 3),
        (4096, 1024, 6, 1, 6),  # 4 does not divide 6
        (512, 512, 4, 1, 1),
        (4096, 1024, 8, 8, 8),  # --context-parallel-size holds it: kept
        (4096, 1024, 8, 2, 4),  # too small: the smallest that holds it
    ],
)
def test_static_mesh_cp(seq_length, capacity, pool, cp_flag, expected):
    assert static_mesh_cp(seq_length, capacity, pool, cp_flag) == expected


def test_static_mesh_cp_names_an_impossible_pool():
    with pytest.raises(ValueError, match="pool of 2 ranks .* 4096 tokens with capacity 1024"):
        static_mesh_cp(4096, 1024, 2, 1)


def test_predicted_step_time_waits_for_ring_members():
    plan = ring_waits_plan()
    # rank 1 is busy until 3, so the ring runs 3-5
    assert predicted_step_seconds(plan) == 5.0


def test_timeline_record_joins_measured_times_with_the_plan():
    plan = plan_from_rank_lists(
        [3, 4, 16],
        4,
        8,
        "manual",
        [
            MicroBatch(order=0, ring=(0, 1, 2, 3), seq_indices=(0,), predicted_cost=1.0),
            MicroBatch(order=1, ring=(1,), seq_indices=(1,), predicted_cost=0.5),
            MicroBatch(order=2, ring=(0, 1), seq_indices=(2,), predicted_cost=2.0),
        ],
    )
    idle = [p for p, c in enumerate(rank_token_counts([3], 4)) if c == 0]
    assert idle == [3]  # rank 3 holds none of the 3-token sequence and skips it
    measured = {
        0: (3.0, [(0.0, 1.0), (1.5, 3.0)]),
        1: (3.1, [(0.0, 1.0), (1.0, 1.4), (1.5, 3.1)]),
        2: (1.0, [(0.0, 1.0)]),
        3: (0.0, []),
    }
    record = timeline_record(plan, measured, iteration=7)
    assert record["iteration"] == 7 and record["measured_step_s"] == 3.1
    assert record["predicted_step_s"] == 3.5  # ring (0, 1) waits for rank 1 until 1.5
    lanes = record["ranks"]
    assert [lane["planned_count"] for lane in lanes] == [2, 3, 1, 0]
    assert [lane["measured_count"] for lane in lanes] == [2, 3, 1, 0]
    assert lanes[3]["micro_batches"][0]["runs"] is False
    assert "measured_start" not in lanes[3]["micro_batches"][0]
    ring = lanes[0]["micro_batches"][1]
    assert ring["ring"] == [0, 1] and ring["predicted_start"] == 1.5
    assert (ring["measured_start"], ring["measured_end"]) == (1.5, 3.0)
    assert record["static"] is None
    assert math.isclose(lanes[1]["micro_batches"][1]["predicted_cost"], 0.5)


def _more_traffic(**step) -> list[dict]:
    """RECORDS[0] with more ring bytes than the static mesh's, and `step`'s fields."""
    return [
        {
            **{k: v for k, v in RECORDS[0].items() if "attention" not in k},
            "attention_bytes": 1500,
            "static_attention_bytes_predicted": 1000,
            **step,
        }
    ]


def test_more_ring_traffic_than_the_static_mesh_is_called_more_not_negative_savings():
    records = _more_traffic()
    text = format_summary(run_summary(records, pool_size=4, policy="balanced", locations=[]))
    assert "vs 1.0 kB predicted for the static mesh: 500 B (50.0%) more" in text
    assert "saved" not in text


@pytest.mark.parametrize(
    "ours, static, speedup",
    [(0.2, 0.3, "1.50x"), (0.4, 0.5, "1.25x")],  # the ratio of the two predictions
)
def test_more_ring_traffic_is_explained_by_wider_rings_and_the_shorter_step(ours, static, speedup):
    """One sentence under the traffic line: how wide the rings got and what they bought."""
    records = _more_traffic(
        static_cp_size=2,
        max_ranks_per_sequence=4,
        predicted_step_s=ours,
        static_predicted_step_s=static,
    )
    lines = format_summary(run_summary(records, pool_size=4, policy="balanced")).splitlines()
    at = next(k for k, line in enumerate(lines) if line.startswith("  attention "))
    assert lines[at].endswith("500 B (50.0%) more")
    assert lines[at + 1] == (
        "               the trade-off: the planner widened long sequences' rings to up to 4 "
        f"ranks (the static mesh: 2) for a step the cost model predicts {speedup} shorter."
    )
    assert at + 2 == len(lines)  # one sentence, the summary's last line here


def test_more_ring_traffic_without_a_shorter_step_says_so():
    records = _more_traffic(
        static_cp_size=2,
        max_ranks_per_sequence=4,
        predicted_step_s=0.5,
        static_predicted_step_s=0.45,
    )
    s = run_summary(records, pool_size=4, policy="balanced")
    assert traffic_tradeoff(s) == (
        "the trade-off: the planner widened long sequences' rings to up to 4 ranks (the static "
        "mesh: 2), but the cost model predicts no shorter step (0.90x)."
    )
    # rings no wider than the mesh's CP group (RECORDS[0]: CP 4, widest 4) are not called wider
    s = run_summary(_more_traffic(), pool_size=4, policy="balanced")
    assert traffic_tradeoff(s) == (
        "the trade-off: the planner gave sequences rings that send more than the static "
        "mesh's CP group of 4 for a step the cost model predicts 1.50x shorter."
    )


def test_no_tradeoff_sentence_without_a_static_mesh_to_compare():
    records = [{**r, "static_cp_size": None} for r in _more_traffic()]
    s = run_summary(records, pool_size=4, policy="balanced")
    assert traffic_tradeoff(s) is None
    text = format_summary(s)
    assert "trade-off" not in text and "why:" not in text
    assert "ranks/seq    mean 3.00, max 4\n" in text + "\n"  # no static mesh to name
