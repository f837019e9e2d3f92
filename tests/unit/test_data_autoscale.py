"""The data plane's scaling policy (`data/service/autoscale.py`), without Ray.

Each case feeds measurements and checks the decisions against the rules as the spec's
`data_plane` knobs state them (thresholds, patience, cooldown, min/max, CPU budget).
"""

from __future__ import annotations

import pytest

from megatron_hdp.data.service.autoscale import Autoscaler, Measurement
from megatron_hdp.data.spec import PlaneSpec, SourceSpec, parse_spec

PLANE = PlaneSpec(scale_up_busy=0.8, scale_down_busy=0.3, scale_up_wait=0.05, patience=2,
                  cooldown=1)  # fmt: skip


def _source(name="heavy", low=1, high=3, cpus=0.5) -> SourceSpec:
    return SourceSpec(name, 1.0, path="x", loaders=low, max_loaders=high, cpus=cpus)


def _moves(decisions) -> list[tuple[str, int, int]]:
    return [(d.source, d.before, d.after) for d in decisions]


def test_busy_loaders_scale_up_after_patience_then_cool_down_then_stop_at_max():
    scaler = Autoscaler([_source()], PLANE)
    busy = lambda n: [Measurement(n, 0.95, 0.0)]  # noqa: E731
    assert scaler.decide(busy(1)) == []  # one busy measurement is not yet a streak
    (up,) = scaler.decide(busy(1))
    assert (up.before, up.after) == (1, 2) and "busy 95% (>= 80%)" in up.reason
    assert scaler.decide(busy(2)) == []  # cooldown: the new layout is measured first
    assert scaler.decide(busy(2)) == []  # patience again
    assert _moves(scaler.decide(busy(2))) == [("heavy", 2, 3)]
    scaler.decide(busy(3))  # cooldown
    scaler.decide(busy(3))
    (held,) = scaler.decide(busy(3))
    assert held.after == held.before == 3 and "its max of 3 loaders" in held.reason
    assert scaler.decide(busy(3)) == []  # a hold is recorded once per streak


def test_data_wait_on_a_source_scales_it_even_when_its_loaders_look_idle():
    scaler = Autoscaler([_source()], PLANE)
    waited = [Measurement(1, 0.5, 0.12)]
    scaler.decide(waited)
    (up,) = scaler.decide(waited)
    assert up.after == 2 and "waited 12% of their time on its reads (>= 5%)" in up.reason


def test_idle_loaders_scale_down_only_when_one_fewer_would_not_be_busy():
    scaler = Autoscaler([_source(low=1, high=4)], PLANE)
    # 0.25 busy on 2 loaders is 0.5 on 1 (< 0.8): down after patience
    assert scaler.decide([Measurement(2, 0.25, 0.0)]) == []
    (down,) = scaler.decide([Measurement(2, 0.25, 0.0)])
    assert (down.before, down.after) == (2, 1) and "1 would be 50% < 80%" in down.reason
    # with up at 0.5: 0.29 busy on 2 loaders would be 0.58 on 1 (>= 0.5): stays, however long
    near = PlaneSpec(scale_up_busy=0.5, scale_down_busy=0.3, patience=2, cooldown=1)
    scaler = Autoscaler([_source(low=1, high=4)], near)
    assert [scaler.decide([Measurement(2, 0.29, 0.0)]) for _ in range(3)] == [[], [], []]
    # at min (1) never
    scaler = Autoscaler([_source(low=1, high=4)], PLANE)
    assert [scaler.decide([Measurement(1, 0.0, 0.0)]) for _ in range(3)] == [[], [], []]
    # wait on the source blocks a scale-down, however idle its loaders
    scaler = Autoscaler([_source(low=1, high=4)], PLANE)
    first, second = (scaler.decide([Measurement(3, 0.1, 0.06)]) for _ in range(2))
    assert first == [] and _moves(second) == [("heavy", 3, 4)]


