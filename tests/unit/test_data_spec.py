"""The declarative data spec and the sampler's streams and schedule (pure layer)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_hdp.data.sampler import DatasetUnits, TokenBudgetSampler
from megatron_hdp.data.spec import load_spec, parse_spec


def _units(lengths) -> DatasetUnits:
    lengths = np.asarray(lengths, dtype=np.int64)
    return DatasetUnits(doc=np.arange(len(lengths)), start=np.zeros_like(lengths), length=lengths)


SPEC = {
    "sources": [
        {"name": "code", "path": "/d/code", "weight": 3},
        {"name": "web", "jsonl": ["a.jsonl", "b.jsonl"], "loaders": 2},
    ],
    "length_buckets": [{"name": "short", "max_tokens": 100}, {"name": "long"}],
    "schedule": [
        {"until_step": 10, "weights": {"code/short": 1}},
        {"until_step": 50, "weights": {"code": 1, "web/long": 1}},
    ],
}


def test_a_spec_parses_into_streams_buckets_and_phases(tmp_path):
    spec = parse_spec(SPEC, base=tmp_path)
    assert spec.streams == ("code/short", "code/long", "web/short", "web/long")
    assert [s.kind for s in spec.sources] == ["indexed", "jsonl"]
    assert spec.sources[1].jsonl == (str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"))
    assert spec.sources[1].loaders == 2 and spec.sources[0].weight == 3.0
    assert [spec.stream_source(k) for k in range(4)] == [0, 0, 1, 1]
    assert spec.bucket_of([1, 100, 101, 10**6]) == [0, 0, 1, 1]
    # A source's weight is shared by its buckets in proportion to their tokens.
    tokens = [100, 300, 50, 50]
    assert spec.stream_weights({"code": 1.0, "web/long": 1.0}, tokens) == [0.25, 0.75, 0.0, 1.0]
    spec.check_covers(50)
    with pytest.raises(ValueError, match="the schedule ends at step 50, but --train-iters is 51"):
        spec.check_covers(51)


def test_huge_source_weights_split_over_buckets_stay_finite(tmp_path):
    spec = parse_spec(
        {**SPEC, "schedule": None, "sources": [{"name": "code", "path": "x", "weight": 1e308}]},
        base=tmp_path,
    )
    weights = spec.stream_weights({"code": 1e308}, [300, 100])
    assert weights == [0.75e308, 0.25e308]
    sampler = TokenBudgetSampler(
        [_units([3] * 9), _units([3] * 3)], weights, seed=0, units_per_batch=2
    )
    assert sampler.weights.tolist() == [0.75, 0.25]


def test_yaml_and_json_files_give_the_same_spec(tmp_path):
    import yaml  # the dev extra has PyYAML

    (tmp_path / "s.json").write_text(json.dumps(SPEC))
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(SPEC))
    a, b = load_spec(tmp_path / "s.json"), load_spec(tmp_path / "s.yaml")
    assert (a.sources, a.buckets, a.schedule) == (b.sources, b.buckets, b.schedule)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"sources": []}, "'sources' must be a non-empty list"),
        ({"extra": 1}, "unknown keys ['extra']"),
        ({"sources": [{"name": "a/b", "path": "x"}]}, "needs a 'name' without '/'"),
        ({"sources": [{"name": "a", "path": "x", "jsonl": "y"}]}, "exactly one of path"),
        ({"sources": [{"name": "a", "path": "x", "loaders": 0}]}, "loaders must be an integer"),
        ({"sources": [{"name": "a", "builtin": "wiki"}]}, "builtin must be one of"),
        (
            {"sources": [{"name": "a", "path": "x", "weight": 0}], "schedule": None},
            "the source weights are all zero",
        ),
        ({"sources": [{"name": "a", "path": "x", "weight": True}]}, "must be a number"),
        (
            {"length_buckets": [{"name": "s", "max_tokens": 5}, {"name": "l", "max_tokens": 9}]},
            "leave out its max_tokens",
        ),
        (
            {"length_buckets": [{"name": "s", "max_tokens": 0}, {"name": "l"}]},
            "max_tokens must be an integer above 0",
        ),
        (
            {"schedule": [{"until_step": 5, "weights": {"code": 1}}, {"until_step": 5}]},
            "schedule[1] needs an integer until_step above 5",
        ),
        (
            {"schedule": [{"until_step": 5, "weights": {"code/medium": 1}}]},
            "names 'code/medium', which is no source or stream",
        ),
        ({"schedule": [{"until_step": 5, "weights": {"web": -0.5}}]}, "got -0.5"),
        ({"sources": [{"name": "a", "jsonl": []}], "schedule": None}, "jsonl names no file"),
        (
            {"length_buckets": [{"name": "s", "max_token": 5}, {"name": "l"}]},
            "length_buckets[0] has unknown keys ['max_token']",
        ),
        (
            {"schedule": [{"until_step": 5, "wieghts": {"code": 1}}]},
            "schedule[0] has unknown keys ['wieghts']",
        ),
    ],
)
def test_bad_specs_are_refused_with_the_entry_named(tmp_path, change, message):
    with pytest.raises(ValueError, match="data spec") as info:
        parse_spec({**SPEC, **change}, base=tmp_path)
    assert message in str(info.value)


def test_unreadable_or_malformed_spec_files_are_named(tmp_path):
    with pytest.raises(ValueError, match="cannot be read"):
        load_spec(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_spec(tmp_path / "bad.json")


def _mix(sampler, steps) -> list[list[int]]:
    """Tokens drawn from each stream, per batch."""
    out = []
    for _ in range(steps):
        tokens = [0] * len(sampler.datasets)
        for unit in sampler.next_batch():
            tokens[unit.dataset] += unit.length
        out.append(tokens)
    return out


def test_the_schedule_switches_weights_at_its_step_and_counts_shares_per_phase():
    streams = [_units([10] * 500), _units([10] * 500)]
    sampler = TokenBudgetSampler(
        streams, [1, 0], seed=1, tokens_per_batch=100, schedule=[(4, [1, 0]), (99, [1, 1])]
    )
    mix = _mix(sampler, 8)
    assert mix[:4] == [[100, 0]] * 4  # phase 1: stream 0 only
    # Phase 2 shares the tokens drawn within it (not since step 0): half each from step 5.
    assert mix[4:] == [[50, 50]] * 4


def test_a_stream_maps_to_its_source_and_a_paused_stream_is_never_drawn():
    streams = [_units([5] * 40), _units([7] * 40), _units([9] * 40)]
    sampler = TokenBudgetSampler(streams, [1, 0, 1], seed=3, tokens_per_batch=60, sources=[0, 0, 1])
    units = [u for _ in range(6) for u in sampler.next_batch()]
    assert {u.length for u in units} == {5, 9}  # the paused stream (length 7) never
    assert {u.dataset for u in units if u.length == 5} == {0}
    assert {u.dataset for u in units if u.length == 9} == {1}
    assert sampler.setup()["sources"] == [0, 0, 1]


def test_a_scheduled_sampler_resumes_mid_phase_exactly():
    def make():
        streams = [_units(np.arange(1, 61)), _units(np.arange(1, 41) * 2)]
        return TokenBudgetSampler(
            streams, [1, 1], seed=9, tokens_per_batch=90, schedule=[(3, [1, 3]), (20, [2, 1])]
        )

    straight = make()
    batches = [straight.next_batch() for _ in range(10)]
    first = make()
    for _ in range(4):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))
    resumed = make()
    resumed.load_state_dict(state)
    assert [resumed.next_batch() for _ in range(6)] == batches[4:]
    other = TokenBudgetSampler(
        [_units(np.arange(1, 61)), _units(np.arange(1, 41) * 2)],
        [1, 1],
        seed=9,
        tokens_per_batch=90,
        schedule=[(3, [1, 3]), (21, [2, 1])],
    )
    with pytest.raises(ValueError, match="schedule"):
        other.load_state_dict(state)


def test_samplers_without_a_schedule_keep_their_old_state_and_setup():
    sampler = TokenBudgetSampler([_units([4] * 9)], [1.0], seed=0, units_per_batch=2)
    sampler.next_batch()
    state = sampler.state_dict()
    assert set(state) == {"setup", "consumed", "tokens", "steps"}
    assert set(state["setup"]) == {
        "seed", "weights", "tokens_per_batch", "units_per_batch", "units", "unit_tokens"
    }  # fmt: skip


@pytest.mark.parametrize(
    "weights, message",
    [([1, -1], "got [1, -1]"), ([0, 0], "not all 0"), ([1, float("nan")], "finite")],
)
def test_bad_blend_weights_are_refused(weights, message):
    with pytest.raises(ValueError, match="blend weights must be positive") as info:
        TokenBudgetSampler([_units([3]), _units([3])], weights, seed=0, tokens_per_batch=9)
    assert message in str(info.value)


def test_the_ray_address_comes_from_the_flag_the_environment_or_the_default(monkeypatch):
    from megatron_hdp.data.service.address import (
        address_origin,
        resolve_ray_address,
        split_address,
    )

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert resolve_ray_address(None) == "127.0.0.1:6379"
    assert address_origin(None) == "the default Ray address"
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    assert (resolve_ray_address(None), address_origin(None)) == ("auto", "RAY_ADDRESS")
    with pytest.raises(ValueError, match="RAY_ADDRESS 'auto' is not HOST:PORT"):
        split_address("auto", "RAY_ADDRESS")
    assert resolve_ray_address("10.0.0.1:6380") == "10.0.0.1:6380"
    with pytest.raises(ValueError, match="not a Ray Client URL"):
        split_address("ray://head:10001")


def test_a_scheduled_state_is_refused_by_a_sampler_without_the_schedule():
    streams = [_units(np.arange(1, 61)), _units(np.arange(1, 41) * 2)]
    scheduled = TokenBudgetSampler(
        streams, [1, 1], seed=9, tokens_per_batch=90, schedule=[(3, [1, 3]), (20, [2, 1])]
    )
    scheduled.next_batch()
    plain = TokenBudgetSampler(streams, [1, 1], seed=9, tokens_per_batch=90)
    with pytest.raises(ValueError, match="schedule=.*but this run has schedule=None"):
        plain.load_state_dict(scheduled.state_dict())


def test_yaml_reads_exponent_weights_as_numbers(tmp_path):
    """PyYAML (YAML 1.1) reads `1e-3` and `1.5e3` as text; a spec means numbers."""
    (tmp_path / "s.yaml").write_text(
        "sources:\n"
        "  - {name: a, path: x, weight: 1e-3}\n"
        "  - {name: b, path: y, weight: 1.5e3}\n"
        "  - {name: c, path: z, weight: '2e1'}\n"
    )
    with pytest.raises(ValueError, match="source 'c' weight must be a number, got '2e1'"):
        load_spec(tmp_path / "s.yaml")  # quoted: still text, as in JSON
    (tmp_path / "s.yaml").write_text(
        "sources:\n  - {name: a, path: x, weight: 1e-3}\n  - {name: b, path: y, weight: 1.5e3}\n"
    )
    assert [s.weight for s in load_spec(tmp_path / "s.yaml").sources] == [0.001, 1500.0]


def test_a_changed_blend_on_resume_is_named_by_stream_and_share():
    from megatron_hdp.megatron.validation import check_resume_matches

    spec = parse_spec(SPEC)
    tokens = [100, 300, 50, 50]
    streams = [_units([10] * 10)] * 4

    def setup(weights):
        phases = [(until, spec.stream_weights(w, tokens)) for until, w in weights]
        sampler = TokenBudgetSampler(
            streams, phases[0][1], seed=0, units_per_batch=2, schedule=phases
        )
        return sampler.setup()

    before = setup(spec.phase_weights())
    changed = [(10, {"code/short": 1}), (50, {"code": 1, "web/long": 3})]
    meta = {"data": {"prefixes": ["p"], "setup": before}}
    with pytest.raises(ValueError) as info:
        check_resume_matches(
            meta, load="ck", model={}, data_setup=setup(changed), prefixes=["p"],
            streams=list(spec.streams),
        )  # fmt: skip
    assert str(info.value).startswith(
        "--load ck: the phase up to step 50: 'code/short' 12.5% -> 6.25%, 'code/long' 37.5% -> "
        "18.75%, 'web/long' 50% -> 75% (--hdp-data-spec or --data-path weights)"
    )
    with pytest.raises(ValueError, match=r"phases end at steps \[10, 50\], now \[10, 60\]"):
        check_resume_matches(
            meta, load="ck", model={}, prefixes=["p"], streams=list(spec.streams),
            data_setup=setup([(10, {"code/short": 1}), (60, {"code": 1, "web/long": 1})]),
        )  # fmt: skip
    plain = {"data": {"prefixes": ["a", "b"], "setup": {"weights": [0.25, 0.75]}}}
    with pytest.raises(ValueError, match="token shares changed: 'a' 25% -> 50%, 'b' 75% -> 50%"):
        check_resume_matches(
            plain, load="ck", model={}, data_setup={"weights": [0.5, 0.5]}, prefixes=["a", "b"],
            streams=["a", "b"],
        )  # fmt: skip


def test_a_yaml_syntax_error_is_one_line_with_its_position(tmp_path):
    (tmp_path / "s.yaml").write_text("sources:\n\t- {name: a, path: x}\n")
    with pytest.raises(ValueError) as info:
        load_spec(tmp_path / "s.yaml")
    message = str(info.value)
    assert "\n" not in message
    assert message.endswith(
        "is not valid YAML: line 2, column 1: found character '\\t' that cannot start any token"
    )


def test_a_spec_with_other_streams_on_resume_is_named_by_stream():
    from megatron_hdp.megatron.validation import check_resume_matches

    meta = {"data": {"prefixes": ["p"], "setup": {"units": [4, 4], "weights": [0.5, 0.5]}}}
    with pytest.raises(ValueError) as info:
        check_resume_matches(
            meta, load="ck", model={}, prefixes=["p"], streams=["lib/short", "lib/mid", "lib/long"],
            data_setup={"units": [2, 3, 3], "weights": [0.25, 0.25, 0.5]},
        )  # fmt: skip
    assert str(info.value) == (
        "--load ck: the checkpoint's data had 2 streams, this run has 3 (lib/short, lib/mid, "
        "lib/long): sources or length buckets of --hdp-data-spec were added or removed"
    )