def test_the_cpu_budget_bounds_scale_ups_and_the_larger_wait_goes_first():
    plane = PlaneSpec(cpus=3.0, patience=1, cooldown=0)
    a, b = _source("a", cpus=0.5), _source("b", cpus=0.5)
    scaler = Autoscaler([a, b], plane)
    # 2 loaders + 2 shadows = 2 CPUs in use: room for 2 more loaders of 0.5
    moves = scaler.decide([Measurement(1, 0.9, 0.01), Measurement(1, 0.9, 0.2)])
    assert _moves(moves) == [("b", 1, 2), ("a", 1, 2)]
    # now 3 CPUs in use: both want more, the budget holds both, with the reason
    held = scaler.decide([Measurement(2, 0.9, 0.0), Measurement(2, 0.9, 0.0)])
    assert [d.after for d in held] == [2, 2]
    assert all("the CPU budget has 0 of the 0.5 CPUs" in d.reason for d in held)
    # the cluster's free CPUs bound it too
    scaler = Autoscaler([a], PlaneSpec(patience=1, cooldown=0))
    (d,) = scaler.decide([Measurement(1, 0.9, 0.0)], free_cpus=0.25)
    assert d.after == 1 and "0.25 of the 0.5" in d.reason


def test_the_spec_reads_loader_ranges_cpus_and_the_plane():
    spec = parse_spec(
        {
            "sources": [
                {"name": "cheap", "path": "c", "loaders": 2},
                {"name": "heavy", "path": "h", "loaders": {"min": 1, "max": 4}, "cpus": 0.5},
            ],
            "data_plane": {"cpus": 4, "interval_s": 0.5, "patience": 3},
        }
    )
    cheap, heavy = spec.sources
    assert cheap.loader_range == (2, 2) and cheap.cpus == 0.25
    assert heavy.loader_range == (1, 4) and heavy.loaders == 1 and heavy.cpus == 0.5
    assert spec.plane == PlaneSpec(cpus=4, interval_s=0.5, patience=3)
    assert (
        not Autoscaler([cheap], spec.plane).scales and Autoscaler(spec.sources, spec.plane).scales
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"loaders": {"min": 3, "max": 2}},
            "1 <= min <= max <= 64 (only those keys), got {'min': 3",
        ),
        ({"loaders": {"max": 65}}, "got {'max': 65}"),
        ({"loaders": {"min": 1, "max": 2, "start": 1}}, "only those keys"),
        (
            {"cpus": 0},
            "cpus must be a number above 0 (CPUs each of its loaders asks Ray for), got 0",
        ),
        ({"cpus": "1"}, "got '1'"),
    ],
)
def test_bad_loader_ranges_and_cpus_are_refused_naming_the_value(change, message):
    with pytest.raises(ValueError, match="source 'a'") as err:
        parse_spec({"sources": [{"name": "a", "path": "x", **change}]})
    assert message in str(err.value)


@pytest.mark.parametrize(
    "plane, message",
    [
        ({"cpus": 0.5}, "data_plane cpus 0.5 is below what the loaders start with: 1"),
        ({"interval_s": 0}, "data_plane interval_s must be a number from 0.01 to 3600, got 0"),
        ({"patience": 1.5}, "data_plane patience must be an integer from 1 to 1000, got 1.5"),
        ({"scale_down_busy": 0.9}, "scale_down_busy (0.9) must be below scale_up_busy (0.8)"),
        ({"budget": 2}, "data_plane has unknown keys ['budget']"),
        ([], "data_plane must be an object, got []"),
    ],
)
def test_a_bad_data_plane_is_refused_naming_the_value(plane, message):
    # two sources of 0.25 CPUs, each with a shadow: 1 CPU at start
    sources = [{"name": "a", "path": "x"}, {"name": "b", "path": "y"}]
    with pytest.raises(ValueError) as err:
        parse_spec({"sources": sources, "data_plane": plane})
    assert message in str(err.value)
